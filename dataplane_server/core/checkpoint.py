"""Checkpoint directories: layout, manifest and checksums (no Ray here).

A checkpoint is one directory holding a cut of the store at one position:

- per unit ``u``, ``unit-<u>.index`` and the data segments it uses, written by the
  unit itself (``core/unit/checkpoint.py``: a segment a parent checkpoint wrote is
  hard-linked, not copied);
- ``state.msgpack``: what only the controller knows (declarations,
  consumption and leases by sample id), as of the cut;
- ``manifest.json``: format version, the checkpoint's id, the cut's position and
  time, its parent, and every file with its size and checksum (``core/file_digest.py``:
  "crc32c:<hex>"; format 2 named a bare SHA-256, read as such).

Everything is written into ``<dir>.tmp-<random>`` and renamed to ``<dir>`` only
once the manifest is complete and synced, so a crash mid-save leaves no
directory of the final name, and a directory without a valid manifest never
loads. A checkpoint of format 1 (one ``unit-<u>.bin`` each, no cut) is refused
with a typed error naming its format; format 2 (SHA-256 checksums) loads.
"""

from __future__ import annotations

import errno
import json
import os

import msgpack

from dataplane_client.wire import atomic_dir
from dataplane_client.wire.errors import CheckpointError, CorruptPayload, InvalidBatch
from dataplane_server.core import file_digest
from dataplane_server.core.recovery_messages import DumpedFile, DumpedUnit

FORMAT = 3
READS = (2, FORMAT)  # 2: the same files, each checked with a bare SHA-256
MANIFEST = "manifest.json"
STATE = "state.msgpack"


def start(directory: str) -> str:
    """A fresh temporary directory beside ``directory``, made before any unit writes.

    ``InvalidBatch`` when ``directory`` exists; ``CheckpointError`` naming the path and
    the operating system's reason when it cannot be a checkpoint (a dangling symbolic
    link, a path under a regular file or in /proc, no permission). Nothing is left behind.
    """
    path = os.path.abspath(directory)
    if os.path.islink(path) and not os.path.exists(path):
        # Not "exists" to os.path.exists, but the final rename could never replace it.
        raise CheckpointError(
            f"cannot save a checkpoint to {path}: {os.strerror(errno.EEXIST)} (a dangling "
            f"symbolic link to {os.readlink(path)!r}); choose a new path"
        )
    missing = []  # the parents makedirs will create, deepest first
    above = os.path.dirname(path)
    while not os.path.lexists(above):
        missing.append(above)
        above = os.path.dirname(above)
    try:
        return atomic_dir.start(path, InvalidBatch)
    except OSError as e:
        for made in missing:  # what makedirs made before it failed
            try:
                os.rmdir(made)
            except OSError:
                pass  # never made, or not empty: not ours to remove
        raise save_failed(path, e) from None


def save_failed(directory: str, e: OSError) -> CheckpointError:
    """The typed error for an ``OSError`` met saving to ``directory``."""
    why = f"{e.strerror}: {e.filename}" if e.strerror and e.filename else (e.strerror or str(e))
    above = os.path.dirname(directory)
    while not os.path.lexists(above):
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        why += f" ({above} is not a directory)"
    return CheckpointError(f"cannot save a checkpoint to {directory}: {why}")


def finish(tmp: str, directory: str, units: list[DumpedUnit], state: dict, about: dict) -> None:
    """Write state and manifest into ``tmp`` and sync them (each unit synced its own files),
    then rename it to ``directory``.

    ``about``: the checkpoint's id, position, time and parent, kept in the manifest."""
    data = msgpack.packb(state, use_bin_type=True)
    atomic_dir.write_synced(os.path.join(tmp, STATE), data)
    manifest = {
        "format": FORMAT,
        **about,
        "units": [
            {
                "unit": d.unit,
                "samples": d.samples,
                "files": [
                    {"name": f.name, "nbytes": f.nbytes, "digest": f.digest} for f in d.files
                ],
            }
            for d in units
        ],
        "state": {"name": STATE, "nbytes": len(data), "digest": file_digest.of(data)},
    }
    atomic_dir.write_synced(os.path.join(tmp, MANIFEST), json.dumps(manifest, indent=1).encode())
    atomic_dir.rename_into_place(tmp, directory)


abandon = atomic_dir.abandon


def manifest(directory: str) -> dict:
    """A checkpoint's manifest, of this format (``InvalidBatch`` naming another format)."""
    directory = os.path.abspath(directory)
    try:
        with open(os.path.join(directory, MANIFEST)) as f:
            got = json.load(f)
    except (OSError, ValueError) as e:
        raise CorruptPayload(f"{directory} holds no readable checkpoint manifest ({e})") from None
    if got.get("format") == 1:
        raise InvalidBatch(
            f"{directory} is a checkpoint of format 1, which this version does not read (it "
            f"reads formats {READS}); restore it with the version that saved it and save again"
        )
    if got.get("format") not in READS:
        raise CorruptPayload(f"{directory}: checkpoint format {got.get('format')!r} unknown")
    return got


def _digest(entry: dict) -> str:
    """A manifest entry's checksum (format 2 kept a bare SHA-256)."""
    if "digest" in entry:
        return entry["digest"]
    return file_digest.legacy(entry["sha256"])


def unit_files(got: dict) -> dict[int, list[DumpedFile]]:
    """Per unit of a manifest, its files (its index first)."""
    return {
        u["unit"]: [DumpedFile(u["unit"], f["name"], f["nbytes"], _digest(f)) for f in u["files"]]
        for u in got["units"]
    }


def read(directory: str) -> tuple[list[DumpedFile], dict]:
    """Every file of a checkpoint (checked by each unit as it loads) and the verified state."""
    directory = os.path.abspath(directory)
    got = manifest(directory)
    st = got["state"]
    try:
        with open(os.path.join(directory, st["name"]), "rb") as f:
            data = f.read()
    except OSError as e:
        raise CorruptPayload(f"{directory}: cannot read the checkpoint state ({e})") from None
    if len(data) != st["nbytes"] or not file_digest.matches(_digest(st), data):
        raise CorruptPayload(f"{directory}: the checkpoint state does not match its manifest")
    files = [f for fs in unit_files(got).values() for f in fs]
    return files, msgpack.unpackb(data, raw=False)
