"""Async RL in the key space: policy versions, the staleness window, rollout grants.

A partition registered with a ``StalenessSpec`` keeps here what only it knows
about versions: the current policy version (never goes backwards), the live
rollout grants, and the counts of stale samples dropped and evicted. Each
sample's version is its ``version_tag`` column (``Partition.tag_values``); a
GRPO group's version is its oldest member's (``Partition.group_version``, kept
as rows are tagged), so a group is stale as soon as its oldest member is.

Pure and Ray-free: the controller journals each change (``record_*``) before
applying it, and a restart puts the state back from the journal's snapshot
(``export`` / ``restore``).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from dataplane_client.wire.errors import InvalidBatch, VersionRegression
from dataplane_client.wire.messages import RolloutGrant, StalenessSpec, TagFilter
from dataplane_server.core.claim_answers import new_lease_id

RECENTLY_DROPPED = 4_096  # ids of dropped or evicted samples kept for listing

_COMPARE = {
    "<": np.less,
    "<=": np.less_equal,
    ">": np.greater,
    ">=": np.greater_equal,
    "==": np.equal,
    "!=": np.not_equal,
}


@dataclass(frozen=True)
class Grant:
    n: int
    version: int
    expires_at: float  # wall clock: survives a restart as it is


class VersionState:
    """One versioned partition's async-RL state (see the module docstring)."""

    def __init__(self, spec: StalenessSpec | None):
        self.spec = spec if spec is not None else StalenessSpec()  # None: replaying a journal
        self.version = 0
        self.grants: dict[int, Grant] = {}
        self.granted_at: collections.Counter[int] = collections.Counter()  # version -> samples
        self.dropped: collections.Counter[str] = collections.Counter()  # task -> samples
        # task -> samples its filtered claims refused (docs/architecture.md, "Async RL")
        self.filtered: collections.Counter[str] = collections.Counter()
        self.evicted = 0
        self.admission_waits = 0
        # task -> samples claimed at the current version (paced admission; not journaled)
        self.claimed_now: collections.Counter[str] = collections.Counter()
        self.recent: collections.deque[str] = collections.deque(maxlen=RECENTLY_DROPPED)

    # ---- the bound ----------------------------------------------------------------
    def bound(self, task: str, tighter: int | None = None) -> int | None:
        """How many versions behind the current one a sample claimed by ``task`` may be
        (None: any); a claim's own ``max_staleness`` may only tighten the partition's."""
        declared = self.spec.bound(task)
        if tighter is None:
            return declared
        return tighter if declared is None else min(declared, tighter)

    def bounded_tasks(self, tasks: list[str]) -> dict[str, int]:
        return {t: b for t in tasks if (b := self.spec.bound(t)) is not None}

    def oldest_allowed(self, bound: int) -> int:
        return self.version - bound

    # ---- versions ------------------------------------------------------------------
    def check_version(self, version: Any) -> int:
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise InvalidBatch(f"a policy version is an int >= 0, got {version!r:.40}")
        if version < self.version:
            raise VersionRegression(
                f"policy version {version} is below the current {self.version}: "
                "a version never goes backwards"
            )
        if version >= 2**62:
            raise InvalidBatch(f"policy version {version} is out of range")
        return version

    def set_version(self, version: int) -> None:
        if version != self.version:
            self.claimed_now.clear()
        self.version = version
        for v in [v for v in self.granted_at if v < version]:
            del self.granted_at[v]  # the over-sampling cap counts the current version only

    # ---- admission -----------------------------------------------------------------
    def admission_limit(self, tasks: list[str]) -> int | None:
        """The declared bound: (min bound + 1) x admission_batch (None: no admission)."""
        bounds = self.bounded_tasks(tasks)
        if self.spec.admission_batch is None or not bounds:
            return None
        return (min(bounds.values()) + 1) * self.spec.admission_batch

    def current_limit(self, tasks: list[str], untrained_versions: np.ndarray) -> int | None:
        """The bound admission applies now: the declared one, or paced (``spec.pace``):
        the fewest samples the trainer will still take before an outstanding sample (a
        live grant's version, an untrained row's) leaves its window.

        A trainer taking ``admission_batch`` samples per version takes, at versions
        ``version .. v + bound``, ``(v + bound - version + 1) x batch`` samples less those
        it already took at this version (``claimed_now``). With no more samples started
        than that, it has to take a sample of version ``v`` before its window closes. A
        sample already past saving (no room left for it) does not shrink the room; with
        none outstanding, the room is what the trainer takes before a sample started now
        goes stale."""
        limit = self.admission_limit(tasks)
        if limit is None or not self.spec.pace:
            return limit
        bounds = self.bounded_tasks(tasks)
        bound = min(bounds.values())
        claimed = max(self.claimed_now[t] for t, b in bounds.items() if b == bound)
        batch = self.spec.admission_batch

        def room(v: int) -> int:
            return (v + bound - self.version + 1) * batch - claimed

        outstanding = {g.version for g in self.live_grants().values()}
        if len(untrained_versions):
            outstanding.add(int(untrained_versions.min()))
        savable = [room(v) for v in outstanding if room(v) > 0]
        return max(0, min([room(self.version), *savable]))

    def count_claimed(self, task: str, n: int) -> None:
        """``n`` samples handed to ``task`` at the current version (paced admission's
        ``claimed_now``; a process figure: after a restart it counts from 0 again)."""
        self.claimed_now[task] += n

    def live_grants(self, now: float | None = None) -> dict[int, Grant]:
        """Grants not released and not expired (expired ones are forgotten here)."""
        now = time.time() if now is None else now
        for gid in [g for g, grant in self.grants.items() if grant.expires_at <= now]:
            del self.grants[gid]
        return self.grants

    def in_flight(self) -> int:
        return sum(g.n for g in self.live_grants().values())

    def refusal(self, n: int, untrained_versions: np.ndarray, tasks: list[str]) -> str | None:
        """Why ``n`` more trajectories may not start now (None: they may); the versions of
        the samples not trained yet come from ``KeySpace.untrained_versions``. InvalidBatch
        when they never could (more than the declared bound, or admission not declared)."""
        limit = self.admission_limit(tasks)
        if limit is None:
            raise InvalidBatch(
                "admit_rollouts needs a partition registered with "
                "StalenessSpec(max_staleness=..., admission_batch=...)"
            )
        cap = self.spec.oversample_ratio
        per_version = None if cap is None else int(cap * self.spec.admission_batch)
        if n > limit or (per_version is not None and n > per_version):
            raise InvalidBatch(
                f"{n} trajectories can never be admitted: the bound is {limit} samples"
                + ("" if per_version is None else f" and {per_version} per version")
            )
        started = self.in_flight() + len(untrained_versions)
        now = self.current_limit(tasks, untrained_versions)
        assert now is not None
        if started + n > now:
            paced = " (paced: the trainer takes no more before one of them goes stale)"
            return f"{started} samples started and not trained, bound {now}" + (
                paced if now < limit else ""
            )
        if per_version is not None and self.granted_at[self.version] + n > per_version:
            return (
                f"{self.granted_at[self.version]} samples already granted at version "
                f"{self.version}, over-sampling cap {per_version}"
            )
        return None

    def new_grant(self, partition_id: str, n: int, lease_s: float) -> RolloutGrant:
        """A grant not yet recorded (``add_grant`` records it, after the journal)."""
        return RolloutGrant(new_lease_id(), partition_id, n, self.version, time.time() + lease_s)

    def add_grant(self, grant_id: int, n: int, version: int, expires_at: float) -> None:
        self.grants[grant_id] = Grant(n, version, expires_at)
        if version >= self.version:
            self.granted_at[version] += n

    def release(self, grant_id: int) -> bool:
        """False for a grant released before or lapsed already (it stopped counting then)."""
        return self.live_grants().pop(grant_id, None) is not None

    # ---- drops and evictions ----------------------------------------------------------
    def count_dropped(self, per_task: dict[str, int], evicted: int, ids: list[str]) -> None:
        self.dropped.update(per_task)
        self.evicted += evicted
        self.recent.extend(ids)

    def count_filtered(self, task: str, n: int) -> None:
        self.filtered[task] += n

    # ---- journal snapshot ------------------------------------------------------------
    def export(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "grants": [[gid, g.n, g.version, g.expires_at] for gid, g in self.grants.items()],
            "granted_at": [[v, n] for v, n in self.granted_at.items()],
            "dropped": dict(self.dropped),
            "filtered": dict(self.filtered),
            "evicted": self.evicted,
            "admission_waits": self.admission_waits,
            "recent": list(self.recent),
        }

    def restore(self, state: dict[str, Any] | None) -> None:
        if not state:
            return
        self.version = int(state.get("version", 0))
        self.grants = {
            int(gid): Grant(int(n), int(v), float(e)) for gid, n, v, e in state["grants"]
        }
        self.granted_at = collections.Counter({int(v): int(n) for v, n in state["granted_at"]})
        self.dropped = collections.Counter(state.get("dropped") or {})
        self.filtered = collections.Counter(state.get("filtered") or {})
        self.evicted = int(state.get("evicted", 0))
        self.admission_waits = int(state.get("admission_waits", 0))
        self.recent.clear()  # replaced, not appended to: a restore is the whole state
        self.recent.extend(state.get("recent") or ())


def without_grants(state: dict[str, Any] | None) -> dict[str, Any] | None:
    """``VersionState.export`` for a restore into a fresh service: no grant, and none
    counted toward its version's over-sampling cap.

    The grants belonged to the saved service's writers, which may be gone (a killed
    job resumed from its checkpoint) and cannot release them here; kept, they would
    hold the admission window shut until they lapse (``lease_s``, minutes) and the
    cap of their version for good. A grant's samples are in the checkpoint (then
    counted as untrained) or were never put (then generated again by the new writers).
    """
    if not state:
        return state
    granted_at = collections.Counter({int(v): int(n) for v, n in state["granted_at"]})
    for _gid, n, version, _expires in state["grants"]:
        granted_at[int(version)] -= int(n)
    return {
        **state,
        "grants": [],
        "granted_at": [[v, n] for v, n in granted_at.items() if n > 0],
    }


def matching(
    tags: dict[str, np.ndarray],
    present: dict[str, np.ndarray],
    rows: np.ndarray,
    where: tuple[TagFilter, ...],
    partition_id: str,
) -> np.ndarray:
    """Mask over ``rows``: every comparison of ``where`` holds on the row's numeric tags
    (a row without the tag matches no comparison on it)."""
    keep = np.ones(len(rows), dtype=bool)
    for f in where:
        column = tags.get(f.tag)
        if column is None:
            raise InvalidBatch(
                f"where names tag {f.tag!r}, which is not a numeric tag of this partition "
                f"(declared: {sorted(tags)})",
                partition_id=partition_id,
            )
        keep &= present[f.tag][rows] & _COMPARE[f.op](column[rows], f.value)
    return keep
