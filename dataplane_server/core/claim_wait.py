"""A blocking claim's wait, decided once for the controller and the in-process client.

A claim that found no batch due waits for a change (a commit, clear, reset or unit
loss: what its shell's condition is notified of), for a held lease of its task to
run out, or for a group short of members to reach its deadline (``group_deadline_s``:
the retry then drops it or takes it partial, so no claim waits on a straggler past
it), then tries again. What to do is decided here; how to wait is the shell's:
``waiting`` is a generator that yields how long to wait and returns the batch, which
the controller drives awaiting an asyncio condition (``controller/claim_wait.py``) and
the in-process client holding a threading one (``drive``). It ends with a batch or a
typed error: the partition was deleted or replaced (UnknownPartition), the batch can
never come (SamplesLost: its samples were lost), or the deadline passed (ClaimTimeout).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator

from dataplane_client.wire.errors import ClaimTimeout, SamplesLost, UnknownPartition
from dataplane_client.wire.messages import ClaimRequest
from dataplane_client.wire.meta import KVBatchMeta
from dataplane_server.core.keyspace import KeySpace, Partition, PolicyCall

# Yields the seconds to wait for a change before trying again, and takes back what the
# shell claimed for it meanwhile (None: nothing, try again itself); returns the batch.
Waiting = Generator[float, KVBatchMeta | None, KVBatchMeta]


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


def waiting(
    keys: KeySpace,
    part: Partition,
    request: ClaimRequest,
    policy: PolicyCall,
    try_claim: Callable[[], KVBatchMeta | None],
) -> Waiting:
    """A blocking claim's wait: call ``try_claim`` after each wake-up until it hands out a
    batch (``request``: the checked claim, ``policy``: the claim policy it runs). Counted
    among the partition's waiting claims while it runs."""
    task, timeout_s = request.task_name, request.timeout_s
    deadline = time.monotonic() + timeout_s
    part.waiting_claims += 1
    try:
        while (remaining := deadline - time.monotonic()) > 0:
            expiry = keys.next_lease_expiry(part, task)
            if expiry is not None:  # wake when a lease runs out, too
                remaining = min(remaining, max(expiry - keys.clock(), 0.001))
            overdue_at = keys.next_group_deadline(part)
            if overdue_at is not None:  # and when a straggler's group reaches its deadline
                remaining = min(remaining, max(overdue_at - keys.clock(), 0.001))
            handed = yield remaining
            if handed is not None:  # the shell's serve pass claimed it (controller/claim_wait)
                return handed
            if keys.partitions.get(part.partition_id) is not part:
                raise UnknownPartition(
                    "partition deleted while the claim waited", partition_id=part.partition_id
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


def drive(steps: Waiting, sleep: Callable[[float], None]) -> KVBatchMeta:
    """Run a wait with a blocking ``sleep(seconds)`` (a threading condition's wait, which
    may raise to end it)."""
    try:
        while True:
            sleep(next(steps))
    except StopIteration as stop:
        return stop.value
    finally:
        steps.close()
