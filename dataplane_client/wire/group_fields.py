"""Fields stored once per GRPO group (``register_partition(..., group_fields=[...])``).

A GRPO group's prompt is the same for each of its members. A partition with
``grpo_group_size`` may declare such fields per group; a sample's group is its
``group_id`` tag, the notion the ``grpo_groups`` claim policy groups by. A put
then carries each group's value once: the first member's row in the put, after
checking every other member's row is the same bytes (``GroupValueConflict``
otherwise, before anything is staged). Each member still has the field as its
own cell, so claims, reads, clears and counts see per-sample fields as always;
the cells of one group merely point at one stored value (the unit's side:
``dataplane_server.core.unit.groups``).

Ray-free: both clients run ``share`` on every put.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dataplane_client.wire.encoded import EncodedField, row_byte_offsets, take_rows
from dataplane_client.wire.errors import GroupValueConflict, InvalidBatch


@dataclass(frozen=True)
class SharedPut:
    """A put's group fields reduced to one row per group, and who reads which row."""

    encoded: dict[str, EncodedField]  # every field; a group field holds one row per group
    index: dict[str, np.ndarray]  # group field -> per sample, its row in ``encoded[field]``
    groups: list | None  # per sample its group_id (None: the put has no group field)


def share(
    sample_ids: list[str],
    tags: Sequence[dict] | None,
    encoded: dict[str, EncodedField],
    group_fields: frozenset[str],
    partition_id: str,
) -> SharedPut:
    """Keep one row per group of each group field in ``encoded`` (the first member's);
    GroupValueConflict naming the field, the group and the members that differ."""
    names = [name for name in encoded if name in group_fields]
    if not names:
        return SharedPut(encoded, {}, None)
    given: list[dict | None] = list(tags) if tags else [None] * len(sample_ids)
    missing = [s for s, t in zip(sample_ids, given) if not t or "group_id" not in t]
    if missing:
        raise InvalidBatch(
            f"a put of group fields {names} needs every sample's group_id tag "
            "(each group's value is stored once)",
            ids=missing,
            fields=names,
            partition_id=partition_id,
        )
    assert tags is not None
    groups = [t["group_id"] for t in tags]
    first: dict = {}
    carrier = np.fromiter(
        (first.setdefault(g, i) for i, g in enumerate(groups)), dtype=np.int64, count=len(groups)
    )
    carriers, index = np.unique(carrier, return_inverse=True)
    out = dict(encoded)
    for name in names:
        _check_members_agree(name, encoded[name], carrier, groups, sample_ids, partition_id)
        out[name] = take_rows(encoded[name], carriers)
    return SharedPut(out, {name: index.astype(np.int64) for name in names}, groups)


def _check_members_agree(
    name: str,
    enc: EncodedField,
    carrier: np.ndarray,
    groups: list,
    sample_ids: list[str],
    partition_id: str,
) -> None:
    """Every member's row of a group field is its group's first member's, bit for bit."""
    values = enc.require_values()
    offsets = row_byte_offsets(enc)
    starts, ends = offsets[:-1], offsets[1:]
    differ: dict = {}  # group -> members whose row differs
    for i in np.flatnonzero(carrier != np.arange(len(carrier))).tolist():
        c = int(carrier[i])
        if not np.array_equal(values[starts[i] : ends[i]], values[starts[c] : ends[c]]):
            differ.setdefault(groups[i], []).append(sample_ids[i])
    if differ:
        group, members = next(iter(differ.items()))
        raise GroupValueConflict(
            f"group field {name!r} must be the same for every member of a group; group "
            f"{group!r} has members whose value differs from its first member's "
            f"({len(differ)} group(s) differ)",
            ids=members,
            fields=[name],
            partition_id=partition_id,
        )


def rows_for_unit(
    names: Sequence[str], index: dict[str, np.ndarray], rows: np.ndarray
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """For the samples at positions ``rows`` of a put (one unit's share): per field, the
    rows of its encoded field they need, and per group field each sample's position among
    those rows (what the unit expands into one cell per sample)."""
    field_rows = {name: rows for name in names}
    positions = {}
    for name, idx in index.items():
        needed, local = np.unique(idx[rows], return_inverse=True)
        field_rows[name] = needed
        positions[name] = local.astype(np.int64)
    return field_rows, positions


def stored_value_differs(name: str, group: object, partition_id: str) -> GroupValueConflict:
    """The error of a put whose group value differs from the one a group already stores."""
    return GroupValueConflict(
        f"group field {name!r}: group {group!r} already stores another value "
        "(every member of a group must have the same)",
        fields=[name],
        partition_id=partition_id,
    )
