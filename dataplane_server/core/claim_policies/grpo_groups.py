"""``grpo_groups``: whole complete groups only, oldest group first (the default of a
partition registered with ``grpo_group_size``).

A group is complete when it has exactly ``group_size`` live rows and every one
is ready; groups are ordered by their oldest ready row and handed out whole,
each group's rows in commit order, as many as fit in the batch.
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
        only_options("grpo_groups", options, ())
        if traits.group_size is None:
            raise InvalidBatch(
                "claim policy 'grpo_groups' needs a partition registered with grpo_group_size"
            )
        return {}

    def choose(self, ready: ReadyRows, batch_size: int, options: Mapping[str, Any]) -> np.ndarray:
        positions, codes = complete_groups(ready)
        if not len(positions) or ready.group_size is None:
            return positions
        # np.unique's first indices order the groups by their oldest ready row.
        _, first = np.unique(codes, return_index=True)
        return whole_groups(positions, codes, codes[np.sort(first)], batch_size // ready.group_size)


def complete_groups(ready: ReadyRows) -> tuple[np.ndarray, np.ndarray]:
    """Positions of the rows of complete groups (every live member ready), in commit order,
    and each one's group code."""
    size = ready.group_size
    if size is None or not len(ready):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    group = ready.group
    grouped = np.nonzero(group >= 0)[0]
    codes = group[grouped]
    ready_in_group = np.bincount(codes)
    complete = (ready_in_group[codes] == size) & (ready.group_members[grouped] == size)
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
