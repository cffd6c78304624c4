"""The journal's records of async-RL changes, and their replay onto a partition's state.

Each change is one record, written before it is applied (``Controller``):

    ("version", pid, version)                          set_policy_version
    ("grant",   pid, grant_id, n, version, expires_at) admit_rollouts granted
    ("release", pid, grant_id)                         release_rollouts
    ("dropped", pid, {task: n}, evicted, ids, births)  stale samples dropped or evicted
    ("filtered", pid, task, ids)                       a filtered claim refused these
    ("admission_wait", pid)                            an admit_rollouts call began to wait

Replay folds them into the form ``VersionState.export`` writes (the snapshot's),
so a restarted controller restores one shape whichever way it came. What the
"dropped" and "filtered" records do to the samples' consumption is the journal's
(``journal._replay``): it forgets dropped samples as it forgets cleared ones.
"""

from __future__ import annotations

from typing import Any

from dataplane_server.core.staleness import RECENTLY_DROPPED, VersionState

OPS = ("version", "grant", "release", "dropped", "filtered", "admission_wait")


def folded(state: dict[str, Any] | None) -> VersionState:
    """A snapshot's state (None: none yet) as an object the records fold into."""
    versions = VersionState(None)
    versions.restore(state)
    return versions


def replay(versions: VersionState, op: str, args: list) -> None:
    if op == "version":
        versions.set_version(int(args[0]))
    elif op == "grant":
        grant_id, n, version, expires_at = args
        versions.add_grant(int(grant_id), int(n), int(version), float(expires_at))
    elif op == "release":
        versions.release(int(args[0]))
    elif op == "dropped":  # journals of older versions have no births
        per_task, evicted, ids = args[:3]
        versions.count_dropped(dict(per_task), int(evicted), list(ids)[-RECENTLY_DROPPED:])
    elif op == "filtered":
        versions.count_filtered(str(args[0]), len(args[1]))
    elif op == "admission_wait":
        versions.admission_waits += 1
