"""Blocking claims: where they wait on the controller, and what wakes them.

A partition's blocking claims wait in arrival order. A commit *serves* them: one
pass, in that order, tries each waiting claim once on its behalf and hands the
batch to each claim it satisfies. Once a claim of one kind (same task, fields,
batch size, rank, policy and filter) finds nothing due, the later claims of that
kind are not tried in the same pass: the same state gives them the same answer.
So a commit costs one try per kind of waiting claim plus one per batch handed
out, and a thousand claimers blocked on one partition are not all woken by every
commit of the writers racing them (a wake-everyone condition made each commit
cost a thousand tries: the claim p99 grew with the claimers).

Any other change (a clear, reset, deletion or unit loss) *wakes* every waiting
claim, which tries itself and checks whether its batch can still come; a claim
also wakes itself when a held lease of its task runs out or its timeout ends.
What to do after each wake and when to give up is the core's
(``core/claim_wait.py``), shared with the in-process client; the event loop is
never blocked, so other callers are served meanwhile.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from dataplane_client.wire.errors import DataPlaneError
from dataplane_client.wire.messages import ClaimRequest
from dataplane_client.wire.meta import KVBatchMeta
from dataplane_server.core import claim_wait
from dataplane_server.core.keyspace import KeySpace, Partition, PolicyCall


def kind_of(request: ClaimRequest) -> str:
    """Claims of one kind get the same answer from one state: the request but its id and
    its wait (a claim's own timeout changes what it waits for, not what is due)."""
    return repr(dataclasses.replace(request, request_id=None, timeout_s=0.0))


@dataclass(eq=False)  # each waiter is itself: removed from its queue by identity
class _Waiter:
    kind: str
    keys: KeySpace
    part: Partition
    try_claim: Callable[[], KVBatchMeta | None]
    woken: asyncio.Event = field(default_factory=asyncio.Event)
    handed: KVBatchMeta | None = None  # what a serve pass claimed for it
    failed: DataPlaneError | None = None  # what a serve pass's try raised

    def current(self) -> bool:
        """Its partition is still the registered one (not deleted or replaced since)."""
        return self.keys.partitions.get(self.part.partition_id) is self.part


class ClaimWaits:
    """The per-partition queues blocking claims wait in."""

    def __init__(self) -> None:
        self._waiting: dict[str, list[_Waiter]] = {}

    def serve(self, partition_id: str) -> None:
        """New samples: try the waiting claims in arrival order, once per kind of claim,
        and hand each its batch (synchronous: no other call changes the key space
        meanwhile)."""
        nothing_due: set[str] = set()
        for waiter in list(self._waiting.get(partition_id, ())):
            if waiter.woken.is_set() or waiter.kind in nothing_due:
                continue
            if not waiter.current():  # let it raise UnknownPartition itself
                waiter.woken.set()
                continue
            try:
                meta = waiter.try_claim()
            except DataPlaneError as e:
                waiter.failed = e
                waiter.woken.set()
                continue
            if meta is None:
                nothing_due.add(waiter.kind)
            else:
                waiter.handed = meta
                waiter.woken.set()

    async def wake(self, partition_id: str) -> None:
        """Any other change: every waiting claim tries itself (and checks its partition
        and whether its batch can still come)."""
        for waiter in self._waiting.get(partition_id, ()):
            waiter.woken.set()

    async def wake_all(self) -> None:
        for partition_id in list(self._waiting):
            await self.wake(partition_id)

    def drop(self, partition_id: str) -> None:
        """Forget a deleted partition's queue (its waiters, woken, leave it themselves)."""
        self._waiting.pop(partition_id, None)

    async def wait(
        self,
        keys: KeySpace,
        part: Partition,
        request: ClaimRequest,
        policy: PolicyCall,
        try_claim: Callable[[], KVBatchMeta | None],
    ) -> KVBatchMeta:
        """Wait in the partition's queue until a serve pass hands a batch, or a wake-up's
        own try gets one (``request``: the checked claim, ``policy``: the claim policy it
        runs): ``claim_wait.waiting`` decides."""
        waiter = _Waiter(kind_of(request), keys, part, try_claim)
        queue = self._waiting.setdefault(part.partition_id, [])
        queue.append(waiter)
        steps = claim_wait.waiting(keys, part, request, policy, try_claim)
        try:
            seconds = next(steps)
            while True:
                try:
                    await asyncio.wait_for(waiter.woken.wait(), timeout=seconds)
                except asyncio.TimeoutError:
                    pass
                # A batch handed by a serve pass is taken even when the wait timed out at
                # the same moment: it is granted and journaled, so it must be answered.
                handed, waiter.handed = waiter.handed, None
                if waiter.failed is not None:
                    raise waiter.failed
                waiter.woken.clear()
                seconds = steps.send(handed)
        except StopIteration as stop:
            return stop.value
        finally:
            steps.close()
            queue.remove(waiter)
