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
   a sample the journal says was removed (cleared, dropped, evicted) and that a unit
   still holds, born no later than the removal says, is left out: the controller
   died before the unit freed it;
3. bytes of partitions the journal does not declare (deleted just before a
   crash), and of removed samples still held, are named for freeing.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from dataplane_client.wire.messages import UnitInfo
from dataplane_server.core import unit_calls
from dataplane_server.core.journal import Journal
from dataplane_server.core.keyspace import Declaration, KeySpace
from dataplane_server.core.recovery_messages import PinnedWrite, StoredRows, UnitRecovery


@dataclass(frozen=True)
class Rebuilt:
    """A (re)started controller's state, rebuilt from its units and its journal."""

    keys: KeySpace
    unit_info: list[UnitInfo]
    orphans: dict[str, list[int]]  # partition -> units holding bytes nobody declares
    removed: dict[str, dict[int, list[str]]]  # partition -> unit -> removed ids it still holds
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
    state = journal.load() if journal else {}
    orphans, removed = rebuild(keys, state, views)
    return Rebuilt(
        keys, unit_info, orphans, removed, next_commit_seq(views, state), published_write_ids(views)
    )


async def rebuild_from_units(
    units: list, unit_alive: list[bool], state: dict[str, dict]
) -> tuple[KeySpace, int]:
    """A key space of ``state``'s partitions over what the units hold now (after a restore
    loaded them), and the next commit's sequence number."""
    views = await settle_pending_writes(units, list(unit_alive))
    keys = KeySpace()
    keys.unit_alive = unit_alive
    rebuild(keys, state, views)
    return keys, next_commit_seq(views, state)


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


def rebuild(
    keys: KeySpace, state: dict[str, dict], views: list[UnitRecovery | None]
) -> tuple[dict[str, list[int]], dict[str, dict[int, list[str]]]]:
    """Partitions of ``state`` rebuilt into ``keys`` from the units' views.

    Returns {partition id: [units]} of partitions units hold that ``state`` does
    not declare (their bytes belong to nobody), and {partition id: {unit: ids}} of
    removed samples units still hold (their bytes are to be freed too).
    """
    held: dict[str, list] = {}
    for v in views:
        if v is not None:
            for pid, rows in v.partitions.items():
                held.setdefault(pid, []).append((v.index, rows))
    removed: dict[str, dict[int, list[str]]] = {}
    for pid, p in state.items():
        gone = {sid: int(born) for sid, born in p.get("removed", ())}
        stored = []
        for unit, rows in held.get(pid, []):
            rows, dropped = without_removed(rows, gone)
            stored.append((unit, rows))
            if dropped:
                removed.setdefault(pid, {})[unit] = dropped
        part = keys.rebuild_partition(pid, Declaration.from_record(p["declaration"]), stored)
        if p.get("created_at"):  # a checkpoint's or snapshot's; a replayed register has none
            part.created_at = float(p["created_at"])
        keys.restore_consumption(part, p["tasks"])
        part.answers.restore(p.get("answers", ()))
        if part.versions is not None:
            part.versions.restore(p.get("staleness"))
        if part.deadlines is not None:  # groups dropped at their deadline
            part.deadlines.restore(p.get("groups"))
    orphans = {pid: [u for u, _ in got] for pid, got in held.items() if pid not in state}
    return orphans, removed


def without_removed(rows: StoredRows, removed: dict[str, int]) -> tuple[StoredRows, list[str]]:
    """``rows`` less the samples born no later than their removal (a later sample of the
    same id, born after it, stays), and the ids left out."""
    if not removed:
        return rows, []
    keep = [
        i
        for i, (sid, seq) in enumerate(zip(rows.sample_ids, rows.seq))
        if seq > removed.get(sid, -2)
    ]
    if len(keep) == len(rows.sample_ids):
        return rows, []
    dropped = [rows.sample_ids[i] for i in sorted(set(range(len(rows.sample_ids))) - set(keep))]
    return (
        StoredRows(
            sample_ids=[rows.sample_ids[i] for i in keep],
            seq=[rows.seq[i] for i in keep],
            sequence_lengths=[rows.sequence_lengths[i] for i in keep],
            tags=[rows.tags[i] for i in keep],
            fields=rows.fields,
            produced={name: [bits[i] for i in keep] for name, bits in rows.produced.items()},
        ),
        dropped,
    )


def next_commit_seq(views: list[UnitRecovery | None], state: dict[str, dict]) -> int:
    """Above every commit the units hold and every birth a removal names: a sample put
    after a restart is never mistaken for one removed before it (``without_removed``)."""
    held = (max(rows.seq, default=0) for v in views if v for rows in v.partitions.values())
    named = (int(born) for p in state.values() for _, born in p.get("removed", ()))
    return 1 + max(max(held, default=0), max(named, default=0))


def published_write_ids(views: list[UnitRecovery | None]) -> list[str]:
    return [w for v in views if v for w in v.published]
