"""Consumption tied to the trainer's saved steps: a run resumed from step k trains every
sample once.

Without this, a trainer restored from its step-k checkpoint skips every sample it
claimed after step k: the store counts them consumed, the restored policy never
learned from them (NeMo-RL #3599 measured 30% of prompts skipped across one save and
restore). Kafka's answer is ours: the consumer commits its position with its
progress.

- Every claim the key space grants stamps its rows with the task's claim count
  (``Partition.claimed_at``: 1 for the task's first claim, 2 for its second, ...). The
  controller journals each grant as one ``claim`` record, so a replay counts the same.
- ``commit_step(task, k)``, called once the trainer's step-k policy is saved, marks
  step k at the current count. Steps only move forward; committing the last step
  again changes nothing (a retry).
- ``rewind_to_step(task, k)``, called by a trainer resumed from its step-k checkpoint,
  hands back every sample claimed after step k's mark (consumed or leased: claimable
  again, in either task mode) and keeps those claimed up to it done; marks of later
  steps go. ``k = None``: back to before the first step (every claim handed back).
  Samples claimed after the mark but cleared or dropped since are gone either way.

The same rules fold journal records (``fold_*``, used by ``journal.py``'s replay), so a
controller restart rebuilds the marks and stamps the key space had.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from dataplane_client.wire.errors import InvalidBatch

NOT_CLAIMED = 0  # a row no claim of the task took (claim counts start at 1; new rows grow with 0)


@dataclass
class TaskSteps:
    """One task's claim count and step marks (step -> claim count at its commit)."""

    claims: int = 0
    marks: dict[int, int] = field(default_factory=dict)

    @property
    def last(self) -> int | None:
        return max(self.marks) if self.marks else None

    def export(self) -> dict[str, Any]:
        return {"claims": self.claims, "marks": sorted(self.marks.items())}

    @classmethod
    def restore(cls, state: dict[str, Any] | None) -> TaskSteps:
        state = state or {}
        return cls(int(state.get("claims", 0)), {int(k): int(n) for k, n in state.get("marks", ())})


# ---- the key space's side ------------------------------------------------------------
class Partition(Protocol):
    """What these rules read and write of a key-space partition (``keyspace.Partition``;
    a protocol, so this module does not import the key space that imports it)."""

    partition_id: str
    n_rows: int
    live: np.ndarray
    claimed_at: dict[str, np.ndarray]
    steps: dict[str, TaskSteps]

    def column(self, table: dict[str, np.ndarray], name: str, dtype=bool, fill=False): ...


def steps_of(part: Partition, task: str) -> TaskSteps:
    return part.steps.setdefault(task, TaskSteps())


def stamp(part: Partition, task: str, rows: np.ndarray) -> None:
    """A granted claim: its rows carry the task's new claim count."""
    steps = steps_of(part, task)
    steps.claims += 1
    part.column(part.claimed_at, task, np.int64, NOT_CLAIMED)[rows] = steps.claims


def check_commit(part: Partition, task: str, step: int) -> bool:
    """Whether committing ``step`` records a mark (False: it is the last one, again);
    a step below the last committed one is InvalidBatch."""
    last = steps_of(part, task).last
    if last is not None and step < last:
        raise InvalidBatch(
            f"step {step} of task {task!r} is below its last committed step {last}: steps "
            "only move forward (to go back, rewind_to_step)",
            partition_id=part.partition_id,
        )
    return last != step


def commit(part: Partition, task: str, step: int) -> None:
    steps = steps_of(part, task)
    steps.marks[step] = steps.claims


def threshold(part: Partition, task: str, step: int | None) -> int:
    """The claim count up to which claims stay done when rewinding to ``step``."""
    if step is None:
        return 0
    marks = steps_of(part, task).marks
    if step not in marks:
        raise InvalidBatch(
            f"task {task!r} has no committed step {step} to rewind to (committed: "
            f"{sorted(marks) or 'none'})",
            partition_id=part.partition_id,
        )
    return marks[step]


def rows_after(part: Partition, task: str, step: int | None) -> np.ndarray:
    """Live rows the task claimed after ``step``'s mark: what a rewind hands back."""
    n = part.n_rows
    stamped = part.column(part.claimed_at, task, np.int64, NOT_CLAIMED)[:n]
    return np.nonzero(part.live[:n] & (stamped > threshold(part, task, step)))[0]


def forget_after(part: Partition, task: str, step: int | None) -> None:
    """Marks of steps after ``step`` go (``None``: every mark)."""
    marks = steps_of(part, task).marks
    for later in [k for k in marks if step is None or k > step]:
        del marks[later]


# ---- the journal's side: the same rules over its per-task fold -----------------------
def folded(task: dict) -> None:
    """A journal fold's task entry gains what this module keeps."""
    task.setdefault("claimed_at", {})
    task.setdefault("steps", TaskSteps())


def fold_claim(task: dict, ids: list) -> None:
    steps: TaskSteps = task["steps"]
    steps.claims += 1
    task["claimed_at"].update(dict.fromkeys(ids, steps.claims))


def fold_commit(task: dict, step: int) -> None:
    steps: TaskSteps = task["steps"]
    if steps.last != step:
        steps.marks[step] = steps.claims


def fold_rewind(task: dict, step: int | None) -> None:
    steps: TaskSteps = task["steps"]
    limit = 0 if step is None else steps.marks.get(step, steps.claims)
    after = [sid for sid, n in task["claimed_at"].items() if n > limit]
    for sid in after:
        del task["claimed_at"][sid]
        task["consumed"].discard(sid)
        task["leases"].pop(sid, None)
    for later in [k for k in steps.marks if step is None or k > step]:
        del steps.marks[later]
