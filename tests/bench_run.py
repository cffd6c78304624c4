"""Runs a benchmark module in a child process of its own (its own Ray, this checkout on its
path) and returns the JSON it wrote to ``--out`` and its stdout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_benchmark(module: str, *args: str, out: Path, timeout: float = 420) -> tuple[dict, str]:
    """``python -m module *args --out out`` from the repository root; it must exit 0."""
    proc = subprocess.run(
        [sys.executable, "-m", module, *args, "--out", str(out)],
        cwd=ROOT,
        env=dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stdout
