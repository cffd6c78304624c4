"""Checkpoints that pause nothing: put and claim rates during a checkpoint against without,
and an incremental checkpoint's time against the bytes new since its parent.

1. Load: writer threads put one 4 KiB sample a put, a claimer consumes them, while
   the store holds ``stored`` bytes besides. Per repeat, a window without a checkpoint
   (as long as the checkpoint took the repeat before) and a full checkpoint's own
   duration, each counted as puts and claims returned per second, and the longest put
   in it (a pause would show there). Median over repeats, at the copy share 1 (as fast
   as it can) and at the default (``checkpoint_copy_share``), each on a service of its
   own; target, at the default: during >= 0.9 x without, for both.
2. Incremental: at two stored sizes, a full checkpoint, then checkpoints each with the
   previous as parent after putting ``new`` bytes (``repeats`` of each, median):
   seconds and bytes written. Target:
   for the same new bytes, the larger store's time <= 1.5 x the smaller's.

Opt-in section ``checkpoint``: ``python -m benchmarks.run --only checkpoint``, or
standalone ``python -m benchmarks.checkpoint_cut [--quick] [--out FILE]``.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import threading
import time
from typing import Any

import torch

from benchmarks.common import (
    BENCH_NAMESPACE,
    MiB,
    Options,
    Section,
    Table,
    Target,
    start_ray,
    start_service,
)
from dataplane_client.wire.config import DataPlaneConfig

WRITERS = 2
SMALL = 4096
ROW = 256 * 1024  # stored bytes go in rows of this size


class _Load:
    """Writers and a claimer, each call's return time kept."""

    def __init__(self, client: Any, pid: str):
        self.client, self.pid = client, pid
        self.stop = threading.Event()
        self.puts: list[tuple[float, float]] = []  # (start, end) per put
        self.claims: list[float] = []
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._write, args=(w,)) for w in range(WRITERS)]
        self.threads.append(threading.Thread(target=self._claim))
        for t in self.threads:
            t.start()

    def _write(self, w: int) -> None:
        one, n = torch.ones(1, SMALL, dtype=torch.uint8), 0
        try:
            while not self.stop.is_set():
                t0 = time.perf_counter()
                self.client.put_samples([f"w{w}-{n}"], self.pid, {"x": one})
                self.puts.append((t0, time.perf_counter()))
                n += 1
        except BaseException as e:  # noqa: BLE001 - reported by close()
            self.errors.append(e)

    def _claim(self) -> None:
        try:
            while not self.stop.is_set():
                got = self.client.claim_meta(self.pid, "t", ["x"], 16, blocking=False)
                if got is not None and got.size:
                    self.claims.extend([time.perf_counter()] * got.size)
                else:
                    time.sleep(0.005)  # caught up with the writers
        except BaseException as e:  # noqa: BLE001
            self.errors.append(e)

    def rates(self, start: float, end: float) -> dict[str, float]:
        span = end - start
        puts = [(a, b) for a, b in self.puts if start <= b <= end]
        return {
            "seconds": span,
            "puts_per_s": len(puts) / span,
            "claims_per_s": sum(1 for t in self.claims if start <= t <= end) / span,
            "longest_put_ms": 1e3 * max((b - a for a, b in puts), default=float("nan")),
        }

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)
        if self.errors:
            raise self.errors[0]


def _fill(client: Any, pid: str, nbytes: int, start: int = 0) -> int:
    """Put ``nbytes`` in rows of ``ROW`` (64 rows a put); returns the next row number."""
    rows = max(1, nbytes // ROW)
    for first in range(0, rows, 64):
        n = min(64, rows - first)
        ids = [f"r{start + first + i}" for i in range(n)]
        client.put_samples(ids, pid, {"x": torch.full((n, ROW), 7, dtype=torch.uint8)})
    return start + rows


def measure_load(client: Any, root: str, stored: int, repeats: int) -> dict:
    client.register_partition("stored", ["x"])
    _fill(client, "stored", stored)
    client.register_partition("live", ["x"], consumer_tasks=["t"])
    load = _Load(client, "live")
    runs = []
    try:
        time.sleep(1.0)  # warm-up: writers and claimer running, not counted
        took = 1.0
        for r in range(repeats):
            t0 = time.perf_counter()
            time.sleep(took)  # a window without a checkpoint, as long as the last one took
            without = load.rates(t0, time.perf_counter())
            t1 = time.perf_counter()
            client.checkpoint(os.path.join(root, f"load-{r}"))
            t2 = time.perf_counter()
            took = t2 - t1
            runs.append({"without": without, "during": load.rates(t1, t2)})
    finally:
        load.close()
    client.delete_partition("stored")
    client.delete_partition("live")

    def med(phase: str, key: str) -> float:
        return statistics.median(run[phase][key] for run in runs)

    keys = ("seconds", "puts_per_s", "claims_per_s", "longest_put_ms")
    return {
        "stored_bytes": stored,
        "runs": runs,
        "median": {phase: {k: med(phase, k) for k in keys} for phase in ("without", "during")},
    }


def measure_incremental(client: Any, root: str, stored: int, news: list[int], repeats: int) -> dict:
    """A full checkpoint, then per new size ``repeats`` children in a chain, each after
    putting that many new bytes: the median time, and the last one's bytes."""
    pid = f"inc{stored}"
    client.register_partition(pid, ["x"])
    next_row = _fill(client, pid, stored)
    t0 = time.perf_counter()
    parent = client.checkpoint(os.path.join(root, f"{pid}-full"))
    full_s = time.perf_counter() - t0
    rows = []
    for i, new in enumerate(news):
        seconds = []
        for r in range(repeats):
            next_row = _fill(client, pid, new, next_row)
            t0 = time.perf_counter()
            parent = client.checkpoint(os.path.join(root, f"{pid}-{i}-{r}"), parent=parent)
            seconds.append(time.perf_counter() - t0)
        last = client.service_info().last_checkpoint
        rows.append(
            {
                "new_bytes": new,
                "seconds": statistics.median(seconds),
                "all_seconds": seconds,
                "bytes_written": last.bytes_written,
                "bytes_linked": last.bytes_linked,
            }
        )
    client.delete_partition(pid)
    return {"stored_bytes": stored, "full_seconds": full_s, "incremental": rows}


def _mib(n: float) -> str:
    return f"{n / MiB:,.1f}"


def _service(capacity: int, share: float):
    return start_service(
        "bench-checkpoint",
        BENCH_NAMESPACE,
        unit_capacity_bytes=capacity,
        checkpoint_copy_share=share,
    )


def _load_rows(share: float, load: dict) -> list[list[str]]:
    w, d = load["median"]["without"], load["median"]["during"]
    rows = [
        [
            f"{share:g}",
            phase,
            f"{m['seconds']:.2f}",
            f"{m['puts_per_s']:.0f}",
            f"{m['claims_per_s']:.0f}",
            f"{m['longest_put_ms']:.0f}",
        ]
        for phase, m in (("without a checkpoint", w), ("during a full checkpoint", d))
    ]
    rows.append(
        [
            f"{share:g}",
            "during / without",
            "",
            f"{d['puts_per_s'] / w['puts_per_s']:.2f}",
            f"{d['claims_per_s'] / w['claims_per_s']:.2f}",
            "",
        ]
    )
    return rows


def run(opts: Options) -> Section:
    stored_load = 16 * MiB if opts.quick else 256 * MiB
    sizes = [8 * MiB, 32 * MiB] if opts.quick else [64 * MiB, 512 * MiB]
    news = [256 * 1024, 2 * MiB] if opts.quick else [2 * MiB, 16 * MiB]
    repeats = 1 if opts.quick else max(3, opts.repeats)
    capacity = 2 * max(sizes) + 2 * repeats * sum(news) + 2 * stored_load
    default = DataPlaneConfig().checkpoint_copy_share
    # The load at full speed (share 1) beside the default pacing, each on a service of its
    # own (the share is the service's); the incremental figures at the default.
    loads: dict[float, dict] = {}
    with tempfile.TemporaryDirectory(prefix="dataplane-bench-ckpt-") as root:
        for share in (1.0, default):
            handle = _service(capacity // 2 + 256 * MiB, share)
            client = handle.client()
            try:
                loads[share] = measure_load(
                    client, os.path.join(root, f"s{share}"), stored_load, repeats
                )
                if share == default:
                    inc = [measure_incremental(client, root, s, news, repeats) for s in sizes]
            finally:
                client.close()
                handle.shutdown()
    load_rows = [row for share, load in loads.items() for row in _load_rows(share, load)]
    w, d = loads[default]["median"]["without"], loads[default]["median"]["during"]
    inc_rows = []
    for s in inc:
        inc_rows.append([_mib(s["stored_bytes"]), "full", f"{s['full_seconds']:.2f}", "", ""])
        for r in s["incremental"]:
            inc_rows.append(
                [
                    _mib(s["stored_bytes"]),
                    _mib(r["new_bytes"]),
                    f"{r['seconds']:.3f}",
                    _mib(r["bytes_written"]),
                    _mib(r["bytes_linked"]),
                ]
            )
    small, large = inc[0]["incremental"], inc[-1]["incremental"]
    growth = max(b["seconds"] / a["seconds"] for a, b in zip(small, large))
    targets = [
        Target(
            f"puts during a checkpoint / without (copy share {default:g}, the default)",
            d["puts_per_s"] / w["puts_per_s"],
            0.9,
            True,
        ),
        Target(
            f"claims during a checkpoint / without (copy share {default:g}, the default)",
            d["claims_per_s"] / w["claims_per_s"],
            0.9,
            True,
        ),
        Target(
            f"incremental time, {_mib(sizes[-1])} stored / {_mib(sizes[0])} stored",
            growth,
            1.5,
            False,
            detail="the same new bytes; the worst of the new sizes",
        ),
    ]
    return Section(
        name="checkpoint",
        tables=[
            Table(
                f"{WRITERS} writers (one {SMALL // 1024} KiB sample a put) and a claimer, "
                f"{_mib(stored_load)} MiB stored, median of {repeats}, per checkpoint copy share",
                ["copy share", "window", "s", "puts/s", "claims/s", "longest put ms"],
                load_rows,
            ),
            Table(
                f"incremental checkpoints (each the previous one's child), median of {repeats}",
                ["stored MiB", "new MiB", "seconds", "written MiB", "linked MiB"],
                inc_rows,
            ),
        ],
        targets=targets,
        data={
            "load": {f"{share:g}": load for share, load in loads.items()},
            "default_copy_share": default,
            "incremental": inc,
            "load_avg": os.getloadavg(),
        },
        notes=[f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"],
    )


if __name__ == "__main__":
    import argparse
    import json

    from benchmarks.common import markdown_table, targets_table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    start_ray(4, 2 << 30)  # the harness starts its own for every section
    section = run(Options(quick=args.quick, repeats=args.repeats))
    for table in [*section.tables, targets_table(section.targets)]:
        print(f"### {table.title}\n")
        print(markdown_table(table.headers, table.rows) + "\n")
    print(*section.notes)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(section.to_dict(), f, indent=2)
