"""What the writer processes report of their put admission, summed for operators.

Admission happens in each writer process (``dataplane_client.transport.admission``), so
the service learns of queueing writers only from them: each ``commit_many``
carries its writer's figures (``WriterLoad``), and a writer that refuses a put
reports at once, as its commits may have stopped. Counters are each writer's
running totals, summed over every writer reported (a writer that went away
keeps its share, so the sums never go down); the queue gauges count only
reports newer than ``FRESH_S``, so a writer that went quiet stops counting.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from dataplane_client.wire.messages import WriterLoad

FRESH_S = 10.0
MAX_WRITERS = 65536  # writers remembered; the oldest report is dropped past it


class WriterLoads:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._latest: OrderedDict[str, tuple[float, WriterLoad]] = OrderedDict()

    def report(self, load: WriterLoad | None) -> None:
        if load is None:
            return
        self._latest[load.writer] = (self._clock(), load)
        self._latest.move_to_end(load.writer)
        while len(self._latest) > MAX_WRITERS:
            self._latest.popitem(last=False)

    def queue(self) -> tuple[int, int]:
        """(puts waiting for a credit, puts holding one), over writers heard from lately."""
        since = self._clock() - FRESH_S
        fresh = [load for at, load in self._latest.values() if at >= since]
        return sum(x.waiting for x in fresh), sum(x.in_flight for x in fresh)

    def totals(self) -> dict[str, float]:
        """Counters for the controller's stats, summed over every writer reported."""
        loads = [load for _, load in self._latest.values()]
        return {
            "puts_admitted_total": sum(x.admitted_total for x in loads),
            "put_admission_waits_total": sum(x.waited_total for x in loads),
            "put_admission_wait_seconds_total": sum(x.wait_seconds_total for x in loads),
            "puts_rejected_total": sum(x.rejected_total for x in loads),
        }
