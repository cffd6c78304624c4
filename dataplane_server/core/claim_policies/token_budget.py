"""``token_budget``: whole items, oldest first, while their tokens fit a budget.

An *item* is a sample, or, on a partition registered with ``grpo_group_size``, a
whole complete group (as ``grpo_groups`` hands them out: never split). Items are
taken in order (oldest first) while the batch's token sum (each sample's
sequence length; a row with no recorded length counts 0) stays within
``token_budget``, its sample count within ``batch_size`` and, with ``step_end``,
the claiming task's consumed-or-held count within ``step_end``. The first item
that does not fit ends the batch: no later, smaller item jumps it, so every
item is handed out in turn.

An item longer than the whole budget, when it comes first: with
``oversize="alone"`` (the default) it is handed out alone, so a long sample
never wedges the partition; with ``oversize="refuse"`` the claim gets nothing
(another claim, with ``"alone"``, takes it). ``policy_workers.rank_stream``
uses both to keep data-parallel ranks' token totals within one budget of
each other.

``step_end`` (an int >= 0) is a quota shared by every claim of the task: a
claim hands out at most ``step_end - taken`` samples, where ``taken`` is what
the task has consumed or holds under a lease when the claim is served
(``ReadyRows.taken``); the key space serves claims one at a time, so
concurrent claimers together never pass it. A claim is due when its batch is
full (``batch_size`` samples), so a budget-limited batch is for
``blocking=False`` claims, as ``RankStream`` makes.

Options: ``token_budget`` (int >= 1, required), ``step_end`` (int >= 0),
``oversize`` (``"alone"`` or ``"refuse"``), at registration or per claim.
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
    positive_int,
    register,
)
from dataplane_server.core.claim_policies.grpo_groups import complete_groups

NAME = "token_budget"
OVERSIZE = ("alone", "refuse")


def items(ready: ReadyRows) -> tuple[np.ndarray, np.ndarray]:
    """The ready rows as items in hand-out order: ``(positions, item)``, the positions
    item after item (each row alone, or each complete group's rows in commit order, groups
    by their oldest ready row) and each position's item number (0, 1, ...)."""
    if ready.group_size is None:
        every = np.arange(len(ready), dtype=np.int64)
        return every, every
    positions, codes = complete_groups(ready)
    if not len(positions):
        return positions, positions
    _, first = np.unique(codes, return_index=True)
    rank = np.zeros(int(codes.max()) + 1, dtype=np.int64)
    rank[codes[np.sort(first)]] = np.arange(len(first))
    order = np.argsort(rank[codes], kind="stable")  # item after item, commit order inside
    return positions[order], rank[codes[order]]


def budgeted(
    lengths: np.ndarray,
    positions: np.ndarray,
    item: np.ndarray,
    budget: int,
    room: int,
    oversize: str,
) -> np.ndarray:
    """The positions of the leading items that together fit ``budget`` tokens and ``room``
    samples (a first item over the budget alone, with ``oversize="alone"``)."""
    if not len(positions):
        return positions
    n_items = int(item[-1]) + 1
    cost = np.bincount(item, weights=lengths[positions], minlength=n_items)
    size = np.bincount(item, minlength=n_items)
    fits = (np.cumsum(cost) <= budget) & (np.cumsum(size) <= room)
    k = int(np.argmin(fits)) if not fits.all() else n_items  # the leading items that fit
    if k == 0 and oversize == "alone" and size[0] <= room:
        k = 1
    return positions[item < k]


@register(NAME)
class TokenBudget:
    def check_options(self, options: Mapping[str, Any], traits: PartitionTraits) -> dict:
        only_options(NAME, options, ("token_budget", "step_end", "oversize"))
        step_end = options.get("step_end")
        if step_end is not None and (
            isinstance(step_end, bool) or not isinstance(step_end, int) or step_end < 0
        ):
            raise InvalidBatch(
                f"claim policy {NAME!r}: step_end must be an int >= 0, got {step_end!r}"
            )
        oversize = options.get("oversize", "alone")
        if oversize not in OVERSIZE:
            raise InvalidBatch(
                f"claim policy {NAME!r}: oversize must be one of {list(OVERSIZE)}, got {oversize!r}"
            )
        return {
            "token_budget": positive_int(NAME, options, "token_budget"),
            "step_end": step_end,
            "oversize": oversize,
        }

    def choose(self, ready: ReadyRows, batch_size: int, options: Mapping[str, Any]) -> np.ndarray:
        room = batch_size
        if options["step_end"] is not None:
            room = min(room, options["step_end"] - ready.taken)
        if room <= 0 or not len(ready):
            return np.zeros(0, dtype=np.int64)
        lengths = np.maximum(ready.sequence_lengths, 0)
        positions, item = items(ready)
        return budgeted(
            lengths, positions, item, options["token_budget"], room, options["oversize"]
        )
