"""Concurrent calls of one process to one actor, coalesced into one batched call.

Many callers in one process (the threads of a driver, the coroutines of an
async actor, or both) each pay a full Ray round trip per call and queue behind
one another at the actor. Here they share round trips: one sender thread keeps
at most one batched call in flight; every call that arrives meanwhile waits in
a queue and goes with the next one, so a lone call is sent at once and a crowd
costs one call per round trip, not one per caller. No timer: batching comes
only from calls overlapping a call.

Each item's answer is its own (the batched call returns one answer per item,
in order; an item's error is its answer). A failure of the whole call (the
actor gone) is every queued item's error. Users: ``ClaimBatcher`` (claims),
the transport's stages and the client's commits.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from dataplane_client.wire.errors import ServiceUnavailable


class CallBatcher:
    """Queues items and sends them, one ``send`` call at a time, from one thread.

    ``send`` takes the queued items and returns one answer per item, in order
    (it blocks: the thread waits on the actor). Futures a caller cancelled
    before their call left are dropped, never sent.
    """

    def __init__(self, send: Callable[[list], list], name: str, max_batch: int):
        self._send = send
        self._name = name
        self._max_batch = max_batch
        self._changed = threading.Condition()
        self._queue: list[tuple[Any, Future]] = []
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, item: Any) -> Future:
        """A future of the item's answer (or of the whole call's error)."""
        future: Future = Future()
        with self._changed:
            if self._closed:
                raise ServiceUnavailable("the client was closed")
            self._queue.append((item, future))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._changed.notify()
        return future

    def queued(self) -> int:
        """Items waiting for the next call (an operator's figure)."""
        return len(self._queue)

    def close(self) -> None:
        """Stop taking items; the thread sends what is queued, then ends."""
        with self._changed:
            self._closed = True
            self._changed.notify()

    def _next_batch(self) -> list[tuple[Any, Future]] | None:
        with self._changed:
            while not self._queue and not self._closed:
                self._changed.wait()
            if not self._queue:
                return None
            batch = self._queue[: self._max_batch]
            self._queue = self._queue[self._max_batch :]
        return [(r, f) for r, f in batch if f.set_running_or_notify_cancel()]

    def _run(self) -> None:
        while (batch := self._next_batch()) is not None:
            if not batch:
                continue
            try:
                answers = self._send([item for item, _ in batch])
                if len(answers) != len(batch):
                    raise ServiceUnavailable(
                        f"{self._name} answered {len(answers)} of {len(batch)} calls"
                    )
            except BaseException as e:  # noqa: BLE001 - every item of the call gets it
                for _, future in batch:
                    future.set_exception(e)
                continue
            for (_, future), answer in zip(batch, answers):
                future.set_result(answer)
