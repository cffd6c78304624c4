"""Durability levels side by side: put and claim throughput, and the time to serve again.

Four services, one storage unit each, at ``memory``, ``process``, ``machine`` with
``fsync_policy: interval`` and ``machine`` with ``commit``, measured in one run, their
rounds interleaved (level after level, repeat after repeat) so load on the shared
cores moves every level alike:

- bulk puts: 1 MiB puts of 64 KiB rows (same-node: the writer copies into the unit's
  chunk files itself), MiB/s;
- small puts: 64 samples of 1 KiB per put, samples/s (the row log's cost per commit);
- claims: ``claim_meta`` + ``get_data`` of 64 samples at a time, samples/s.

Then the time to serve again: a ``process``-level service holding N small samples (1M,
or 10k with ``--quick``) has its controller and unit killed (``ray.kill``: no restart,
as when the whole service dies), and ``start()`` with the same config runs until the
first claim is answered; the unit's own share (opening its files and index) is shown.

``machine`` is stated with the disk the state directory is on (``findmnt``, ``df``).
Opt-in section: ``python -m benchmarks.run --only durability``.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import tempfile
import time
import uuid
from typing import Any

import ray
import torch

from benchmarks.common import BENCH_NAMESPACE, Options, Section, Table, Target, start_service

MiB = 1 << 20
LEVELS = {  # name -> config
    "memory": {"durability": "memory"},
    "process": {"durability": "process"},
    "machine, interval 1 s": {"durability": "machine", "fsync_policy": "interval"},
    "machine, commit": {"durability": "machine", "fsync_policy": "commit"},
}


def _round(client: Any, bulk_bytes: int, small_puts: int) -> dict[str, float]:
    """One round of each workload on fresh partitions; rates."""
    pid = f"dur-{uuid.uuid4().hex[:6]}"
    client.register_partition(pid, ["x"], consumer_tasks=["t"])
    rows, per_put = 16, torch.randint(0, 255, (16, 64 * 1024), dtype=torch.uint8)
    puts = bulk_bytes // (rows * 64 * 1024)
    t0 = time.perf_counter()
    for p in range(puts):
        client.put_samples([f"b{p}-{i}" for i in range(rows)], pid, {"x": per_put})
    bulk_s = time.perf_counter() - t0
    small = f"{pid}-small"
    client.register_partition(small, ["x"], consumer_tasks=["t"])
    one_kib = torch.ones(64, 1024, dtype=torch.uint8)
    t0 = time.perf_counter()
    for p in range(small_puts):
        client.put_samples([f"s{p}-{i}" for i in range(64)], small, {"x": one_kib})
    small_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    claimed = 0
    while claimed < 64 * small_puts:
        meta = client.claim_meta(small, "t", ["x"], 64, blocking=False)
        claimed += len(client.get_data(meta)["x"])
    claim_s = time.perf_counter() - t0
    client.delete_partition(pid)
    client.delete_partition(small)
    return {
        "bulk_mib_s": puts * rows * 64 * 1024 / MiB / bulk_s,
        "small_put_samples_s": 64 * small_puts / small_s,
        "claim_samples_s": claimed / claim_s,
    }


def measure_levels(opts: Options, state_root: str) -> dict[str, dict]:
    bulk_bytes, small_puts = (4 * MiB, 4) if opts.quick else (64 * MiB, 64)
    handles = {
        level: start_service(
            f"bench-dur-{i}",
            BENCH_NAMESPACE,
            num_storage_units=1,
            unit_capacity_bytes=4 * bulk_bytes + 256 * MiB,
            state_dir=f"{state_root}/level-{i}",
            **config,
        )
        for i, (level, config) in enumerate(LEVELS.items())
    }
    clients = {level: h.client() for level, h in handles.items()}
    rounds: dict[str, list[dict]] = {level: [] for level in LEVELS}
    try:
        for client in clients.values():  # warm every path once, untimed
            _round(client, bulk_bytes // 4, 1)
        for _ in range(max(1, opts.repeats)):
            for level, client in clients.items():
                rounds[level].append(_round(client, bulk_bytes, small_puts))
    finally:
        for level, h in handles.items():
            clients[level].close()
            h.shutdown()
            _remove_state(h.config)
    return {
        level: {k: statistics.median(r[k] for r in got) for k in got[0]}
        for level, got in rounds.items()
    }


def _remove_state(config: Any) -> None:
    from dataplane_server.core.unit import durable_layout

    durable_layout.remove_state(config)


def measure_restart(opts: Options, state_root: str) -> dict[str, float]:
    """Seconds from ``start()`` to the first answered claim, with N samples stored."""
    from dataplane_server.launch.service import start

    n = 10_000 if opts.quick else 1_000_000
    batch = 8192
    first = start_service(
        "bench-dur-restart",
        BENCH_NAMESPACE,
        num_storage_units=1,
        durability="process",
        state_dir=f"{state_root}/restart",
        unit_capacity_bytes=4 << 30,
    )
    config = first.config
    client = first.client()
    client.register_partition("p", ["x"], consumer_tasks=["t"])
    values = torch.ones(batch, 16, dtype=torch.uint8)
    t0 = time.perf_counter()
    for start_at in range(0, n, batch):
        k = min(batch, n - start_at)
        client.put_samples([f"s{start_at + i}" for i in range(k)], "p", {"x": values[:k]})
    fill_s = time.perf_counter() - t0
    client.close()
    for actor in [first.controller, *first.units]:  # the whole service dies
        ray.kill(actor, no_restart=True)
    first.units, first.controller = [], None
    t0 = time.perf_counter()
    again = start(config)
    started_s = time.perf_counter() - t0
    client = again.client()
    meta = client.claim_meta("p", "t", ["x"], 1, blocking=False)
    serve_s = time.perf_counter() - t0
    held = client.describe_partition("p").num_samples
    unit_s = _unit_restore_s(again)
    client.close()
    again.shutdown()
    _remove_state(config)
    if held != n or len(meta.sample_ids) != 1:
        raise AssertionError(f"served again with {held} of {n} samples")
    return {
        "samples": n,
        "fill_s": fill_s,
        "start_s": started_s,
        "serve_again_s": serve_s,
        "unit_restore_s": unit_s,
    }


def _unit_restore_s(handle: Any) -> float:
    counters = ray.get(handle.units[0].metrics_snapshot.remote()).stats["counters"]
    return float(counters.get("unit_restore_seconds_total", float("nan")))


def disk_of(path: str) -> str:
    """What ``findmnt`` and ``df`` say of the file system holding ``path``."""

    def out(*argv: str) -> str:
        try:
            return subprocess.run(argv, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return "?"

    mount = out("findmnt", "-n", "-o", "SOURCE,FSTYPE,OPTIONS", "-T", path)
    size = out("df", "-h", "--output=size,avail", path).splitlines()[-1:]
    rotational = out("lsblk", "-dn", "-o", "NAME,ROTA,MODEL")
    return f"{mount}; size/avail {' '.join(size)}; lsblk (ROTA 1 = spinning): {rotational}"


def run(opts: Options) -> Section:
    state_root = tempfile.mkdtemp(prefix="bench-durability-")
    try:
        disk = disk_of(state_root)
        levels = measure_levels(opts, state_root)
        restart = measure_restart(opts, state_root)
    finally:
        shutil.rmtree(state_root, ignore_errors=True)
    base = levels["memory"]
    rows = [
        [
            level,
            f"{r['bulk_mib_s']:.0f}",
            f"{r['bulk_mib_s'] / base['bulk_mib_s']:.2f}",
            f"{r['small_put_samples_s']:,.0f}",
            f"{r['small_put_samples_s'] / base['small_put_samples_s']:.2f}",
            f"{r['claim_samples_s']:,.0f}",
            f"{r['claim_samples_s'] / base['claim_samples_s']:.2f}",
        ]
        for level, r in levels.items()
    ]
    process = levels["process"]
    return Section(
        name="durability",
        tables=[
            Table(
                "put and claim throughput per durability level (one unit each, interleaved)",
                [
                    "level",
                    "1 MiB puts MiB/s",
                    "vs memory",
                    "64 x 1 KiB puts samples/s",
                    "vs memory",
                    "claim+get 64 samples/s",
                    "vs memory",
                ],
                rows,
            ),
            Table(
                "serving again after the whole service died (process level)",
                ["samples stored", "start() s", "first claim answered s", "unit re-attach s"],
                [
                    [
                        f"{restart['samples']:,}",
                        f"{restart['start_s']:.2f}",
                        f"{restart['serve_again_s']:.2f}",
                        f"{restart['unit_restore_s']:.2f}",
                    ]
                ],
            ),
        ],
        targets=[
            Target(
                "process level bulk puts vs memory",
                process["bulk_mib_s"] / base["bulk_mib_s"],
                0.9,
                True,
                "x",
            ),
            Target(
                "process level small puts vs memory",
                process["small_put_samples_s"] / base["small_put_samples_s"],
                0.9,
                True,
                "x",
            ),
            Target(
                f"serve again with {restart['samples']:,} samples stored",
                restart["serve_again_s"],
                10.0,
                False,
                "s",
            ),
        ],
        data={"levels": levels, "restart": restart, "machine_disk": disk},
        notes=[f"machine level's state directory: {disk}"],
    )
