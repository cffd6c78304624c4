"""``make gpu-check``: every path of the data plane that needs CUDA, checked in one call.

Without CUDA it prints one JSON line ``{"check": "gpu", "skipped": why}`` and exits 0
in seconds (it imports torch, nothing more). With CUDA, on one local Ray (loopback,
explicit CPUs) and one data-plane service, in under 5 minutes on one GPU:

1. ``roundtrip``: CUDA tensors put (dense, jagged ``torch.nested``, a list of rows, one
   non-contiguous: the ``.cpu()`` fallback) in several dtypes with random bits, beside an
   object column, read back to the host and to the GPU: bit for bit; the same through
   the in-process client.
2. ``fetch``: ``get_data(meta, device="cuda")`` of ``--size`` bytes (stored from the
   host) against torch's own pinned host-to-device copy of as many bytes, in the same
   run: target >= 0.8 of it. Beside it, for information, a pageable ``.to("cuda")`` and
   a put from the GPU against a pinned device-to-host copy.
3. ``logprobs``: one policy worker on the GPU fetches its batch to the GPU, computes
   logprobs and writes them back; they must equal the CPU reference of the demo's tiny
   model (built from its config with a fixed seed) within ``LOGPROB_ATOL``.

A table, then ONE JSON line (``--out`` writes it to a file too). Exit 1 when a check
fails (bits differ, logprobs outside the tolerance, an error); a missed speed target
is reported, not a failure.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.common import BENCH_NAMESPACE, GiB, MiB, markdown_table, median, parse_size

SERVICE_NAME = "dataplane-gpu-check"
FETCH_TARGET = 0.8  # of a pinned torch host-to-device copy of the same bytes
# Both sides compute in float32; CUDA kernels sum in another order than the CPU's.
LOGPROB_ATOL = 1e-3


def skip_reason() -> str | None:
    """Why this machine cannot run the check (None: it can)."""
    import torch

    if not torch.cuda.is_available():
        return (
            f"no CUDA device: torch {torch.__version__} (built for CUDA {torch.version.cuda}) "
            "sees none"
        )
    return None


# ---- helpers ------------------------------------------------------------------------------


def _bits(t: Any) -> Any:
    """A dense tensor's bytes on the host, to compare exactly (NaN patterns included)."""
    import torch

    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _rows(value: Any) -> list:
    """A field's rows: of a dense tensor, a jagged one or a list of tensors."""
    if isinstance(value, list):
        return value
    return list(value.unbind()) if value.is_nested else list(value.unbind(0))


def _same_rows(got: Any, sent: Any, order: Sequence[int]) -> bool:
    """Row j of ``got`` is row ``order[j]`` of ``sent``, bit for bit, dtype and shape too."""
    import torch

    rows, want = _rows(got), _rows(sent)
    return len(rows) == len(order) and all(
        r.dtype == want[i].dtype
        and r.shape == want[i].shape
        and torch.equal(_bits(r), _bits(want[i]))
        for r, i in zip(rows, order)
    )


def _timed(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs (after one untimed run)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return median(times)


# ---- 1. put / get of CUDA tensors, bit for bit ----------------------------------------------


def _cuda_fields(device: Any, rows: int) -> dict[str, Any]:
    """One field per (dtype, layout), random bits (NaN patterns included), on ``device``;
    each over the unit's inline-answer size (64 KiB), so a read maps the unit's chunk."""
    import torch

    g = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {}
    dtypes = [
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.uint8,
        torch.bool,
    ]
    lengths = torch.randint(0, 9, (rows,), generator=g)
    offsets = torch.zeros(rows + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    for dt in dtypes:
        name = str(dt).removeprefix("torch.")

        def random(*shape: int, dt: Any = dt) -> Any:
            if dt == torch.bool:
                return torch.randint(0, 2, shape, generator=g).bool()
            size = torch.tensor([], dtype=dt).element_size()
            raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * size), generator=g)
            return raw.to(torch.uint8).view(dt)

        out[f"dense_{name}"] = random(rows, 80, 64).to(device)
        values = random(int(offsets[-1]), 1024).to(device)
        out[f"nested_{name}"] = torch.nested.nested_tensor_from_jagged(values, offsets.to(device))
        out[f"rows_{name}"] = [random(int(n) + 1, 1024).to(device) for n in lengths]
    out["dense_noncontiguous"] = random(7, rows, dt=torch.float32).to(device).t()
    return out


def check_roundtrip(client: Any, in_process: Any, device: Any) -> dict[str, Any]:
    """CUDA tensors put, read to the host and to the GPU, on both clients: bit for bit."""
    from dataplane_client.wire import shm

    rows = 32
    fields = _cuda_fields(device, rows)
    notes = [f"row {i}" for i in range(rows)]
    order = [*range(1, rows, 2), *range(0, rows, 2)]  # out of order: many runs to gather
    failed: list[str] = []
    for label, c in (("ray", client), ("in_process", in_process)):
        pid = f"gpu-roundtrip-{label}-{uuid.uuid4().hex[:6]}"
        names = [*fields, "note"]
        c.register_partition(pid, fields=names, consumer_tasks=[], object_fields=["note"])
        ids = [f"s{i}" for i in range(rows)]
        c.put_samples(ids, pid, {**fields, "note": notes})
        for target in (None, device):
            for read in (list(range(rows)), order):
                got = c.get_samples([ids[i] for i in read], pid, names, device=target)
                kind = "shuffled" if read == order else "in order"
                where = f"{'host' if target is None else target}/{kind}"
                for name, sent in fields.items():
                    on = got[name].device.type
                    if on != ("cpu" if target is None else device.type) or not _same_rows(
                        got[name], sent, read
                    ):
                        failed.append(f"{label}/{where}/{name}")
                if list(got["note"]) != [notes[i] for i in read]:
                    failed.append(f"{label}/{where}/note")
        c.delete_partition(pid)
    return {
        "ok": not failed,
        "fields": len(fields) + 1,
        "failed": failed,
        "pinned_bytes": shm.write_maps.pinned_bytes(),
    }


# ---- 2. throughput, against torch's own copies ----------------------------------------------


def check_fetch(client: Any, device: Any, nbytes: int, repeats: int) -> dict[str, Any]:
    """get_data(device=cuda) vs a pinned torch host-to-device copy of the same bytes."""
    import torch

    rows = 64
    width = nbytes // rows
    pid = f"gpu-fetch-{uuid.uuid4().hex[:6]}"
    client.register_partition(pid, fields=["x"], consumer_tasks=[])
    ids = [f"s{i}" for i in range(rows)]
    host = torch.randint(0, 256, (rows, width), dtype=torch.uint8)
    meta = client.put_samples(ids, pid, {"x": host})
    nbytes = rows * width

    def fetch() -> None:
        td = client.get_data(meta, device=device)
        assert td["x"].device == device, td["x"].device

    ours = _timed(fetch, repeats)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pinned.copy_(host.reshape(-1))
    dest = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def pinned_copy() -> None:
        dest.copy_(pinned, non_blocking=True)
        torch.cuda.synchronize(device)

    def pageable_copy() -> None:
        host.to(device)
        torch.cuda.synchronize(device)

    reference = _timed(pinned_copy, repeats)
    pageable = _timed(pageable_copy, repeats)
    same = _same_rows(client.get_data(meta, device=device)["x"], host, range(rows))

    # A put from the GPU (overwriting the same rows) vs a pinned device-to-host copy.
    on_gpu = host.to(device)
    put = _timed(lambda: client.put_samples(ids, pid, {"x": on_gpu}, overwrite=True), repeats)

    def pinned_d2h() -> None:
        pinned.copy_(on_gpu.reshape(-1), non_blocking=True)
        torch.cuda.synchronize(device)

    d2h = _timed(pinned_d2h, repeats)
    client.delete_partition(pid)
    ratio = reference / ours
    return {
        "ok": same,
        "bytes": nbytes,
        "get_gibps": nbytes / ours / GiB,
        "pinned_h2d_gibps": nbytes / reference / GiB,
        "pageable_h2d_gibps": nbytes / pageable / GiB,
        "ratio": ratio,
        "target": FETCH_TARGET,
        "met": ratio >= FETCH_TARGET,
        "put_from_gpu_gibps": nbytes / put / GiB,
        "pinned_d2h_gibps": nbytes / d2h / GiB,
        "put_ratio": d2h / put,
    }


# ---- 3. the one-rank logprob pass on the GPU --------------------------------------------------


def check_logprobs(service: Any, client: Any, num_gpus: int = 1) -> dict[str, Any]:
    """One policy worker on the GPU vs the CPU reference of the same seeded tiny model."""
    import ray
    import torch

    from policy_workers.config import ModelConfig, PolicyConfig
    from policy_workers.model import build_hf_model, reference_logprobs
    from policy_workers.tq_policy import TQPolicy

    model = ModelConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, seed=11)
    lengths = [5, 17, 3, 24, 9, 12, 20, 7]
    g = torch.Generator().manual_seed(42)
    rows = [torch.randint(1, model.vocab_size, (n,), generator=g) for n in lengths]
    padded = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=0)
    with torch.no_grad():
        expected = reference_logprobs(build_hf_model(model), padded, torch.tensor(lengths))

    cfg = PolicyConfig(
        dp=1,
        tp=1,
        model=model,
        logprob_batch_size=4,
        pad_token_id=0,
        num_cpus_per_worker=1,
        num_gpus_per_worker=num_gpus,
        data_plane=service.config,
    )
    if ray.cluster_resources().get("GPU", 0) < num_gpus:  # a GPU worker would wait for ever
        raise RuntimeError(f"the local Ray has no GPU: {ray.cluster_resources()}")
    policy = TQPolicy(cfg)
    try:
        pid = f"gpu-logprobs-{uuid.uuid4().hex[:6]}"
        client.register_partition(pid, fields=["input_ids", "input_lengths"], consumer_tasks=[])
        meta = client.put_samples(
            [f"s{i}" for i in range(len(rows))],
            pid,
            {"input_ids": rows, "input_lengths": torch.tensor(lengths)},
        )
        (worker_device,) = {str(d) for d in policy.run_on_all_workers("_fetch_device")}
        out = policy.get_logprobs_from_meta(meta)
        got = policy.read_from_dataplane(out, ["prev_logprobs"])["prev_logprobs"]
        client.delete_partition(pid)
    finally:
        policy.shutdown()
    diff = float((got.cpu() - expected).abs().max())
    return {
        "ok": diff <= LOGPROB_ATOL and worker_device.startswith("cuda"),
        "max_abs_diff": diff,
        "atol": LOGPROB_ATOL,
        "worker_fetch_device": worker_device,
    }


# ---- the run ---------------------------------------------------------------------------------


def _attempt(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A check's result; an error becomes a failed result naming it (the others still run)."""
    print(f"[gpu-check] {name} ...", flush=True)
    t0 = time.perf_counter()
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - reported in the JSON, the run goes on
        traceback.print_exc()
        result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    result["seconds"] = round(time.perf_counter() - t0, 2)
    return result


def _table(report: dict[str, Any]) -> str:
    fetch = report.get("fetch", {})
    lp = report.get("logprobs", {})
    rt = report.get("roundtrip", {})

    def num(key: str, src: dict[str, Any], digits: int = 2) -> str:
        value = src.get(key)
        return "-" if value is None else f"{value:.{digits}f}"

    rows = [
        [
            "roundtrip (bit for bit)",
            "ok" if rt.get("ok") else "FAILED",
            f"{rt.get('fields', '-')} fields; failed: {rt.get('failed', rt.get('error'))}",
        ],
        [
            "get to GPU / pinned H2D",
            "met" if fetch.get("met") else "MISSED" if fetch.get("ok") else "FAILED",
            f"{num('get_gibps', fetch)} / {num('pinned_h2d_gibps', fetch)} GiB/s = {num('ratio', fetch)} (target >= {FETCH_TARGET}); pageable .to(): {num('pageable_h2d_gibps', fetch)}",
        ],
        [
            "put from GPU / pinned D2H",
            "info",
            f"{num('put_from_gpu_gibps', fetch)} / {num('pinned_d2h_gibps', fetch)} GiB/s = {num('put_ratio', fetch)}",
        ],
        [
            "logprobs GPU vs CPU",
            "ok" if lp.get("ok") else "FAILED",
            f"max |diff| {lp.get('max_abs_diff', lp.get('error'))} (atol {LOGPROB_ATOL}); worker fetch to {lp.get('worker_fetch_device', '-')}",
        ],
    ]
    return markdown_table(["check", "verdict", "figures"], rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_check", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--size", default="512M", help="bytes of the fetch check (default 512M)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per figure (median)")
    parser.add_argument("--num-cpus", type=int, default=8, help="the local Ray's logical CPUs")
    parser.add_argument("--out", help="also write the JSON line to this file")
    args = parser.parse_args(argv)

    reason = skip_reason()
    if reason is not None:
        line = json.dumps({"check": "gpu", "skipped": reason})
        print(line)
        if args.out:
            with open(args.out, "w") as f:
                f.write(line + "\n")
        return 0

    import ray
    import torch

    from benchmarks.common import memcpy_gibps, start_ray, start_service
    from dataplane_server.core.inprocess import InProcessDataPlaneClient

    started = time.perf_counter()
    nbytes = parse_size(args.size)
    device = torch.device("cuda", torch.cuda.current_device())
    report: dict[str, Any] = {
        "check": "gpu",
        "gpu": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "memcpy_gibps": round(memcpy_gibps(), 2),
    }
    start_ray(args.num_cpus, max(2 * GiB, 2 * nbytes + 256 * MiB), torch.cuda.device_count())
    service = start_service(
        SERVICE_NAME, BENCH_NAMESPACE, num_storage_units=1, unit_capacity_bytes=4 * nbytes + GiB
    )
    client = service.client()
    in_process = InProcessDataPlaneClient()
    try:
        report["roundtrip"] = _attempt(
            "roundtrip", lambda: check_roundtrip(client, in_process, device)
        )
        report["fetch"] = _attempt(
            "fetch", lambda: check_fetch(client, device, nbytes, args.repeats)
        )
        report["logprobs"] = _attempt("logprobs", lambda: check_logprobs(service, client))
    finally:
        in_process.close()
        service.shutdown()
        ray.shutdown()
    report["ok"] = all(report[k].get("ok") for k in ("roundtrip", "fetch", "logprobs"))
    report["seconds"] = round(time.perf_counter() - started, 1)
    print(_table(report))
    line = json.dumps(report, default=str)
    print(line, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
