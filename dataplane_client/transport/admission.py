"""Put admission: a writer process's credits, and the fair queue of puts waiting for one.

Without it, a process with thousands of concurrent puts stages them all at
once: each takes unit memory and a place in the units' and the controller's
queues, commits queue behind one another until stages outlive their
``stage_ttl_s``, and the work done for them is thrown away while more puts
keep arriving (congestion collapse). Here a put takes one of ``credits``
before any byte is staged and gives it back when it is done; the rest wait in
arrival order (first come, first admitted). A put not admitted within
``timeout_s`` fails with ``Overloaded`` (retryable, nothing staged), and one
arriving while ``max_waiting`` already wait fails at once: a bounded queue
never holds work it cannot finish in time.

Callers wait on a ``concurrent.futures.Future`` (``enter``), so threads and
coroutines (through the client's flows) share one queue. One daemon thread
fails waiters whose deadline passed (as every waiter has the same timeout,
arrival order is deadline order: it only ever looks at the oldest) and, while
puts wait or are refused, reports the queue's figures to the service about
once a second (``report``), so its metrics show writers queueing.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from dataplane_client.wire.errors import Overloaded
from dataplane_client.wire.messages import WriterLoad

QUEUE = "put admission"  # the queue's name in Overloaded and in the metrics


REPORT_EVERY_S = 1.0  # at most this often, the queue's figures are reported while it moves


class Admission:
    def __init__(
        self,
        credits: int,
        timeout_s: float,
        max_waiting: int,
        report: Callable[[], object] | None = None,
    ):
        self.credits = credits
        self.timeout_s = timeout_s
        self.max_waiting = max_waiting
        # Sends this queue's figures to the service (metrics): called by the reaper thread,
        # within REPORT_EVERY_S of any change while puts wait or are refused.
        self._report = report
        self._lock = threading.Condition()
        self._holders: set[Future] = set()  # puts holding a credit
        self._waiting: collections.deque[tuple[float, Future]] = collections.deque()
        self._reaper: threading.Thread | None = None
        self._changed = False  # since the last report: a put waited, was admitted or refused
        self._reported_at = -REPORT_EVERY_S
        # Figures for operators (read without the lock: whole ints).
        self.admitted_total = 0
        self.rejected_total = 0
        self.waited_total = 0
        self.wait_seconds_total = 0.0

    def enter(self) -> Future:
        """A future that resolves (to None) once the put holds a credit, or fails with
        ``Overloaded``. Hand it to ``leave`` when the put is done, whatever happened."""
        future: Future = Future()
        with self._lock:
            if len(self._holders) < self.credits and not self._waiting:
                self._grant(future, waited_s=0.0)
                return future
            if len(self._waiting) >= self.max_waiting:
                self._refuse(
                    future,
                    f"the {QUEUE} queue of this process is full ({len(self._waiting)} puts "
                    f"waiting, {len(self._holders)} in flight; put_queue_limit); retry later",
                )
            else:
                self._waiting.append((time.monotonic(), future))
            self._wake_reaper()
        return future

    def leave(self, future: Future) -> None:
        """The put is done (or gave up): its credit goes to the next waiter; a put still
        waiting leaves the queue."""
        with self._lock:
            if future in self._holders:
                self._holders.remove(future)
                self._admit_waiting()
            elif not future.done():
                future.cancel()  # skipped when its turn comes

    def load(self, writer: str) -> WriterLoad:
        """This queue's figures, as the service's metrics sum them (``writer``: our id)."""
        return WriterLoad(
            writer=writer,
            waiting=len(self._waiting),
            in_flight=len(self._holders),
            admitted_total=self.admitted_total,
            waited_total=self.waited_total,
            wait_seconds_total=self.wait_seconds_total,
            rejected_total=self.rejected_total,
        )

    def depth(self) -> tuple[int, int]:
        """(puts waiting, puts holding a credit)."""
        return len(self._waiting), len(self._holders)

    def _grant(self, future: Future, waited_s: float) -> None:
        if not future.set_running_or_notify_cancel():
            return  # its caller gave up meanwhile
        self._holders.add(future)
        self.admitted_total += 1
        if waited_s > 0:
            self.waited_total += 1
            self.wait_seconds_total += waited_s
            self._changed = True
        future.set_result(None)

    def _refuse(self, future: Future, why: str) -> None:
        if future.set_running_or_notify_cancel():
            self.rejected_total += 1
            self._changed = True
            future.set_exception(Overloaded(why, queue=QUEUE))

    def _admit_waiting(self) -> None:
        now = time.monotonic()
        while self._waiting and len(self._holders) < self.credits:
            since, future = self._waiting.popleft()
            self._grant(future, now - since)

    def _wake_reaper(self) -> None:
        if self._reaper is None:
            self._reaper = threading.Thread(
                target=self._reap, name="dataplane-admission", daemon=True
            )
            self._reaper.start()
        self._lock.notify()

    def _reap(self) -> None:
        """Refuse the waiters whose deadline passed, oldest first, and report changes.

        The report is sent outside the lock: every put's ``enter`` and ``leave`` takes
        it (on the caller's event loop thread, in an async actor), so a send that is slow
        to leave would hold every put of the process up behind it."""
        while True:
            if self._reap_once():
                self._send_report()

    def _reap_once(self) -> bool:
        """One round of ``_reap`` under the lock; True when the figures are due a report."""
        with self._lock:
            while not self._waiting and not self._changed:
                self._lock.wait()
            now = time.monotonic()
            while self._waiting and self._waiting[0][0] + self.timeout_s <= now:
                _, future = self._waiting.popleft()
                self._refuse(
                    future,
                    f"not admitted within {self.timeout_s}s in the {QUEUE} queue of this "
                    f"process ({len(self._waiting)} puts behind it, {len(self._holders)} "
                    "in flight; put_admission_timeout_s); nothing was staged, retry later",
                )
            if self._changed and now - self._reported_at >= REPORT_EVERY_S:
                self._changed, self._reported_at = False, now
                return True
            wait_s = REPORT_EVERY_S
            if self._waiting:
                wait_s = min(wait_s, self._waiting[0][0] + self.timeout_s - now)
            self._lock.wait(max(wait_s, 0.0))
            return False

    def _send_report(self) -> None:
        if self._report is None:
            return
        try:
            self._report()  # one message, not awaited
        except Exception:  # noqa: BLE001 - figures for operators never stop admission
            pass
