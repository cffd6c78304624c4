"""Scale: controller memory per sample with 1M samples stored; small-fetch latency at that size.

The driver writes 1M tiny samples (one ``int64[1]`` field, ids ``s0000000``...)
in puts of 10k. Controller memory is measured two ways: its own metadata
accounting (``Controller.memory_footprint``) and the growth of the controller
process's USS (psutil, pid asked from inside the actor). A 4-sample fetch
(``get_samples`` of 4 random ids) is timed on a small store and again with 1M
samples stored, each fetch interleaved with a no-op controller call from the same
driver (one Ray round trip to the controller: the floor a get's location lookup
pays). Targets: <= 256 B/sample; the 4-sample get's p50 with 1M stored <= 2x the
no-op call's p50.
"""

from __future__ import annotations

import os
import random
import sys
import time
from typing import Any

import psutil
import ray
import torch

from benchmarks.common import (
    MiB,
    Options,
    Section,
    Table,
    Target,
    median,
    percentile,
    start_service,
)

SERVICE_NAME = "bench-scale"
NAMESPACE = "bench"
PARTITION = "scale"
FULL_SAMPLES = 1_000_000
QUICK_SAMPLES = 20_000
SMALL_STORE = 1_000
GET_OVER_NOOP = 2.0  # target: 4-sample get p50 (1M stored) <= this x a no-op controller call


def _controller_pid(controller: Any) -> int:
    return ray.get(controller.__ray_call__.remote(lambda self: os.getpid()))


def _uss(pid: int) -> int:
    return psutil.Process(pid).memory_full_info().uss


def _breakdown(controller: Any, partition: str) -> dict[str, int]:
    """Bytes of each metadata structure of a partition (measured inside the controller)."""

    def measure(self, pid):
        import sys as _sys

        p = self.keys.partition(pid)
        return {
            "row_of dict": _sys.getsizeof(p.row_of),
            "sample id strings": sum(_sys.getsizeof(s) for s in p.row_of),
            "ids list": _sys.getsizeof(p.ids),
            "tags list": _sys.getsizeof(p.tags),
            "group_index dict": _sys.getsizeof(p.group_index),
            "numpy columns": int(
                p.live.nbytes
                + p.group_code.nbytes
                + p.group_live.nbytes
                + p.seq_len.nbytes
                + p.unit.nbytes
                + sum(a.nbytes for a in p.produced.values())
                + sum(a.nbytes for a in p.consumed.values())
            ),
        }

    return ray.get(controller.__ray_call__.remote(measure, partition))


def _fetch_latencies(
    client: Any, controller: Any, n_stored: int, trials: int, rng: random.Random
) -> tuple[list[float], list[float]]:
    """4-sample gets and no-op controller calls, interleaved: (get seconds, no-op seconds)."""
    gets, noops = [], []
    for _ in range(trials):
        ids = [f"s{i:07d}" for i in rng.sample(range(n_stored), 4)]
        t0 = time.perf_counter()
        client.get_samples(ids, PARTITION, ["x"])
        t1 = time.perf_counter()
        ray.get(controller.set_draining.remote(False))
        noops.append(time.perf_counter() - t1)
        gets.append(t1 - t0)
    return gets, noops


def _write(client: Any, start: int, end: int, chunk: int) -> float:
    t0 = time.perf_counter()
    for s in range(start, end, chunk):
        k = min(chunk, end - s)
        client.put_samples(
            [f"s{i:07d}" for i in range(s, s + k)],
            PARTITION,
            {"x": torch.arange(s, s + k, dtype=torch.int64).reshape(k, 1)},
        )
    return time.perf_counter() - t0


def run(opts: Options) -> Section:

    section = Section("scale")
    n = QUICK_SAMPLES if opts.quick else FULL_SAMPLES
    chunk = 5_000 if opts.quick else 10_000
    trials = 20 if opts.quick else 100
    rng = random.Random(0)
    handle = start_service(SERVICE_NAME, NAMESPACE)
    try:
        client = handle.client()
        client.register_partition(PARTITION, fields=["x"])
        pid = _controller_pid(handle.controller)
        uss0 = _uss(pid)
        small_write_s = _write(client, 0, SMALL_STORE, chunk)
        small, _ = _fetch_latencies(client, handle.controller, SMALL_STORE, trials, rng)
        write_s = small_write_s + _write(client, SMALL_STORE, n, chunk)
        uss1 = _uss(pid)
        footprint = ray.get(handle.controller.memory_footprint.remote())[PARTITION]
        big, noop = _fetch_latencies(client, handle.controller, n, trials, rng)
        breakdown = _breakdown(handle.controller, PARTITION)
    finally:
        handle.shutdown()

    per_sample_footprint = footprint["bytes"] / footprint["samples"]
    per_sample_uss = (uss1 - uss0) / n
    section.tables.append(
        Table(
            f"controller memory with {n:,} samples (puts of {chunk:,})",
            ["measure", "total MiB", "bytes/sample"],
            [
                ["Controller.memory_footprint()", footprint["bytes"] / MiB, per_sample_footprint],
                ["controller process USS growth (psutil)", (uss1 - uss0) / MiB, per_sample_uss],
            ],
        )
    )
    section.tables.append(
        Table(
            "4-sample get_samples latency, ms",
            ["samples stored", "n", "p50", "p99"],
            [
                [SMALL_STORE, len(small), 1e3 * median(small), 1e3 * percentile(small, 99)],
                [n, len(big), 1e3 * median(big), 1e3 * percentile(big, 99)],
                [
                    "no-op controller call (interleaved with the 1M gets)",
                    len(noop),
                    1e3 * median(noop),
                    1e3 * percentile(noop, 99),
                ],
            ],
        )
    )
    section.tables.append(
        Table(
            "writing them",
            ["samples", "seconds", "samples/s"],
            [[n, write_s, n / write_s]],
        )
    )
    worst = max(per_sample_footprint, per_sample_uss)
    section.targets.append(
        Target(
            f"controller memory <= 256 B/sample at {n:,} samples",
            worst,
            256.0,
            False,
            "B",
            detail=f"footprint {per_sample_footprint:.0f} B, USS growth {per_sample_uss:.0f} B (the larger is judged)",
        )
    )
    section.targets.append(
        Target(
            f"4-sample get p50 with {n:,} stored / no-op controller call p50 <= {GET_OVER_NOOP:g}x",
            median(big) / median(noop),
            GET_OVER_NOOP,
            False,
            "x",
            detail=f"get p50 {1e3 * median(big):.2f} ms, no-op p50 {1e3 * median(noop):.2f} ms",
        )
    )
    section.profile_tables.append(
        Table(
            "controller metadata, bytes per sample by structure",
            ["structure", "MiB", "bytes/sample"],
            [[k, v / MiB, v / n] for k, v in sorted(breakdown.items(), key=lambda kv: -kv[1])],
        )
    )
    section.data = {
        "samples": n,
        "chunk": chunk,
        "footprint": footprint,
        "uss_before": uss0,
        "uss_after": uss1,
        "bytes_per_sample_footprint": per_sample_footprint,
        "bytes_per_sample_uss": per_sample_uss,
        "breakdown": breakdown,
        "fetch4_small_s": small,
        "fetch4_large_s": big,
        "noop_call_s": noop,
        "write_s": write_s,
        "python": sys.version.split()[0],
    }
    return section
