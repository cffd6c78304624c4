"""Concurrent claims of one client coalesced into one controller call.

Many claimers in one process (the threads of a driver, the coroutines of an
async actor, or both) each pay a full Ray round trip per ``claim_meta`` and
queue behind one another at the controller. Here they share round trips: one
sender thread keeps at most one ``claim_many`` call in flight; every claim
that arrives meanwhile waits in a queue and goes with the next call, so a
lone claim is sent at once and a crowd costs one call per round trip, not one
per claimer. No timer: batching comes only from claims overlapping a call.

Each claim's answer is its own (a ``ClaimOutcome``): its batch, its typed
error, or ``must_wait`` (the caller then makes it a plain blocking claim with
the rest of its timeout). A failure of the whole call (the controller gone)
is every queued claim's error.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

from dataplane_client.errors import ServiceUnavailable
from dataplane_client.messages import ClaimOutcome, ClaimRequest

MAX_BATCH = 1024  # claims per controller call; more wait for the next call


class ClaimBatcher:
    """Queues claims and sends them, one ``send`` call at a time, from one thread.

    ``send`` takes the queued requests and returns one outcome per request, in
    order (it blocks: the thread waits on the controller). Futures a caller
    cancelled before their call left are dropped, never sent.
    """

    def __init__(self, send: Callable[[list[ClaimRequest]], list[ClaimOutcome]]):
        self._send = send
        self._changed = threading.Condition()
        self._queue: list[tuple[ClaimRequest, Future]] = []
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, request: ClaimRequest) -> Future:
        """A future of the request's ``ClaimOutcome`` (or of the whole call's error)."""
        future: Future = Future()
        with self._changed:
            if self._closed:
                raise ServiceUnavailable("the client was closed")
            self._queue.append((request, future))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="dataplane-claims", daemon=True
                )
                self._thread.start()
            self._changed.notify()
        return future

    def close(self) -> None:
        """Stop taking claims; the thread sends what is queued, then ends."""
        with self._changed:
            self._closed = True
            self._changed.notify()

    def _next_batch(self) -> list[tuple[ClaimRequest, Future]] | None:
        with self._changed:
            while not self._queue and not self._closed:
                self._changed.wait()
            if not self._queue:
                return None
            batch, self._queue = self._queue[:MAX_BATCH], self._queue[MAX_BATCH:]
        return [(r, f) for r, f in batch if f.set_running_or_notify_cancel()]

    def _run(self) -> None:
        while (batch := self._next_batch()) is not None:
            if not batch:
                continue
            try:
                outcomes = self._send([request for request, _ in batch])
                if len(outcomes) != len(batch):
                    raise ServiceUnavailable(
                        f"claim_many answered {len(outcomes)} of {len(batch)} claims"
                    )
            except BaseException as e:  # noqa: BLE001 - every claim of the call gets it
                for _, future in batch:
                    future.set_exception(e)
                continue
            for (_, future), outcome in zip(batch, outcomes):
                future.set_result(outcome)
