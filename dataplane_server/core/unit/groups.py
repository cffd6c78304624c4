"""A unit's side of group fields (``group_fields``): one stored value per group (no Ray).

A put sends each group's value once (``dataplane_client.wire.group_fields``): the
stage carries, per group field, each sample's row among the few it holds
(``staged_cells``), so the members' cells of one put point at one region. A
later put of more members of a group that this unit already stores a value for
points their cells at that stored value when the bytes are equal (and is
``GroupValueConflict`` when they are not); its own copy is released at publish
with the rest of the stage. A value's bytes stay while any cell points at them
(the arena counts one reference per cell), so they go with the group's last
member; stored bytes count such a region once (``partition.distinct_bytes``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from dataplane_client.wire.encoded import EncodedField
from dataplane_client.wire.errors import InvalidBatch
from dataplane_client.wire.group_fields import stored_value_differs

if TYPE_CHECKING:
    from dataplane_server.core.recovery_messages import SampleMeta
    from dataplane_server.core.unit.arena import Arena
    from dataplane_server.core.unit.partition import Column, UnitPartition


def checked_rows(
    group_rows: Any, encoded: dict[str, EncodedField], num_ids: int
) -> dict[str, np.ndarray]:
    """A stage's ``group_rows`` (field -> each sample's row of that field), checked: one
    entry per sample, each naming a row the field has."""
    if not group_rows:
        return {}
    if not isinstance(group_rows, dict) or not set(group_rows) <= set(encoded):
        raise InvalidBatch("group_rows must map fields of the write to row indices")
    out = {}
    for name, rows in group_rows.items():
        rows = np.asarray(rows)
        if rows.dtype.kind not in "iu" or rows.shape != (num_ids,):
            raise InvalidBatch(f"group_rows of {name!r}: one integer per sample", fields=[name])
        if num_ids and (rows.min() < 0 or rows.max() >= encoded[name].num_rows):
            raise InvalidBatch(f"group_rows of {name!r} name rows it lacks", fields=[name])
        out[name] = rows.astype(np.int64)
    return out


def groups_of(part: UnitPartition, sample_ids: list[str], meta: SampleMeta | None) -> list:
    """Each sample's group_id: this commit's tag, else the one stored with it (None: none)."""
    tags = meta.tags if meta is not None else {}
    out = []
    for sid in sample_ids:
        tag = tags.get(sid) or part.tags.get(part.slot_of.get(sid, -1)) or {}
        out.append(tag.get("group_id"))
    return out


def stored_values(
    part: UnitPartition | None,
    arena: Arena,
    partition_id: str,
    sample_ids: list[str],
    staged: dict[str, tuple],
    shared: frozenset[str],
    meta: SampleMeta | None,
    *,
    strict: bool,
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per group field of a staged write: the positions (in ``sample_ids``) whose group
    already stores a value here, and per position the slot holding it. A staged value
    that differs from its group's stored one is GroupValueConflict (``strict``) or keeps
    its own bytes (a publish after ``prepare``, which must not fail)."""
    if part is None or not shared:
        return {}
    groups = groups_of(part, sample_ids, meta)
    own = {part.slot_of[s] for s in sample_ids if s in part.slot_of}
    out = {}
    for name in shared:
        col = part.columns.get(name)
        if col is None:
            continue
        col.ensure(part.next_slot)
        _schema, block, offs, nbytes, _lengths = staged[name]
        holder_of: dict = {}  # group -> slot holding its value here (-1: none to share)
        positions, holders = [], []
        for i, group in enumerate(groups):
            if group is None:
                continue
            if group not in holder_of:
                holder = _holder(part, col, group, own)
                if holder >= 0 and not _same_bytes(arena, col, holder, block, offs[i], nbytes[i]):
                    if strict:
                        raise stored_value_differs(name, group, partition_id)
                    holder = -1
                holder_of[group] = holder
            if holder_of[group] >= 0:
                positions.append(i)
                holders.append(holder_of[group])
        if positions:
            out[name] = (np.asarray(positions, dtype=np.int64), np.asarray(holders, dtype=np.int64))
    return out


def _holder(part: UnitPartition, col: Column, group: Any, own: set[int]) -> int:
    """A slot of ``group`` outside this write whose cell holds the group's value, or -1."""
    for slot in part.group_slots.get(group, ()):
        if slot not in own and col.chunk[slot] >= 0:
            return slot
    return -1


def _same_bytes(
    arena: Arena, col: Column, holder: int, block: int, offset: int, nbytes: int
) -> bool:
    if int(col.nbytes[holder]) != int(nbytes):
        return False
    start = np.array([col.offset[holder], offset], dtype=np.int64)
    both = arena.gather(
        [int(col.chunk[holder]), int(block)], np.array([0, 1]), start, start + int(nbytes)
    )
    return bool(np.array_equal(both[:nbytes], both[nbytes:]))


def point_at_stored(col: Column, slots: np.ndarray, reuse: tuple[np.ndarray, np.ndarray]) -> None:
    """Make the cells of ``slots[positions]`` point at their holders' stored values."""
    positions, holders = reuse
    targets = slots[positions]
    col.chunk[targets] = col.chunk[holders]
    col.offset[targets] = col.offset[holders]
    col.nbytes[targets] = col.nbytes[holders]
    col.length[targets] = col.length[holders]
