#!/usr/bin/env bash
# Make the benchmark venv: this project plus the `transferqueue` PyPI package to compare with.
# transferqueue is a benchmark-only dependency: it never enters the runtime environment (.venv).
#
#   bash benchmarks/setup_bench_env.sh              # creates .venv-bench in the repo root
#   BENCH_VENV=/tmp/vb bash benchmarks/setup_bench_env.sh
#   .venv-bench/bin/python -m benchmarks.run
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${BENCH_VENV:-$ROOT/.venv-bench}"
PY="${PY:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
TQ_SPEC="${TQ_SPEC:-transferqueue==0.1.11}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
"$VENV/bin/pip" install -q --upgrade pip
# torch first: transferqueue's dependencies then keep this build instead of pulling another.
"$VENV/bin/pip" install -q "$TORCH_SPEC"
# demo: the driver section runs the tiny transformers model; bench: psutil.
"$VENV/bin/pip" install -q -e "$ROOT[demo,bench]"
"$VENV/bin/pip" install -q "$TQ_SPEC"
"$VENV/bin/python" -c "import torch, transformers, psutil, transfer_queue; print('benchmark venv ready:', '$VENV', 'torch', torch.__version__)"
