"""A durable unit's chunks: named files in one directory, which outlive its process.

A unit at durability ``process`` keeps them on a RAM-backed file system (/dev/shm),
at ``machine`` on a disk. Each chunk is one file, named like a memfd (unique: a
process token and a serial), so a reader's kept mapping found by name is always
that file's. A freed chunk's file is removed at once and never reused for other
bytes: the unit's row index (unit/row_log.py) may still name a block up to the
moment its removal is logged, and a restarted unit must find exactly the bytes the
index says. Files no index names (stages nobody committed, the warm reserve's
chunks) are removed when the unit restarts.
"""

from __future__ import annotations

import os

from dataplane_client.wire import shm


class ChunkFiles:
    def __init__(self, directory: str, prefault: bool):
        os.makedirs(directory, exist_ok=True)
        # Readers check the path their descriptor resolves to: no symlink in it.
        self.directory = os.path.realpath(directory)
        self.prefault = prefault  # RAM: fault pages in ahead; disk: fallocate, no zeroing

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
