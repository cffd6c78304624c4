"""What the admin endpoint shows, computed from the key space and the units' snapshots.

Plain functions (no Ray): the controller hands them its key space and the
snapshots it just fetched, and returns their messages across the actor boundary.
"""

from __future__ import annotations

import time

import numpy as np

from dataplane_client.wire.errors import InvalidBatch, SamplesNotFound
from dataplane_client.wire.messages import (
    FieldSummary,
    PartitionDescription,
    PartitionSummary,
    SamplePage,
    SampleStatus,
    ServiceInfo,
    StalenessInfo,
    UnitInfo,
    UnitSnapshot,
    UnitStatus,
)
from dataplane_server.core.keyspace import KeySpace, Partition

STATUS_FILTERS = (None, "", "ready", "pending", "consumed", "lost")
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
    )


def staleness_info(keys: KeySpace, part: Partition) -> StalenessInfo | None:
    versions = part.versions
    if versions is None or part.version_tag is None:
        return None
    grants = versions.live_grants()
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
        untrained=keys.untrained(part),
        admission_limit=versions.admission_limit(part.tasks),
        admission_waits=versions.admission_waits,
        recently_dropped=list(versions.recent),  # the newest RECENTLY_DROPPED ids
        filtered=dict(versions.filtered),
    )


def _status_of(ks: KeySpace, part: Partition, row: int) -> SampleStatus:
    return SampleStatus(
        sample_id=part.ids[row] or "",
        fields=part.fields_of(row),
        sequence_length=int(part.seq_len[row]),
        unit=int(part.unit[row]),
        consumed_by=[t for t, col in part.consumed.items() if len(col) > row and col[row]],
        tags=part.tags_of([row])[0],
        lost=not ks.unit_alive[part.unit[row]],
        redeliveries=ks.redeliveries_of(part, row),
    )


def list_samples(
    ks: KeySpace, partition_id: str, status: str | None, offset: int, limit: int
) -> SamplePage:
    part = ks.partition(partition_id)
    if status not in STATUS_FILTERS:
        raise InvalidBatch(
            f"unknown status filter {status!r}; use ready, pending, consumed or lost"
        )
    n = part.n_rows
    mask = part.live[:n].copy()
    alive = np.asarray(ks.unit_alive, dtype=bool)[part.unit[:n]]
    all_produced = np.ones(n, dtype=bool)
    for f in part.declaration.fields or list(part.schema):
        col = part.produced.get(f)
        all_produced &= col[:n] if col is not None else False
    any_consumed = np.zeros(n, dtype=bool)
    for task in part.tasks:
        any_consumed |= part.column(part.consumed, task)[:n]
    masks = {
        "lost": ~alive,
        "consumed": any_consumed,
        "ready": alive & all_produced & ~any_consumed,
        "pending": alive & ~all_produced,
    }
    if status:
        mask &= masks[status]
    rows = np.nonzero(mask)[0]
    offset, limit = max(0, int(offset)), max(1, min(int(limit), MAX_PAGE))
    page = rows[offset : offset + limit]
    return SamplePage(
        samples=[_status_of(ks, part, int(r)) for r in page],
        total=len(rows),
        next_offset=offset + limit if offset + limit < len(rows) else None,
    )


def sample_status(ks: KeySpace, partition_id: str, sample_id: str) -> SampleStatus:
    part = ks.partition(partition_id)
    row = part.row_of.get(sample_id)
    if row is None:
        raise SamplesNotFound("unknown sample", ids=[sample_id], partition_id=partition_id)
    return _status_of(ks, part, row)
