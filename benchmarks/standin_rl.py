"""An RL loop whose generation and training are STAND-INS: they sleep, through the data plane.

Generation and training take calibrated wall time without using the CPU
(``time.sleep`` releases the GIL), in place of the GPU kernels of a real run. What is
left of a step is the data plane's own work: admission, puts, releases, claims and
version bumps, on a real service (Ray actors, this process's client). The sections
``asyncrl`` (the regime where async pays) and ``pacing`` (stale drops and the bias
they cause) run it.

- **Producers**: ``slots`` threads (an inference engine's concurrent sequences), each
  generating one sample at a time; a sample's completion length is drawn up front from
  the workload (seeded) and it sleeps ``length x s_per_token``.
- **Synchronous**: each step generates one batch (all at once, ``slots >= batch``),
  waits for its slowest sample, claims it, trains (sleeps ``train_s``) and publishes the
  next version.
- **Async**: producers run continuously under ``admit_rollouts`` (``StalenessSpec``:
  ``max_staleness`` N, ``admission_batch`` the batch, ``pace`` on or off), putting each
  sample at its grant's version and releasing the grant; the trainer claims a full batch
  (blocking), trains and publishes the next version. After the last step the producers
  stop and the trainer takes what is left in its window (no more versions), so every
  generated sample ends up trained or dropped stale.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dataplane_client import StalenessSpec
from dataplane_client.wire.errors import AdmissionTimeout

TASK = "train"
FIELDS = ["x"]


@dataclass(frozen=True)
class Workload:
    batch: int  # samples trained per version (the trainer's batch, admission_batch)
    slots: int  # samples generated at once
    train_s: float  # one train step (sleeps)
    s_per_token: float  # generation time per completion token (sleeps)
    lengths: tuple[int, ...]  # completion lengths, used in turn (cycled)

    def gen_s(self, length: int) -> float:
        return length * self.s_per_token


@dataclass
class Outcome:
    samples_per_s: float  # trained samples / s over the steps after the first
    step_s: list[float]  # each step's wall time (claim to version published)
    generated: list[int]  # completion lengths of every sample put
    trained: list[int]  # completion lengths of every sample trained
    stale_dropped: int
    admission_waits: int


def long_tail_lengths(n: int, median: int, sigma: float, cap: int, seed: int = 0) -> tuple:
    """Completion lengths drawn from a log-normal (a long right tail), capped at ``cap``
    (max_new_tokens), at least 1."""
    rng = np.random.default_rng(seed)
    drawn = rng.lognormal(np.log(median), sigma, n)
    return tuple(int(x) for x in np.clip(drawn, 1, cap))


def ks_statistic(a: list[int], b: list[int]) -> float:
    """Two-sample Kolmogorov-Smirnov statistic: the largest gap between the two empirical
    distribution functions (0: the same distribution; 1: disjoint)."""
    xa, xb = np.sort(np.asarray(a)), np.sort(np.asarray(b))
    grid = np.concatenate([xa, xb])
    fa = np.searchsorted(xa, grid, side="right") / len(xa)
    fb = np.searchsorted(xb, grid, side="right") / len(xb)
    return float(np.abs(fa - fb).max())


def _register(client: Any, staleness: StalenessSpec) -> str:
    pid = f"bench-standin-{uuid.uuid4().hex[:6]}"
    client.register_partition(
        pid, FIELDS, None, [TASK], numeric_tags={"length": "int64"}, staleness=staleness
    )
    return pid


class _Draws:
    """The workload's lengths handed out in turn, one per sample, to any thread."""

    def __init__(self, lengths: tuple[int, ...]):
        self._lengths = itertools.cycle(lengths)
        self._count = itertools.count()
        self._lock = threading.Lock()

    def take(self) -> tuple[str, int]:
        with self._lock:
            return f"s{next(self._count)}", next(self._lengths)


def _generate(client: Any, pid: str, w: Workload, draws: _Draws, version: int) -> int:
    """One sample: sleep its generation time, put it at ``version``; its length."""
    sid, length = draws.take()
    time.sleep(w.gen_s(length))  # STAND-IN for the GPU decoding its tokens
    client.put_samples(
        [sid], pid, {"x": torch.zeros(1)}, tags=[{"length": length}], version=version
    )
    return length


def _train(client: Any, pid: str, w: Workload, version: int, trained: list[int]) -> None:
    """One step: a full batch claimed, trained (sleeps), the next version published."""
    meta = client.claim_meta(pid, TASK, FIELDS, w.batch, timeout_s=120.0)
    trained += [int(t["length"]) for t in meta.tags]
    time.sleep(w.train_s)  # STAND-IN for the GPU's forward, backward and optimizer step
    client.set_policy_version(pid, version + 1)


def _outcome(
    client: Any,
    pid: str,
    w: Workload,
    step_s: list[float],
    generated: list[int],
    trained: list[int],
) -> Outcome:
    st = client.describe_partition(pid).staleness
    client.delete_partition(pid)
    steady = step_s[1:] or step_s
    return Outcome(
        samples_per_s=w.batch * len(steady) / sum(steady),
        step_s=step_s,
        generated=generated,
        trained=trained,
        stale_dropped=sum(st.dropped_stale.values()),
        admission_waits=st.admission_waits,
    )


def run_sync(client: Any, w: Workload, steps: int) -> Outcome:
    """Generate a batch, wait for it, train on it, publish: ``steps`` times."""
    pid = _register(client, StalenessSpec(max_staleness=0))
    draws = _Draws(w.lengths)
    generated: list[int] = []
    trained: list[int] = []
    step_s = []
    with ThreadPoolExecutor(max(w.slots, w.batch)) as pool:
        for version in range(steps):
            t0 = time.perf_counter()
            jobs = [pool.submit(_generate, client, pid, w, draws, version) for _ in range(w.batch)]
            generated += [j.result() for j in jobs]
            _train(client, pid, w, version, trained)
            step_s.append(time.perf_counter() - t0)
    return _outcome(client, pid, w, step_s, generated, trained)


def run_async(client: Any, w: Workload, steps: int, max_staleness: int, pace: bool) -> Outcome:
    """Producers under admission and a trainer, concurrently (module docstring)."""
    spec = StalenessSpec(max_staleness=max_staleness, admission_batch=w.batch, pace=pace)
    pid = _register(client, spec)
    draws = _Draws(w.lengths)
    generated: list[int] = []
    trained: list[int] = []
    stop = threading.Event()

    def produce() -> None:
        while not stop.is_set():
            try:
                grant = client.admit_rollouts(pid, 1, wait=True, timeout_s=0.5)
            except AdmissionTimeout:
                continue  # no room yet: look at stop again
            assert grant is not None
            generated.append(_generate(client, pid, w, draws, grant.version))
            client.release_rollouts(grant)

    producers = [threading.Thread(target=produce, daemon=True) for _ in range(w.slots)]
    for p in producers:
        p.start()
    step_s = []
    try:
        for version in range(steps):
            t0 = time.perf_counter()
            _train(client, pid, w, version, trained)
            step_s.append(time.perf_counter() - t0)
    finally:
        stop.set()
        for p in producers:
            p.join()
    # What is left in the window is trained without another version (nothing more stale),
    # until every sample put is trained or dropped: a put's commit (Ray) and the drop of
    # what went stale may land a moment after the producers stopped. Claims that may wait
    # drop stale samples before choosing (coalesced non-blocking ones only pass them by).
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        while meta := client.claim_meta(pid, TASK, FIELDS, w.batch, blocking=False):
            trained += [int(t["length"]) for t in meta.tags]
        dropped = sum(client.describe_partition(pid).staleness.dropped_stale.values())
        if len(trained) + dropped >= len(generated):
            break
        try:
            meta = client.claim_meta(pid, TASK, FIELDS, w.batch, blocking=True, timeout_s=0.05)
            trained += [int(t["length"]) for t in meta.tags]
        except TimeoutError:
            pass  # less than a batch left: the non-blocking claims take it
    return _outcome(client, pid, w, step_s, generated, trained)
