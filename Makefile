# Everyday targets. `make demo` and `make test` work from a fresh clone: both set up first.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU machines get the small CPU build of torch (it lies on this workplace's disk);
# on a machine with an NVIDIA driver pip's default CUDA build is kept instead.
CPU_TORCH ?= torch==2.13.0
PYTEST_ARGS ?=
DEMO_ARGS ?=
BENCH_ARGS ?=
GPU_CHECK_ARGS ?=

export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0

.PHONY: setup native-deps test test-fast demo bench bench-setup bench-tq gpu-check rdma-check lint format proto clean

setup: $(VENV)/.installed native-deps

# Debian's libibverbs1: Mooncake's engine links it even for TCP. Installed where apt-get
# is there and we are root; elsewhere one line, and cross-node gets use Ray's path.
native-deps:
	@if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1 '; then \
		if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
			(apt-get install -y -q --no-install-recommends libibverbs1 >/dev/null 2>&1 \
			|| (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends libibverbs1 >/dev/null 2>&1)) \
			|| echo "libibverbs1 not installed: Mooncake will not load, cross-node gets use Ray's path"; \
		else \
			echo "libibverbs1 missing (needs apt-get as root): Mooncake will not load, cross-node gets use Ray's path"; \
		fi; \
	fi

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1; then \
		echo "NVIDIA driver found: keeping pip's CUDA torch"; \
	else \
		$(BIN)/pip install -q "$(CPU_TORCH)"; \
	fi
	$(BIN)/pip install -q -e '.[dev]'
	@# Optional: where no wheel fits (another Python or CPU), cross-node gets use Ray's path.
	$(BIN)/pip install -q -e '.[mooncake]' \
		|| echo "Mooncake not installed: cross-node gets use Ray's object transfer"
	@touch $@

test: setup
	$(BIN)/pytest -q $(PYTEST_ARGS)

# Unit and key-space tests only: no Ray cluster, no slow end-to-end runs (under a minute).
test-fast: setup
	$(BIN)/pytest -q -m "not slow and not ray" $(PYTEST_ARGS)

demo: setup
	$(BIN)/dataplane demo $(DEMO_ARGS)

bench: setup
	$(BIN)/python -m benchmarks.run $(BENCH_ARGS)

# Every path that needs CUDA in one call (under 5 minutes on one GPU): put/get of CUDA
# tensors bit for bit, fetch-to-GPU against a pinned torch copy, the logprob pass on the
# GPU against the CPU. Without CUDA: one JSON "skipped" line, exit 0, in seconds.
gpu-check: setup
	$(BIN)/python -m benchmarks.gpu_check $(GPU_CHECK_ARGS)

# Mooncake's transfer engine over RDMA beside its TCP path (128 MiB and 1 GiB pulls, bytes
# checked) where an RDMA NIC has an active port; without one: one JSON "skipped" line, exit 0.
rdma-check: setup
	$(BIN)/python -m benchmarks.rdma_check $(RDMA_CHECK_ARGS)

# The same benchmarks with the transferqueue package beside ours, in a venv of their own
# (transferqueue is never a runtime dependency).
bench-setup: .venv-bench/.installed

.venv-bench/.installed: pyproject.toml benchmarks/setup_bench_env.sh
	bash benchmarks/setup_bench_env.sh
	@touch $@

bench-tq: bench-setup
	.venv-bench/bin/python -m benchmarks.run $(BENCH_ARGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# Regenerate dataplane_server/admin_pb from proto/ with the pinned generator
# (gen_proto.GENERATOR), in a venv of its own: its old output is what keeps grpcio/protobuf
# minimums low for users.
PROTO_VENV ?= .venv-proto
proto:
	@test -x $(PROTO_VENV)/bin/python || $(PY) -m venv $(PROTO_VENV)
	$(PROTO_VENV)/bin/pip install -q "$$(sed -n 's/^GENERATOR = "\(.*\)"/\1/p' dataplane_server/admin/gen_proto.py)"
	$(PROTO_VENV)/bin/python dataplane_server/admin/gen_proto.py

clean:
	rm -rf $(VENV) .venv-bench $(PROTO_VENV) .pytest_cache .ruff_cache .hypothesis
