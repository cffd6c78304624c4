"""Group deadlines: a straggler never wedges a step (docs/architecture.md, "Stragglers").

A partition registered with ``grpo_group_size`` and ``group_deadline_s`` starts a
group's clock when its first member is committed (the key space's clock; a rebuilt
group's starts when the controller rebuilds it). Once ``group_deadline_s`` has passed
and fewer than ``grpo_group_size`` members have arrived, the group is *overdue*, and
the next claim of the partition handles it by one rule:

- a claim that takes whole groups only (``grpo_groups`` without ``partial_groups``)
  drops it first: its members are forgotten, their bytes freed, the group and its
  samples counted and the ids listed (``GroupDeadlines``), one journal record
  (``("expired", pid, groups, ids, births)``) written before, so a restart replays it;
  a group some task already took a member of is left to be cleared as usual;
- a claim with ``policy_options={"partial_groups": True}`` takes the members present
  (every one ready) as one group of its batch instead, and the members that never came
  count toward the batch (a batch of ``batch_size // grpo_group_size`` groups is due).

A member that arrives after its group was dropped is not refused: the group's id then
starts a new group (ids are reused after a clear), which is handled alike at its own
deadline. Pure and Ray-free; the key space keeps each group's clock and arrivals.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

RECENTLY_DROPPED = 4_096  # ids of samples dropped at a deadline kept for listing


class GroupDeadlines:
    """One partition's counts of groups dropped at their deadline (journaled)."""

    def __init__(self, deadline_s: float):
        self.deadline_s = deadline_s
        self.groups = 0  # groups dropped
        self.samples = 0  # their members that had arrived
        self.recent: collections.deque[str] = collections.deque(maxlen=RECENTLY_DROPPED)

    def count(self, groups: int, ids: list[str]) -> None:
        self.groups += groups
        self.samples += len(ids)
        self.recent.extend(ids)

    def export(self) -> dict[str, Any]:
        return {"groups": self.groups, "samples": self.samples, "recent": list(self.recent)}

    def restore(self, state: dict[str, Any] | None) -> None:
        if not state:
            return
        self.groups = int(state.get("groups", 0))
        self.samples = int(state.get("samples", 0))
        self.recent.clear()  # replaced, not appended to: a restore is the whole state
        self.recent.extend(state.get("recent") or ())


def folded(state: dict[str, Any] | None) -> dict[str, Any]:
    """A snapshot's counts (None: none yet) in the form ``replay`` folds records into."""
    return {"groups": 0, "samples": 0, "recent": [], **(state or {})}


def replay(state: dict[str, Any], groups: int, ids: list[str]) -> None:
    """An "expired" record folded into ``folded``'s form."""
    state["groups"] = int(state["groups"]) + int(groups)
    state["samples"] = int(state["samples"]) + len(ids)
    state["recent"] = (list(state["recent"]) + list(ids))[-RECENTLY_DROPPED:]


def due_times(
    started: np.ndarray,
    arrived: np.ndarray,
    live: np.ndarray,
    group_size: int,
    deadline_s: float,
) -> np.ndarray:
    """Per group code: when it is overdue (first member's arrival + the deadline), or inf
    for a group that never will be (complete, or gone)."""
    short = (live > 0) & (arrived < group_size)
    return np.where(short, started + deadline_s, np.inf)
