"""Large copies split over a few threads.

One thread copying does not use all of a machine's memory bandwidth, and numpy
releases the GIL while it copies plain bytes, so pieces of one copy run truly in
parallel. Measured on this project's 2-core machine: 128 MiB took 15.5 ms on one
thread and 10.0 ms on two (`python -m benchmarks.run --only store` reports the
same-run memcpy baseline, which stays one thread).

The config's ``copy_threads`` sets the number of threads (1 turns this off; the
environment variable ``DATAPLANE_COPY_THREADS`` sets it like any other key); the
default is the CPUs this process may run on, at most 4. A storage unit uses its
service's config (``configure``); any other process, the config its environment
gives, read at each large copy.
"""

from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from dataplane_client.wire.config import DataPlaneConfig

MIN_PARALLEL_BYTES = 16 << 20  # below this a thread handoff costs more than it saves
_MAX_DEFAULT_THREADS = 4

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_config: DataPlaneConfig | None = None  # set by configure(); None = the environment's config


def configure(config: DataPlaneConfig | None) -> None:
    """This process's copies follow ``config`` (a storage unit: its service's config)."""
    global _config
    _config = config


def threads() -> int:
    """How many threads a large copy uses (the config's ``copy_threads``, else the CPUs,
    at most 4)."""
    if _config is not None:
        configured = _config.copy_threads
    else:
        configured = _environment_threads(os.environ.get("DATAPLANE_COPY_THREADS"))
    if configured is not None:
        return configured
    return max(1, min(_MAX_DEFAULT_THREADS, len(os.sched_getaffinity(0))))


@functools.lru_cache(maxsize=8)
def _environment_threads(raw: str | None) -> int | None:
    """The environment's config's ``copy_threads``, built once per value of the variable:
    a whole config costs ~0.1 ms, a tenth of the 16 MiB copy that asks for it."""
    del raw  # the cache key: DataPlaneConfig() reads the variable itself
    return DataPlaneConfig().copy_threads


def _executor(workers: int) -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None or _pool._max_workers < workers:
            if _pool is not None:
                _pool.shutdown(wait=False)  # its threads end once idle
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dataplane-copy")
        return _pool


def _split(pairs: list[tuple[np.ndarray, np.ndarray]], share: int) -> list[list]:
    """Groups of (destination, source) pieces of about ``share`` bytes each, in order."""
    groups: list[list] = [[]]
    filled = 0
    for dst, src in pairs:
        while len(dst):
            n = min(len(dst), share - filled)
            groups[-1].append((dst[:n], src[:n]))
            dst, src = dst[n:], src[n:]
            filled += n
            if filled >= share:
                groups.append([])
                filled = 0
    return [g for g in groups if g]


def _copy_group(group: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for dst, src in group:
        dst[...] = src


def copy_pairs(pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """``dst[...] = src`` for each pair of equally long 1-D byte arrays, large totals split
    evenly over ``threads()`` threads (the caller's one of them)."""
    total = sum(len(dst) for dst, _ in pairs)
    workers = threads() if total >= MIN_PARALLEL_BYTES else 1  # small copies: no config read
    if workers < 2:
        _copy_group(pairs)
        return
    groups = _split(pairs, -(-total // workers))
    pool = _executor(workers - 1)
    futures = [pool.submit(_copy_group, g) for g in groups[1:]]
    try:
        _copy_group(groups[0])
    finally:
        for f in futures:
            f.result()  # every piece done (or its error raised) before the caller goes on
