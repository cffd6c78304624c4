"""``grpo_groups``: whole complete groups only, oldest group first (the default of a
partition registered with ``grpo_group_size``).

A group is complete when it has exactly ``group_size`` live rows and every one
is ready; groups are ordered by their oldest ready row and handed out whole,
each group's rows in commit order, as many as fit in the batch.

Option ``partial_groups`` (bool, default False): a group past its partition's
``group_deadline_s`` and short of members (overdue) is handed out too, its members
present (every one ready) standing for the whole group; the key space counts the
members that never came toward the batch (docs/architecture.md, "Stragglers").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from dataplane_client.wire.errors import InvalidBatch
from dataplane_server.core.claim_policies.base import (
    PartitionTraits,
    ReadyRows,
    only_options,
    register,
)


@register("grpo_groups")
class GrpoGroups:
    def check_options(self, options: Mapping[str, Any], traits: PartitionTraits) -> dict:
        only_options("grpo_groups", options, ("partial_groups",))
        if traits.group_size is None:
            raise InvalidBatch(
                "claim policy 'grpo_groups' needs a partition registered with grpo_group_size"
            )
        partial = options.get("partial_groups", False)
        if not isinstance(partial, bool):
            raise InvalidBatch(
                f"claim policy 'grpo_groups': partial_groups must be a bool, got {partial!r:.40}"
            )
        return {"partial_groups": True} if partial else {}

    def choose(self, ready: ReadyRows, batch_size: int, options: Mapping[str, Any]) -> np.ndarray:
        positions, codes = complete_groups(ready, partial=bool(options.get("partial_groups")))
        if not len(positions) or ready.group_size is None:
            return positions
        # np.unique's first indices order the groups by their oldest ready row.
        _, first = np.unique(codes, return_index=True)
        return whole_groups(positions, codes, codes[np.sort(first)], batch_size // ready.group_size)


def complete_groups(ready: ReadyRows, partial: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Positions of the rows of complete groups (every live member ready), in commit order,
    and each one's group code; with ``partial``, overdue groups short of members too."""
    size = ready.group_size
    if size is None or not len(ready):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    group = ready.group
    grouped = np.nonzero(group >= 0)[0]
    codes = group[grouped]
    ready_in_group = np.bincount(codes)
    members = ready.group_members[grouped]
    complete = (ready_in_group[codes] == size) & (members == size)
    if partial:  # an overdue group: every member present is ready
        overdue = ready.group_short[grouped] > 0
        complete |= overdue & (ready_in_group[codes] == members)
    return grouped[complete], codes[complete]


def whole_groups(
    positions: np.ndarray, codes: np.ndarray, ordered: np.ndarray, how_many: int
) -> np.ndarray:
    """The positions of the first ``how_many`` groups of ``ordered`` (group codes), group
    after group, each group's rows in commit order."""
    taken = ordered[:how_many]
    rank = np.full(int(codes.max(initial=-1)) + 1, -1, dtype=np.int64)
    rank[taken] = np.arange(len(taken))
    keep = rank[codes] >= 0
    # A stable sort by group rank keeps each group's rows in commit order.
    return positions[keep][np.argsort(rank[codes[keep]], kind="stable")]
