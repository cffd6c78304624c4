"""Blocking claims: where they wait on the controller, and what wakes them.

Each partition has one asyncio condition. A claim that found no batch due waits on
it until a commit, clear, reset or unit loss wakes it (or a held lease of its task
runs out), then tries again; it never blocks the event loop, so other callers are
served meanwhile. What to do after each wake and when to give up is the core's
(``core/claim_wait.py``), shared with the in-process client.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from dataplane_client.wire.messages import ClaimRequest
from dataplane_client.wire.meta import KVBatchMeta
from dataplane_server.core import claim_wait
from dataplane_server.core.keyspace import KeySpace, Partition, PolicyCall


class ClaimWaits:
    """The per-partition conditions blocking claims wait on."""

    def __init__(self) -> None:
        self._changed: dict[str, asyncio.Condition] = {}

    async def wake(self, partition_id: str) -> None:
        cond = self._changed.get(partition_id)
        if cond is not None:
            async with cond:
                cond.notify_all()

    async def wake_all(self) -> None:
        for pid in list(self._changed):
            await self.wake(pid)

    def drop(self, partition_id: str) -> None:
        self._changed.pop(partition_id, None)

    async def wait(
        self,
        keys: KeySpace,
        part: Partition,
        request: ClaimRequest,
        policy: PolicyCall,
        try_claim: Callable[[], KVBatchMeta | None],
    ) -> KVBatchMeta:
        """Call ``try_claim`` after each wake-up until it hands out a batch (``request``: the
        checked claim, ``policy``: the claim policy it runs): ``claim_wait.waiting``."""
        cond = self._changed.setdefault(part.partition_id, asyncio.Condition())
        steps = claim_wait.waiting(keys, part, request, policy, try_claim)
        try:
            async with cond:
                while True:
                    seconds = next(steps)  # before cond.wait(): a finished wait makes none
                    try:
                        await asyncio.wait_for(cond.wait(), timeout=seconds)
                    except asyncio.TimeoutError:
                        pass
        except StopIteration as stop:
            return stop.value
        finally:
            steps.close()
