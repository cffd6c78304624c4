"""What the admin endpoint shows, computed from the key space and the units' snapshots.

Plain functions (no Ray): the controller hands them its key space and the
snapshots it just fetched, and returns their messages across the actor boundary.
"""

from __future__ import annotations

import time

import numpy as np

from dataplane_client.wire.errors import InvalidBatch, SamplesNotFound
from dataplane_client.wire.messages import (
    CheckpointSummary,
    FieldSummary,
    GroupDeadlineInfo,
    PartitionDescription,
    PartitionSummary,
    PayloadChoice,
    SamplePage,
    SampleStatus,
    ServiceInfo,
    StalenessInfo,
    UnitInfo,
    UnitSnapshot,
    UnitStatus,
)
from dataplane_server.core import partial_rollouts
from dataplane_server.core.keyspace import NO_LEASE, KeySpace, Partition

STATUS_FILTERS = (None, "", "ready", "pending", "leased", "consumed", "lost")
MAX_PAGE = 10_000


def _partition_bytes(snaps: list[UnitSnapshot | None], partition_id: str) -> list[int]:
    return [s.partition_bytes.get(partition_id, 0) if s else 0 for s in snaps]


def service_info(
    ks: KeySpace,
    infos: list[UnitInfo],
    snaps: list[UnitSnapshot | None],
    *,
    name: str,
    namespace: str,
    version: str,
    started_at: float,
    draining: bool,
    default_capacity: int,
    durability: str = "memory",
    state_dir: str = "",
    last_checkpoint: CheckpointSummary | None = None,
) -> ServiceInfo:
    units = [
        UnitStatus(
            index=i,
            node_id=info.node_id,
            node_ip=info.node_ip,
            alive=ks.unit_alive[i],
            bytes=snap.bytes if snap else 0,
            samples=snap.samples if snap else 0,
            capacity_bytes=snap.capacity_bytes if snap else default_capacity,
            payload_paths=[PayloadChoice(*p) for p in (snap.stats.get("payload_paths", []))]
            if snap
            else [],
        )
        for i, (info, snap) in enumerate(zip(infos, snaps))
    ]
    return ServiceInfo(
        name=name,
        namespace=namespace,
        version=version,
        started_at=started_at,
        uptime_s=time.time() - started_at,
        draining=draining,
        num_partitions=len(ks.partitions),
        num_samples=sum(p.num_samples for p in ks.partitions.values()),
        bytes=sum(u.bytes for u in units),
        capacity_bytes=sum(u.capacity_bytes for u in units),
        units=units,
        durability=durability,
        state_dir=state_dir,
        last_checkpoint=last_checkpoint,
    )


def list_partitions(ks: KeySpace, snaps: list[UnitSnapshot | None]) -> list[PartitionSummary]:
    return [
        PartitionSummary(
            partition_id=pid,
            num_samples=p.num_samples,
            bytes=sum(_partition_bytes(snaps, pid)),
            fields=list(p.schema) or list(p.declaration.fields),
            consumer_tasks=list(p.tasks),
            created_at=p.created_at,
        )
        for pid, p in ks.partitions.items()
    ]


def describe_partition(
    ks: KeySpace, partition_id: str, snaps: list[UnitSnapshot | None]
) -> PartitionDescription:
    part = ks.partition(partition_id)
    n = part.n_rows
    live = part.live[:n]
    names = list(part.schema) + [f for f in part.declaration.fields if f not in part.schema]
    fields = []
    for f in names:
        layout, dtype, shape = part.schema.get(f, ("", "", ()))
        col = part.produced.get(f)
        fields.append(
            FieldSummary(
                name=f,
                dtype=dtype,
                layout=layout,
                trailing_shape=list(shape),
                produced=int((col[:n] & live).sum()) if col is not None else 0,
            )
        )
    return PartitionDescription(
        partition_id=partition_id,
        num_samples=part.num_samples,
        expected_samples=part.declaration.expected_samples,
        group_size=part.group_size,
        created_at=part.created_at,
        fields=fields,
        consumption=[ks.consumption(part, t) for t in part.tasks],
        pending_claims=part.waiting_claims,
        bytes_per_unit=_partition_bytes(snaps, partition_id),
        staleness=staleness_info(ks, part),
        groups=group_deadline_info(ks, part),
    )


def group_deadline_info(keys: KeySpace, part: Partition) -> GroupDeadlineInfo | None:
    deadlines = part.deadlines
    if deadlines is None:
        return None
    return GroupDeadlineInfo(
        deadline_s=deadlines.deadline_s,
        dropped_groups=deadlines.groups,
        dropped_samples=deadlines.samples,
        overdue_groups=int(keys.overdue_groups(part).sum()),
        recently_dropped=list(deadlines.recent),
    )


def staleness_info(keys: KeySpace, part: Partition) -> StalenessInfo | None:
    versions = part.versions
    if versions is None or part.version_tag is None:
        return None
    grants = versions.live_grants()
    untrained = keys.untrained_versions(part)
    return StalenessInfo(
        version=versions.version,
        version_tag=part.version_tag,
        max_staleness=versions.bounded_tasks(part.tasks),
        stale_samples=versions.spec.stale_samples,
        ready_by_version=keys.ready_by_version(part),
        dropped_stale=dict(versions.dropped),
        evicted=versions.evicted,
        granted_in_flight=sum(g.n for g in grants.values()),
        grants=len(grants),
        untrained=len(untrained),
        admission_limit=versions.current_limit(part.tasks, untrained),
        admission_waits=versions.admission_waits,
        recently_dropped=list(versions.recent),  # the newest RECENTLY_DROPPED ids
        filtered=dict(versions.filtered),
        partial_in_progress=partial_rollouts.in_progress(part),
    )


class _Rows:
    """Per row of a partition: the facts a sample's status is made of."""

    def __init__(self, ks: KeySpace, part: Partition):
        n = part.n_rows
        self.alive = np.asarray(ks.unit_alive, dtype=bool)[part.unit[:n]]
        self.all_produced = np.ones(n, dtype=bool)
        for f in part.declaration.fields or list(part.schema):
            col = part.produced.get(f)
            self.all_produced &= col[:n] if col is not None else False
        self.any_consumed = np.zeros(n, dtype=bool)
        self.any_leased = np.zeros(n, dtype=bool)
        self.holders: dict[str, np.ndarray] = {}  # leased task -> lease id per row (0: none)
        now = ks.clock()
        for task in part.tasks:
            consumed = part.column(part.consumed, task)[:n]
            self.any_consumed |= consumed
            if task in part.declaration.task_leases:
                held = part.column(part.lease_until, task, np.float64, 0.0)[:n] > now
                held &= ~consumed
                self.any_leased |= held
                holder = part.column(part.holder, task, np.int64, NO_LEASE)[:n]
                self.holders[task] = np.where(held, holder, NO_LEASE)
        self.masks = {
            "lost": ~self.alive,
            "pending": self.alive & ~self.all_produced,
            "leased": self.alive & self.all_produced & self.any_leased,
            "consumed": self.any_consumed,
            "ready": self.alive & self.all_produced & ~self.any_consumed & ~self.any_leased,
        }

    def status(self, row: int) -> str:
        # The first that holds; "consumed" by one task may still be leased by another.
        return next(
            name
            for name in ("lost", "pending", "leased", "consumed", "ready")
            if self.masks[name][row]
        )

    def leased_by(self, row: int) -> dict[str, int]:
        return {t: int(h[row]) for t, h in self.holders.items() if h[row] != NO_LEASE}


def _status_of(ks: KeySpace, part: Partition, row: int, rows: _Rows) -> SampleStatus:
    return SampleStatus(
        sample_id=part.ids[row] or "",
        fields=part.fields_of(row),
        sequence_length=int(part.seq_len[row]),
        unit=int(part.unit[row]),
        consumed_by=[t for t, col in part.consumed.items() if len(col) > row and col[row]],
        tags=part.tags_of([row])[0],
        lost=not ks.unit_alive[part.unit[row]],
        redeliveries=ks.redeliveries_of(part, row),
        leased_by=rows.leased_by(row),
        status=rows.status(row),
    )


def list_samples(
    ks: KeySpace, partition_id: str, status: str | None, offset: int, limit: int
) -> SamplePage:
    part = ks.partition(partition_id)
    if status not in STATUS_FILTERS:
        raise InvalidBatch(
            f"unknown status filter {status!r}; use ready, pending, leased, consumed or lost"
        )
    facts = _Rows(ks, part)
    mask = part.live[: part.n_rows].copy()
    if status:
        mask &= facts.masks[status]
    rows = np.nonzero(mask)[0]
    offset, limit = max(0, int(offset)), max(1, min(int(limit), MAX_PAGE))
    page = rows[offset : offset + limit]
    return SamplePage(
        samples=[_status_of(ks, part, int(r), facts) for r in page],
        total=len(rows),
        next_offset=offset + limit if offset + limit < len(rows) else None,
    )


def sample_status(ks: KeySpace, partition_id: str, sample_id: str) -> SampleStatus:
    part = ks.partition(partition_id)
    row = part.row_of.get(sample_id)
    if row is None:
        raise SamplesNotFound("unknown sample", ids=[sample_id], partition_id=partition_id)
    return _status_of(ks, part, row, _Rows(ks, part))
