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
fails waiters whose deadline passed; as every waiter has the same timeout,
arrival order is deadline order and it only ever looks at the oldest.
"""

from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import Future

from dataplane_client.errors import Overloaded

QUEUE = "put admission"  # the queue's name in Overloaded and in the metrics


class Admission:
    def __init__(self, credits: int, timeout_s: float, max_waiting: int):
        self.credits = credits
        self.timeout_s = timeout_s
        self.max_waiting = max_waiting
        self._lock = threading.Condition()
        self._holders: set[Future] = set()  # puts holding a credit
        self._waiting: collections.deque[tuple[float, Future]] = collections.deque()
        self._reaper: threading.Thread | None = None
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
                self.rejected_total += 1
                future.set_exception(
                    Overloaded(
                        f"{QUEUE} queue of this process is full ({len(self._waiting)} puts "
                        f"waiting, {len(self._holders)} in flight); retry later",
                        queue=QUEUE,
                    )
                )
                return future
            self._waiting.append((time.monotonic(), future))
            if self._reaper is None:
                self._reaper = threading.Thread(
                    target=self._reap, name="dataplane-admission", daemon=True
                )
                self._reaper.start()
            self._lock.notify()
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
        future.set_result(None)

    def _admit_waiting(self) -> None:
        now = time.monotonic()
        while self._waiting and len(self._holders) < self.credits:
            since, future = self._waiting.popleft()
            self._grant(future, now - since)

    def _reap(self) -> None:
        """Fail the waiters whose deadline passed, oldest first."""
        with self._lock:
            while True:
                while not self._waiting:
                    self._lock.wait()
                since, future = self._waiting[0]
                left = since + self.timeout_s - time.monotonic()
                if left > 0:
                    self._lock.wait(left)
                    continue
                self._waiting.popleft()
                if future.set_running_or_notify_cancel():
                    self.rejected_total += 1
                    future.set_exception(
                        Overloaded(
                            f"not admitted within {self.timeout_s}s in the {QUEUE} queue of "
                            f"this process ({len(self._waiting)} puts behind it, "
                            f"{len(self._holders)} in flight); nothing was staged, retry later",
                            queue=QUEUE,
                        )
                    )
