"""Concurrent calls of one actor's coroutines to another actor, sent as one batched call.

The controller publishes every commit on its unit; with thousands of writers
committing at once, one ``publish`` call per commit costs the unit (and the
controller) a Ray task each. Here the commits that arrive while a call is in
flight go together in the next one: at most one call in flight per target, a
lone item is sent at once, a crowd costs one call per round trip. The asyncio
twin of ``dataplane_client.transport.call_batcher`` (no thread: everything runs on the
actor's event loop, so the queue needs no lock).

Each item's answer is its own (the batched call returns one per item, in
order; a refused item's error is its answer). A failure of the whole call (the
target died) is every item's error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any


class CoalescedCalls:
    def __init__(self, send: Callable[[list], Awaitable[list]], max_batch: int):
        self._send = send
        self._max_batch = max_batch
        self._queue: list[tuple[Any, asyncio.Future]] = []
        self._sender: asyncio.Task | None = None

    def call(self, item: Any) -> asyncio.Future:
        """A future of the item's answer (an error answer is the future's result, not its
        exception: callers gather answers and look at each)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.append((item, future))
        if self._sender is None:
            self._sender = loop.create_task(self._drain())
        return future

    async def _drain(self) -> None:
        try:
            while self._queue:
                batch = self._queue[: self._max_batch]
                self._queue = self._queue[self._max_batch :]
                try:
                    answers = await self._send([item for item, _ in batch])
                except Exception as e:  # noqa: BLE001 - the whole call failed: each item's answer
                    answers = [e] * len(batch)
                for (_, future), answer in zip(batch, answers):
                    if not future.done():
                        future.set_result(answer)
        finally:
            self._sender = None
