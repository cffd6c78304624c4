"""Counters and latency histograms kept inside the controller and storage units.

They are plain numbers (snapshot() returns builtins), so the admin endpoint can
fetch them through Ray and expose them in Prometheus format without the hot
path ever touching a metrics library.
"""

from __future__ import annotations

import bisect
import functools
import inspect
from collections import defaultdict

from dataplane_client.wire.errors import ClaimTimeout, DataPlaneError

# Typed errors that are a normal answer, not a fault: a blocking claim that polls with a
# short timeout ends in ClaimTimeout whenever no batch is ready yet. They are counted
# under their own counter so an error-rate alert does not fire on a healthy, idle trainer.
EXPECTED_OUTCOMES: dict[type[BaseException], str] = {ClaimTimeout: "claim_timeouts_total"}

LATENCY_BUCKETS_S = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


class Histogram:
    """Cumulative-bucket histogram in the Prometheus sense (le buckets, sum, count)."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS_S):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def snapshot(self) -> dict:
        cumulative, running = [], 0
        for c in self.counts:
            running += c
            cumulative.append(running)
        return {
            "buckets": list(self.buckets),
            "cumulative_counts": cumulative,  # len(buckets)+1, last = +Inf
            "sum": self.sum,
            "count": self.count,
        }


class Stats:
    """Named counters and histograms of one actor."""

    def __init__(self) -> None:
        self.counters: dict[str, float] = defaultdict(float)
        self.errors: dict[str, int] = defaultdict(int)
        self.histograms: dict[str, Histogram] = {}

    def inc(self, name: str, amount: float = 1.0) -> None:
        self.counters[name] += amount

    def error(self, exc: BaseException) -> None:
        for kind, counter in EXPECTED_OUTCOMES.items():
            if isinstance(exc, kind):
                self.counters[counter] += 1
                return
        self.errors[type(exc).__name__] += 1

    def observe(self, name: str, value: float) -> None:
        hist = self.histograms.get(name)
        if hist is None:
            hist = self.histograms[name] = Histogram()
        hist.observe(value)

    def snapshot(self) -> dict:
        return {
            "counters": dict(self.counters),
            "errors": dict(self.errors),
            "histograms": {k: h.snapshot() for k, h in self.histograms.items()},
        }


def counts_errors(method):
    """Count every typed error a method raises in ``self.stats`` (by class), then re-raise."""
    if inspect.iscoroutinefunction(method):

        @functools.wraps(method)
        async def async_wrapper(self, *args, **kwargs):
            try:
                return await method(self, *args, **kwargs)
            except DataPlaneError as e:
                self.stats.error(e)
                raise

        return async_wrapper

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except DataPlaneError as e:
            self.stats.error(e)
            raise

    return wrapper
