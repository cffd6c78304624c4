"""Shared plumbing of the benchmarks: Ray start-up, statistics, targets, tables.

Every section module exposes ``run(opts) -> Section``; ``benchmarks.run`` calls
them in one process (one Ray cluster) and renders what they return.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

MiB = 1 << 20
GiB = 1 << 30
BENCH_NAMESPACE = "dataplane-bench"


# ---------------------------------------------------------------------------- options


@dataclass
class Options:
    """What the command line asked for; sections read only this."""

    quick: bool = False
    repeats: int = 5
    sizes: list[int] | None = None  # store section: total bytes of the simple workload
    only: list[str] | None = None
    verbose: bool = False

    def log(self, msg: str) -> None:
        print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------- Ray


def start_ray(num_cpus: int, object_store_bytes: int, num_gpus: int | None = None) -> None:
    """One local Ray on loopback for the whole run (no dashboard, explicit sizes; GPUs as
    Ray detects them unless ``num_gpus`` says)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from dataplane_server.launch.local_ray import init_local_ray

    # Passed only when asked for: a base checkout run side by side (many_writers) may
    # predate init_local_ray's num_gpus.
    gpus = {} if num_gpus is None else {"num_gpus": num_gpus}
    init_local_ray(
        num_cpus,
        namespace=BENCH_NAMESPACE,
        object_store_memory=int(object_store_bytes),
        log_to_driver=False,
        **gpus,
    )


def start_service(name: str, namespace: str, **overrides: Any) -> Any:
    """A data-plane service for one benchmark section (no admin endpoint, no metrics)."""
    from dataplane_client.wire.config import DataPlaneConfig
    from dataplane_server.launch.service import start

    cfg = {"num_storage_units": 2, "admin_enabled": False, "metrics_enabled": False, **overrides}
    return start(DataPlaneConfig(name=name, namespace=namespace, **cfg))


PACKAGES = ("dataplane_client", "dataplane_server", "policy_workers")


@contextlib.contextmanager
def linked_checkout(base_dir: str | None) -> Iterator[Path | None]:
    """A directory holding only links: ``base_dir``'s packages and this ``benchmarks``
    package (None when no ``base_dir``). A process started there with it as PYTHONPATH
    (and its Ray workers, which start from the driver's directory) imports the other
    checkout's code, not this one's."""
    if base_dir is None:
        yield None
        return
    with tempfile.TemporaryDirectory() as code:
        for pkg in PACKAGES:
            os.symlink(Path(base_dir, pkg).resolve(), Path(code, pkg))
        os.symlink(Path(__file__).resolve().parent, Path(code, "benchmarks"))
        yield Path(code)


def serialized_nbytes(value: Any) -> int:
    """Bytes Ray's serializer produces for ``value`` (in-band pickle + out-of-band buffers)."""
    try:
        from ray._private import worker

        ctx = worker.global_worker.get_serialization_context()
        return int(ctx.serialize(value).total_bytes)
    except Exception:  # noqa: BLE001 - fall back to pickle protocol 5 with buffers
        import pickle

        buffers: list = []
        head = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
        return len(head) + sum(memoryview(b.raw()).nbytes for b in buffers)


# ---------------------------------------------------------------------------- statistics


def median(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return float(statistics.median(xs)) if xs else float("nan")


def percentile(xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); no interpolation, so p99 is an observed value."""
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = max(0, min(len(xs) - 1, math.ceil(q / 100 * len(xs)) - 1))
    return float(xs[k])


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


class PeakRSS:
    """Peak resident set size of a process, sampled from a thread (psutil)."""

    def __init__(self, pid: int | None = None, interval_s: float = 0.002):
        import psutil

        self.proc = psutil.Process(pid or os.getpid())
        self.interval_s = interval_s
        self.baseline = 0
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(self.interval_s)

    def __enter__(self) -> PeakRSS:
        self.baseline = self.peak = self.proc.memory_info().rss
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)

    @property
    def delta(self) -> int:
        return self.peak - self.baseline


# ---------------------------------------------------------------------------- the machine


class Memcpy:
    """np.copyto of ``nbytes`` into a pre-touched destination (the ceiling); ``shared``:
    the destination is a memfd mapping, as a unit's chunk is."""

    def __init__(self, nbytes: int, shared: bool = False):
        self.src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
        if shared:
            fd = os.memfd_create("bench-shm-memcpy")
            try:
                os.ftruncate(fd, nbytes)
                self._map = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
            finally:
                os.close(fd)  # the mapping keeps the memory
            self.dst = np.frombuffer(self._map, dtype=np.uint8)
        else:
            self.dst = np.empty_like(self.src)
        self.dst.fill(1)  # first touch happens here, not in the timed copy

    def run(self) -> float:
        t0 = time.perf_counter()
        np.copyto(self.dst, self.src)
        return time.perf_counter() - t0


def memcpy_gibps(nbytes: int = 128 * MiB, repeats: int = 5) -> float:
    """This machine's one-thread memcpy now, GiB/s (median): the yardstick every figure
    of a run is read against (a 7 GiB/s machine and a 16 GiB/s one differ by that much)."""
    copy = Memcpy(nbytes)
    return nbytes / GiB / median([copy.run() for _ in range(repeats)])


# ---------------------------------------------------------------------------- results


@dataclass
class Target:
    """One target of the issue, judged with the figure that decides it."""

    name: str
    value: float | None
    threshold: float
    higher_is_better: bool
    unit: str = ""
    detail: str = ""
    status: str | None = None  # None = judge from value; else e.g. "not evaluated"

    @property
    def met(self) -> bool | None:
        if self.status is not None or self.value is None or math.isnan(self.value):
            return None
        return (
            self.value >= self.threshold if self.higher_is_better else self.value <= self.threshold
        )

    @property
    def verdict(self) -> str:
        if self.status is not None:
            return self.status
        m = self.met
        return "n/a" if m is None else ("met" if m else "MISSED")

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "value": self.value,
            "threshold": self.threshold,
            "comparison": ">=" if self.higher_is_better else "<=",
            "unit": self.unit,
            "met": self.met,
            "verdict": self.verdict,
            "detail": self.detail,
        }


@dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[list[Any]]


@dataclass
class Section:
    name: str
    tables: list[Table] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)  # raw numbers for the JSON
    profile: dict[str, Any] = field(default_factory=dict)  # where the time goes (missed targets)
    profile_tables: list[Table] = field(default_factory=list)  # printed when a target is missed
    notes: list[str] = field(default_factory=list)

    @property
    def missed(self) -> bool:
        return any(t.met is False for t in self.targets)

    def to_dict(self) -> dict[str, Any]:
        return {
            "tables": [
                {"title": t.title, "headers": t.headers, "rows": t.rows} for t in self.tables
            ],
            "targets": [t.to_dict() for t in self.targets],
            "data": self.data,
            "profile": self.profile,
            "profile_tables": [
                {"title": t.title, "headers": t.headers, "rows": t.rows}
                for t in self.profile_tables
            ],
            "notes": self.notes,
        }


# ---------------------------------------------------------------------------- rendering


def fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if math.isnan(x):
            return "-"
        if x != 0 and (abs(x) >= 1e5 or abs(x) < 10**-(digits)):
            return f"{x:.{digits}g}"
        return f"{x:.{digits}g}" if abs(x) >= 1000 else f"{x:.{digits}f}".rstrip("0").rstrip(".")
    return str(x)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [max([len(str(h))] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    line = "| " + " | ".join(str(h).ljust(w) for h, w in zip(headers, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    return "\n".join([line, sep, *body])


def targets_table(targets: Sequence[Target]) -> Table:
    rows = []
    for t in targets:
        cmp = ">=" if t.higher_is_better else "<="
        rows.append(
            [t.name, t.value, f"{cmp} {fmt(t.threshold)} {t.unit}".strip(), t.verdict, t.detail]
        )
    return Table("targets", ["target", "measured", "wanted", "verdict", "detail"], rows)


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0 or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def parse_size(text: str) -> int:
    """'32M', '1G', '512MiB', '4096' (bytes) -> bytes (binary units)."""
    s = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = 1
    if s and s[-1] in "KMG":
        mult = {"K": 1 << 10, "M": MiB, "G": GiB}[s[-1]]
        s = s[:-1]
    return int(float(s) * mult)


def human_size(n: int) -> str:
    if n >= GiB and n % GiB == 0:
        return f"{n // GiB} GiB"
    if n >= MiB:
        return f"{n / MiB:.4g} MiB"
    return f"{n / 1024:.4g} KiB"


def cprofile_top(fn: Callable[[], Any], limit: int = 12) -> tuple[Any, list[dict[str, Any]]]:
    """Run ``fn`` under cProfile; return its result and the top entries by own time."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    out = prof.runcall(fn)
    stats = pstats.Stats(prof)
    entries = []
    for (filename, line, func), (_cc, ncalls, tottime, cumtime, _callers) in stats.stats.items():
        entries.append(
            {
                "function": f"{os.path.basename(filename)}:{line}({func})",
                "calls": int(ncalls),
                "tottime_s": round(tottime, 6),
                "cumtime_s": round(cumtime, 6),
            }
        )
    entries.sort(key=lambda e: e["tottime_s"], reverse=True)
    return out, entries[:limit]
