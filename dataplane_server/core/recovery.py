"""Rebuilding the controller's key space from the storage units and its journal.

Used when a controller starts (after a crash, Ray restarts it with the same
arguments) and when a checkpoint is restored. Order matters:

1. commits a dead controller had prepared on several units are settled: rolled
   forward where every unit still holds (or already published) the write, rolled
   back otherwise (stages discarded, and what a unit already published of it undone
   by write id: only the cells the write filled), so no sample is ever half-visible;
2. each partition the journal declares is rebuilt from what the units hold,
   then its consumption and leases are put back by sample id; a sample two
   units hold (``replicas: 2``) is one row again, its second copy's unit recorded;
3. bytes of partitions the journal does not declare (deleted just before a
   crash) are named for freeing.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from dataplane_client.messages import UnitInfo
from dataplane_server.core import unit_calls
from dataplane_server.core.journal import Journal
from dataplane_server.core.keyspace import Declaration, KeySpace
from dataplane_server.core.recovery_messages import PinnedWrite, UnitRecovery


@dataclass(frozen=True)
class Rebuilt:
    """A (re)started controller's state, rebuilt from its units and its journal."""

    keys: KeySpace
    unit_info: list[UnitInfo]
    orphans: dict[str, list[int]]  # partition -> units holding bytes nobody declares
    next_seq: int  # the next commit's sequence number
    published: list[str]  # write ids the units published: a retried commit is a no-op


# How long a (re)starting controller waits for a unit's first answer. A unit whose
# process is still starting on a loaded node is slow, not lost: with the 5 s of an
# ordinary ping, a fresh service on a busy machine began with every unit lost, and a
# restarted controller would have declared a slow unit's samples lost for good. A dead
# unit is known at once (Ray fails the ping), so only a silent one costs this long.
UNIT_FIRST_ANSWER_S = 60.0


async def restart(units: list, journal: Journal | None) -> Rebuilt:
    """Everything a controller needs before serving its first call (fresh start: empty).

    Units that are dead, or silent for ``UNIT_FIRST_ANSWER_S``, are lost from the
    start; their samples are lost (terminal), the others are rebuilt.
    """
    infos = await asyncio.gather(*[unit_calls.ping(u, UNIT_FIRST_ANSWER_S) for u in units])
    alive = [info is not None for info in infos]
    unit_info = [info or UnitInfo(i, "", "", 0, False) for i, info in enumerate(infos)]
    views = await settle_pending_writes(units, alive)
    keys = KeySpace()
    keys.unit_alive = alive
    orphans = rebuild(keys, journal.load() if journal else {}, views)
    return Rebuilt(keys, unit_info, orphans, next_commit_seq(views), published_write_ids(views))


async def rebuild_from_units(
    units: list, unit_alive: list[bool], state: dict[str, dict]
) -> tuple[KeySpace, int]:
    """A key space of ``state``'s partitions over what the units hold now (after a restore
    loaded them), and the next commit's sequence number."""
    views = await settle_pending_writes(units, list(unit_alive))
    keys = KeySpace()
    keys.unit_alive = unit_alive
    rebuild(keys, state, views)
    return keys, next_commit_seq(views)


async def settle_pending_writes(units: list, alive: list[bool]) -> list[UnitRecovery | None]:
    """Roll prepared multi-unit commits forward or back; the units' views afterwards."""
    views = await _views(units, alive)
    pinned: dict[str, tuple[PinnedWrite, set[int]]] = {}
    published: dict[int, set[str]] = {}
    for v in views:
        if v is None:
            continue
        published[v.index] = set(v.published)
        for wid, p in v.pinned.items():
            pinned.setdefault(wid, (p, set()))[1].add(v.index)
    if not pinned:
        return views
    calls = []
    for wid, (write, holders) in pinned.items():
        done = [u for u in write.staged_units if wid in published.get(u, ())]
        if all(u in holders or u in done for u in write.staged_units):
            calls += [units[u].publish.remote(wid) for u in holders]
            continue
        # Back: stages go, and so does what units already published of it, by write id,
        # so samples that existed before (a write-back's) keep their earlier fields.
        calls += [units[u].discard.remote(wid) for u in holders]
        calls += [units[u].unpublish.remote(write.partition_id, wid) for u in done]
    await asyncio.gather(*calls, return_exceptions=True)  # a unit dying now is seen as lost
    return await _views(units, alive)


async def _views(units: list, alive: list[bool]) -> list[UnitRecovery | None]:
    async def one(i: int) -> UnitRecovery | None:
        if not alive[i]:
            return None
        try:
            return await units[i].recovery_view.remote()
        except Exception:  # noqa: BLE001 - a unit that cannot answer is lost; its samples with it
            alive[i] = False
            return None

    return list(await asyncio.gather(*[one(i) for i in range(len(units))]))


def rebuild(keys: KeySpace, state: dict[str, dict], views: list[UnitRecovery | None]) -> dict:
    """Partitions of ``state`` rebuilt into ``keys`` from the units' views.

    Returns {partition id: [units]} of partitions units hold that ``state`` does
    not declare: their bytes belong to nobody.
    """
    held: dict[str, list] = {}
    for v in views:
        if v is not None:
            for pid, rows in v.partitions.items():
                held.setdefault(pid, []).append((v.index, rows))
    for pid, p in state.items():
        part = keys.rebuild_partition(
            pid, Declaration.from_record(p["declaration"]), held.get(pid, [])
        )
        keys.restore_consumption(part, p["tasks"])
        part.answers.restore(p.get("answers", ()))
        if part.versions is not None:
            part.versions.restore(p.get("staleness"))
    return {pid: [u for u, _ in got] for pid, got in held.items() if pid not in state}


def next_commit_seq(views: list[UnitRecovery | None]) -> int:
    return 1 + max(
        (max(rows.seq, default=0) for v in views if v for rows in v.partitions.values()),
        default=0,
    )


def published_write_ids(views: list[UnitRecovery | None]) -> list[str]:
    return [w for v in views if v for w in v.published]
