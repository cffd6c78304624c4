"""Checkpoint directories: layout, manifest and checksums (no Ray here).

A checkpoint is one directory:

- ``unit-<i>.bin``: every sample unit ``i`` held (ids, commit order, lengths,
  tags, and the bytes of every field), written by the unit itself;
- ``state.msgpack``: what only the controller knows (declarations,
  consumption and leases by sample id);
- ``manifest.json``: format version, the files with their sizes and SHA-256.

Everything is written into ``<dir>.tmp-<random>`` and renamed to ``<dir>`` only
once the manifest is complete and synced, so a crash mid-save leaves no
directory of the final name, and a directory without a valid manifest never
loads.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os

import msgpack

from dataplane_client.wire import atomic_dir
from dataplane_client.wire.errors import CheckpointError, CorruptPayload, InvalidBatch
from dataplane_server.core.recovery_messages import DumpedFile

FORMAT = 1
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


def finish(tmp: str, directory: str, files: list[DumpedFile], state: dict) -> None:
    """Write state and manifest into ``tmp``, sync everything, rename it to ``directory``."""
    data = msgpack.packb(state, use_bin_type=True)
    with open(os.path.join(tmp, STATE), "wb") as f:
        f.write(data)
    manifest = {
        "format": FORMAT,
        "units": [
            {"unit": d.unit, "name": d.name, "nbytes": d.nbytes, "sha256": d.sha256} for d in files
        ],
        "state": {"name": STATE, "nbytes": len(data), "sha256": hashlib.sha256(data).hexdigest()},
    }
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    atomic_dir.publish(tmp, directory)


abandon = atomic_dir.abandon


def read(directory: str) -> tuple[list[DumpedFile], dict]:
    """The unit files (checked by each unit as it loads) and the verified state."""
    directory = os.path.abspath(directory)
    try:
        with open(os.path.join(directory, MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise CorruptPayload(f"{directory} holds no readable checkpoint manifest ({e})") from None
    if manifest.get("format") != FORMAT:
        raise CorruptPayload(f"{directory}: checkpoint format {manifest.get('format')!r} unknown")
    st = manifest["state"]
    try:
        with open(os.path.join(directory, st["name"]), "rb") as f:
            data = f.read()
    except OSError as e:
        raise CorruptPayload(f"{directory}: cannot read the checkpoint state ({e})") from None
    if len(data) != st["nbytes"] or hashlib.sha256(data).hexdigest() != st["sha256"]:
        raise CorruptPayload(f"{directory}: the checkpoint state does not match its manifest")
    files = [DumpedFile(u["unit"], u["name"], u["nbytes"], u["sha256"]) for u in manifest["units"]]
    return files, msgpack.unpackb(data, raw=False)
