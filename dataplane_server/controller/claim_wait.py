"""Blocking claims: where they wait, and what wakes them.

Each partition has one asyncio condition. A claim that found no batch due
waits on it until a commit, clear, reset or unit loss wakes it (or a held
lease of its task runs out), then tries again; it never blocks the event
loop, so other callers are served meanwhile. It ends with a batch, or a typed
error: the partition was deleted, the batch can never come (its samples were
lost), or the deadline passed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from dataplane_client.wire.errors import ClaimTimeout, SamplesLost, UnknownPartition
from dataplane_client.wire.messages import ClaimRequest
from dataplane_client.wire.meta import KVBatchMeta
from dataplane_server.core.keyspace import KeySpace, Partition, PolicyCall


def raise_if_unsatisfiable(keys: KeySpace, part: Partition, task: str) -> None:
    """SamplesLost naming the lost ids when nothing but lost samples is left for the task."""
    lost = keys.unsatisfiable(part, task)
    if lost:
        raise SamplesLost(
            f"task {task!r} can never get a batch: every other sample of the partition is "
            "done, and these were lost with their storage unit",
            ids=lost,
            partition_id=part.partition_id,
        )


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
        checked claim, ``policy``: the claim policy it runs)."""
        task, timeout_s = request.task_name, request.timeout_s
        deadline = time.monotonic() + timeout_s
        cond = self._changed.setdefault(part.partition_id, asyncio.Condition())
        part.waiting_claims += 1
        try:
            async with cond:
                while (remaining := deadline - time.monotonic()) > 0:
                    expiry = keys.next_lease_expiry(part, task)
                    if expiry is not None:  # wake when a lease runs out, too
                        remaining = min(remaining, max(expiry - keys.clock(), 0.001))
                    try:
                        await asyncio.wait_for(cond.wait(), timeout=remaining)
                    except asyncio.TimeoutError:
                        pass
                    if keys.partitions.get(part.partition_id) is not part:
                        raise UnknownPartition(
                            "partition deleted while the claim waited",
                            partition_id=part.partition_id,
                        )
                    meta = try_claim()
                    if meta is not None:
                        return meta
                    raise_if_unsatisfiable(keys, part, task)
        finally:
            part.waiting_claims -= 1
        required, batch_size = request.required_fields, request.batch_size
        have = keys.ready_count(part, task, required, batch_size, policy)
        raise ClaimTimeout(
            f"only {have} of {batch_size} samples ready after {timeout_s}s (task {task!r})",
            fields=required,
            partition_id=part.partition_id,
        )
