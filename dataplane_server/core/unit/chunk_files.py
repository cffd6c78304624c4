"""A durable unit's chunks: named files in one directory, which outlive its process.

A unit at durability ``process`` keeps them on a RAM-backed file system (/dev/shm),
at ``machine`` on a disk. Each chunk is one file, named like a memfd (unique: a
process token and a serial), so a reader's kept mapping found by name is always
that file's. The unit's row index (unit/row_log.py) names a block until the record
that frees it is appended, and a restarted unit must find exactly the bytes the index
says. So a freed chunk's file may serve a later write (recycled, as a memfd is: its
pages and writers' mappings warm) only where an appended record is as durable as the
bytes written after it: at ``process`` level, where both sit in the same RAM and
survive the same deaths. At ``machine`` level a record may still be on its way to the
disk when new bytes reach it, so a freed file is removed at once, never reused. Files no index names (stages nobody committed, the warm reserve's
chunks) are removed when the unit restarts.
"""

from __future__ import annotations

import os

from dataplane_client.wire import shm


class ChunkFiles:
    def __init__(self, directory: str, prefault: bool, recycle: bool):
        os.makedirs(directory, exist_ok=True)
        # Readers check the path their descriptor resolves to: no symlink in it.
        self.directory = os.path.realpath(directory)
        self.prefault = prefault  # RAM: fault pages in ahead; disk: fallocate, no zeroing
        # Whether a freed chunk may serve a later write (see the module docstring).
        self.recycle = recycle

    def make(self, nbytes: int) -> shm.MemFd:
        return shm.create(nbytes, self.directory, self.prefault)

    def open(self, name: str) -> shm.MemFd | None:
        """A chunk an earlier process of this unit made; None when its file is gone."""
        try:
            return shm.open_file(os.path.join(self.directory, name))
        except FileNotFoundError:
            return None

    def remove(self, chunk: shm.MemFd) -> None:
        """Close the chunk and remove its file (a reader's mapping keeps its pages)."""
        chunk.close()
        if chunk.path is not None:
            try:
                os.unlink(chunk.path)
            except FileNotFoundError:
                pass

    def remove_others(self, keep: set[str]) -> int:
        """Remove every chunk file but ``keep``; the number removed."""
        gone = 0
        for name in os.listdir(self.directory):
            if name not in keep and name.startswith("dataplane-"):
                os.unlink(os.path.join(self.directory, name))
                gone += 1
        return gone

    def sync(self, chunk: shm.MemFd) -> None:
        """Flush a chunk's bytes to its disk (writers' mappings included)."""
        os.fdatasync(chunk.fd)
