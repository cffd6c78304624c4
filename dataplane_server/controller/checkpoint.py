"""Saving and restoring the whole store: the controller's side of a checkpoint.

The directory format (manifest, checksums, temporary name then rename) is
``checkpoint``'s; here the cut is taken, the units are asked to pin, write or load
their files, and after a restore the key space is rebuilt exactly as after a restart.

A save pauses nothing but commits' and frees' step onto the units, for as long as
the units take to pin their rows (``cut_gate``): under the gate the controller
reads its state and the samples each unit holds as of one commit sequence number
(the cut's position), the units pin those rows' bytes, and the gate opens; the
units copy in the background while writers, claimers and clears go on.

With ``replicas: 2`` the cut names each sample on its first copy's unit only, so a
checkpoint holds each sample once; a restore brings each sample back with that one
copy (it is not re-replicated). A restore brings back no admission grant (``staleness.without_grants``):
their holders were the saved service's writers.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from dataplane_client.wire.errors import CorruptPayload, DataPlaneError, InvalidBatch
from dataplane_client.wire.messages import CheckpointSummary
from dataplane_server.core import checkpoint, recovery, staleness, unit_calls
from dataplane_server.core.journal import Journal
from dataplane_server.core.keyspace import KeySpace


@dataclass(frozen=True)
class Cut:
    """What the controller knows at the cut: its state, the samples each live unit is to
    write (unit -> partition -> ids) and the cut's position."""

    state: dict
    rows: dict[int, dict[str, list[str]]]
    position: int  # the last commit sequence number in the cut
    journal: tuple[int, int] | None  # (generation, records) of the journal at the cut
    taken_at: float


def cut(keys: KeySpace, position: int, journal: Journal | None) -> Cut:
    """The cut of ``keys`` now (synchronous: nothing changes while it runs)."""
    rows: dict[int, dict[str, list[str]]] = {u: {} for u in keys.live_units()}
    for pid, part in keys.partitions.items():
        n = part.n_rows
        live, unit = part.live[:n], part.unit[:n]
        for u, got in rows.items():
            got[pid] = [part.ids[r] for r in np.nonzero(live & (unit == u))[0].tolist()]
    where = None if journal is None else (journal.generation, journal.records)
    return Cut(keys.export_state(), rows, position, where, time.time())


async def save(
    directory: str,
    units: list,
    hold: Callable[[], contextlib.AbstractAsyncContextManager],
    cut_now: Callable[[], Cut],
    parent: str | None = None,
    copy_share: float = 1.0,
) -> CheckpointSummary:
    """Write a checkpoint of the store to ``directory``: a cut taken under ``hold`` (the
    lifecycle lock and the closed cut gate), copied after it. ``parent``: an earlier
    checkpoint whose files are linked, not copied, for values it holds already.
    ``copy_share``: the share of one core each unit's copy may keep busy.

    A failure, or a crash, leaves only the temporary directory, which never loads.
    """
    t0 = time.perf_counter()
    parent_path = None if parent is None else os.path.abspath(parent)
    parent_files = (
        {} if parent_path is None else checkpoint.unit_files(checkpoint.manifest(parent_path))
    )
    tmp = checkpoint.start(directory)
    checkpoint_id = uuid.uuid4().hex[:12]
    try:
        async with hold():
            taken = cut_now()
            await asyncio.gather(
                *[units[u].pin_checkpoint.remote(checkpoint_id) for u in taken.rows]
            )
        dumped = await asyncio.gather(
            *[
                units[u].write_checkpoint.remote(
                    checkpoint_id, tmp, rows, parent_path, parent_files.get(u), copy_share
                )
                for u, rows in taken.rows.items()
            ]
        )
        about = {
            "id": checkpoint_id,
            "position": taken.position,
            "journal": taken.journal,
            "taken_at": taken.taken_at,
            "parent": parent_path,
        }
        # In a thread: the state's encoding and the syncs must not stall the event loop.
        await asyncio.to_thread(checkpoint.finish, tmp, directory, list(dumped), taken.state, about)
    except BaseException as e:
        checkpoint.abandon(tmp)
        if isinstance(e, Exception):
            failure = _os_error(e)  # a unit's file, the state, the manifest or the rename
            if failure is not None:
                raise checkpoint.save_failed(os.path.abspath(directory), failure) from None
            raise unit_calls.typed(e) from None
        raise
    return CheckpointSummary(
        directory=os.path.abspath(directory),
        position=taken.position,
        journal_generation=-1 if taken.journal is None else taken.journal[0],
        journal_records=-1 if taken.journal is None else taken.journal[1],
        taken_at=taken.taken_at,
        parent=parent_path or "",
        samples=sum(d.samples for d in dumped),
        partitions=_samples_by_partition(taken),
        bytes_written=sum(d.written for d in dumped),
        bytes_linked=sum(d.linked for d in dumped),
        seconds=time.perf_counter() - t0,
    )


def _samples_by_partition(taken: Cut) -> dict[str, int]:
    counts: dict[str, int] = {}
    for rows in taken.rows.values():
        for pid, ids in rows.items():
            counts[pid] = counts.get(pid, 0) + len(ids)
    return counts


def _os_error(exc: BaseException) -> OSError | None:
    """The ``OSError`` behind a failure (raised here, or in a unit and wrapped by Ray), if
    it is one; a data-plane error, a lost actor or a timeout is not."""
    cause = exc if isinstance(exc, DataPlaneError) else getattr(exc, "cause", exc)
    if isinstance(cause, OSError) and not isinstance(
        cause, DataPlaneError | ConnectionError | TimeoutError
    ):
        return cause
    return None


async def restore(
    directory: str, units: list, keys: KeySpace, journal: Journal | None
) -> tuple[KeySpace, int, int]:
    """Load a checkpoint into the (empty) units behind ``keys``.

    Every file is checked against the manifest before anything is stored; a
    unit that refuses its file makes the others drop theirs, so the service
    stays empty. Returns the rebuilt key space, the next commit sequence
    number and the number of samples loaded. The caller holds its lifecycle lock.
    """
    files, state = checkpoint.read(directory)
    if keys.partitions:
        raise InvalidBatch(
            f"restore needs an empty service; this one holds {len(keys.partitions)} partitions"
        )
    alive = keys.live_units()
    by_unit: dict[int, list] = {}
    for f in files:
        by_unit.setdefault(f.unit, []).append(f)
    if len(by_unit) > len(alive):
        raise InvalidBatch(
            f"the checkpoint has files of {len(by_unit)} units; this service has {len(alive)} "
            "live units"
        )
    path = os.path.abspath(directory)
    loads = [units[u].load.remote(path, f) for u, f in zip(alive, by_unit.values())]
    results = await asyncio.gather(*loads, return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:  # undo what did load: the service stays empty
        await asyncio.gather(*[unit_calls.free(units, pid, dict.fromkeys(alive)) for pid in state])
        unreadable = _os_error(failed[0])
        if unreadable is not None:  # as the controller's own reads of the checkpoint say it
            raise CorruptPayload(f"{path}: cannot read a unit's checkpoint file ({unreadable})")
        raise unit_calls.typed(failed[0])
    for part in state.values():  # the saved service's writers hold no grant here
        part["staleness"] = staleness.without_grants(part.get("staleness"))
    if journal:
        journal.compact(state)
    rebuilt, next_seq = await recovery.rebuild_from_units(units, keys.unit_alive, state)
    return rebuilt, next_seq, sum(r for r in results if isinstance(r, int))
