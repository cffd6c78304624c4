"""Saving and restoring the whole store: the controller's side of a checkpoint.

The directory format (manifest, checksums, temporary name then rename) is
``checkpoint``'s; here the units are asked to dump or load their files, and
after a restore the key space is rebuilt exactly as after a restart.

With ``replicas: 2`` each unit leaves the second copies it holds out of its file,
so a checkpoint holds each sample once; a restore brings each sample back with
that one copy (it is not re-replicated). A restore brings back no admission grant
(``staleness.without_grants``): their holders were the saved service's writers.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

import numpy as np

from dataplane_client.wire.errors import CorruptPayload, DataPlaneError, InvalidBatch
from dataplane_server.core import checkpoint, recovery, staleness, unit_calls
from dataplane_server.core.journal import Journal
from dataplane_server.core.keyspace import KeySpace


async def save(
    directory: str, units: list, lifecycle: asyncio.Lock, keys_now: Callable[[], KeySpace]
) -> str:
    """Write a checkpoint of the store to ``directory``; returns its absolute path.

    The state and the units' files are taken under ``lifecycle`` (no partition
    appears or goes while saving); syncing and renaming happen after, so a slow
    disk does not hold registrations up. A failure, or a crash, leaves only the
    temporary directory, which never loads.
    """
    tmp = checkpoint.start(directory)
    try:
        async with lifecycle:
            keys = keys_now()
            state = keys.export_state()
            files = await asyncio.gather(
                *[units[u].dump.remote(tmp, second_copies(keys, u)) for u in keys.live_units()]
            )
        checkpoint.finish(tmp, directory, list(files), state)
    except BaseException as e:
        checkpoint.abandon(tmp)
        if isinstance(e, Exception):
            failure = _os_error(e)  # a unit's file, the state, the manifest or the rename
            if failure is not None:
                raise checkpoint.save_failed(os.path.abspath(directory), failure) from None
            raise unit_calls.typed(e) from None
        raise
    return os.path.abspath(directory)


def _os_error(exc: BaseException) -> OSError | None:
    """The ``OSError`` behind a failure (raised here, or in a unit and wrapped by Ray), if
    it is one; a data-plane error, a lost actor or a timeout is not."""
    cause = exc if isinstance(exc, DataPlaneError) else getattr(exc, "cause", exc)
    if isinstance(cause, OSError) and not isinstance(
        cause, DataPlaneError | ConnectionError | TimeoutError
    ):
        return cause
    return None


def second_copies(keys: KeySpace, unit: int) -> dict[str, list[str]]:
    """Per partition, the samples whose second copy (``replicas: 2``) ``unit`` holds: left
    out of its file, so a checkpoint holds each sample once (from its first copy's unit)."""
    out = {}
    for pid, part in keys.partitions.items():
        n = part.n_rows
        rows = np.nonzero(part.live[:n] & (part.replica[:n] == unit))[0]
        if len(rows):
            out[pid] = [part.ids[r] for r in rows.tolist()]
    return out


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
    if len(files) > len(alive):
        raise InvalidBatch(
            f"the checkpoint has {len(files)} unit files; this service has {len(alive)} live units"
        )
    path = os.path.abspath(directory)
    loads = [units[u].load.remote(path, f) for u, f in zip(alive, files)]
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
