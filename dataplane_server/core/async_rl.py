"""The async-RL verbs' decisions, shared by the controller and the in-process client.

Each function checks its arguments against the key space and returns what the
calling shell then journals (the controller) and applies, so both clients
decide alike; none of them awaits, journals or frees bytes.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np

from dataplane_client.wire import arguments
from dataplane_client.wire.errors import AdmissionTimeout, InvalidBatch, UnknownPartition
from dataplane_client.wire.messages import (
    TAG_FILTER_OPS,
    Capabilities,
    ClaimRequest,
    RolloutGrant,
)
from dataplane_client.wire.meta import KVBatchMeta
from dataplane_client.wire.version import __version__
from dataplane_server.core import claim_policies
from dataplane_server.core.keyspace import KeySpace, Partition, PolicyCall

MAX_GRANT_LEASE_S = 7 * 24 * 3600.0


@dataclass(frozen=True)
class Removal:
    """Rows to forget as stale (``per_task``: for which bounded task), as evicted, or as the
    members of ``groups`` groups dropped at their deadline (``group_deadline.py``)."""

    part: Partition
    rows: np.ndarray
    per_task: dict[str, int]
    evicted: int
    groups: int = 0

    @property
    def ids(self) -> list[str]:
        return [self.part.ids[r] or "" for r in self.rows.tolist()]


def stale_removal(keys: KeySpace, part: Partition) -> Removal | None:
    rows, per_task = keys.stale_rows(part)
    return Removal(part, rows, per_task, 0) if len(rows) else None


def expired_removal(keys: KeySpace, part: Partition, policy: PolicyCall) -> Removal | None:
    """The overdue groups a claim running ``policy`` drops before choosing (None: none)."""
    rows, groups = keys.expired_rows(part, policy)
    return Removal(part, rows, {}, 0, groups) if len(rows) else None


def eviction(keys: KeySpace, part: Partition) -> Removal | None:
    rows = keys.evictable_rows(part)
    return Removal(part, rows, {}, len(rows)) if len(rows) else None


def evict_ids(keys: KeySpace, partition_id: str, sample_ids: object) -> Removal:
    part = keys.partition(partition_id)
    ids = arguments.id_list(sample_ids, partition_id=partition_id)
    rows = part.existing_rows(ids, "cannot evict unknown samples")
    return Removal(part, rows, {}, len(rows))


def apply_removal(keys: KeySpace, removal: Removal) -> dict[int, list[str]]:
    """Forget the rows and count them; returns their ids per live unit (bytes to free)."""
    ids = removal.ids
    targets = keys.clear_rows(removal.part, removal.rows)
    count_removal(removal, ids)
    return targets


def count_removal(removal: Removal, ids: list[str]) -> None:
    """Count a removal's samples as stale, evicted or dropped at their group's deadline
    (``ids``: taken before forgetting)."""
    if removal.groups:
        assert removal.part.deadlines is not None
        removal.part.deadlines.count(removal.groups, ids)
    elif removal.part.versions is not None:
        removal.part.versions.count_dropped(removal.per_task, removal.evicted, ids)


def versions_range(keys: KeySpace, partition_id: str, lowest: object, highest: object):
    """The live rows whose version is within [lowest, highest] (retiring generations)."""
    part, _ = keys.versioned(partition_id)
    low = arguments.count(lowest, "lowest", minimum=0)
    high = arguments.count(highest, "highest", minimum=0)
    if high < low:
        raise InvalidBatch(f"version range [{low}, {high}] is empty", partition_id=partition_id)
    return part, keys.rows_of_versions(part, low, high)


class AdmissionAsk:
    """One ``admit_rollouts`` call, checked. The shells (controller, in-process client) loop:
    ``offer`` a grant, journal it and ``record`` it; or wait ``wait_s`` for a change."""

    def __init__(
        self,
        keys: KeySpace,
        partition_id: str,
        n: object,
        wait: object,
        timeout_s: object,
        lease_s: object,
    ):
        self.keys = keys
        self.n = arguments.count(n, "n", minimum=1)
        self.wait = arguments.flag(wait, "wait")
        self.timeout_s = arguments.seconds(timeout_s, "timeout_s")
        self.lease_s = arguments.seconds(lease_s, "lease_s")
        if not 0 < self.lease_s <= MAX_GRANT_LEASE_S:
            raise InvalidBatch(
                f"lease_s must be in (0, {MAX_GRANT_LEASE_S:.0f}], got {self.lease_s}"
            )
        self.part, self.versions = keys.versioned(partition_id)
        self.deadline = time.monotonic() + self.timeout_s
        self.waits = 0
        self.why = ""

    def check_partition(self) -> None:
        """UnknownPartition when the partition was deleted (or replaced) meanwhile."""
        if self.keys.partitions.get(self.part.partition_id) is not self.part:
            raise UnknownPartition(
                "partition deleted while the rollouts waited", partition_id=self.part.partition_id
            )

    def offer(self) -> RolloutGrant | None:
        """A grant to journal and ``record`` now, or None (``why`` says why not)."""
        why = self.versions.refusal(
            self.n, self.keys.untrained_versions(self.part), self.part.tasks
        )
        if why is not None:
            self.why = why
            return None
        return self.versions.new_grant(self.part.partition_id, self.n, self.lease_s)

    def record(self, grant: RolloutGrant) -> None:
        self.versions.add_grant(grant.grant_id, grant.n, grant.version, grant.expires_at)

    def wait_s(self) -> float:
        """How long to wait for a change before offering again (a grant's expiry makes room
        too); AdmissionTimeout once the deadline passed. Counts the call's first wait."""
        if not self.waits:
            self.versions.admission_waits += 1
        self.waits += 1
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise AdmissionTimeout(
                f"{self.n} trajectories not admitted within {self.timeout_s}s: {self.why}",
                partition_id=self.part.partition_id,
            )
        grants = self.versions.live_grants()
        if grants:
            soonest = min(g.expires_at for g in grants.values()) - time.time()
            remaining = min(remaining, soonest + 0.001)
        return remaining


def peek(keys: KeySpace, request: ClaimRequest) -> KVBatchMeta:
    """The batch a (checked) claim would get now, handing nothing out (empty meta: none
    ready)."""
    part, task, policy = keys.claim_setup(request)
    choice = keys.choose_for(request, part, policy, partial_ok=True)
    if choice is None:
        return KVBatchMeta(partition_id=part.partition_id, task_name=task, sample_ids=[])
    return keys.meta_of(part, dataclasses.replace(choice.answer, lease_id=None))


def ready_depth(
    keys: KeySpace, partition_id: str, task_names: object, required_fields: object
) -> dict[str, int]:
    """Per task: samples it could claim now (within its staleness window)."""
    part = keys.partition(partition_id)
    tasks = arguments.name_list(task_names, "task_names")
    required = arguments.name_list(required_fields, "required_fields", allow_empty=True)
    return {t: len(keys.claimable(part, keys.task_of(part, t), required)) for t in tasks}


def capabilities(implementation: str, verbs: list[str]) -> Capabilities:
    return Capabilities(
        implementation=implementation,
        version=__version__,
        claim_policies=claim_policies.names(),
        tag_filter_ops=list(TAG_FILTER_OPS),
        verbs=sorted(verbs),
    )
