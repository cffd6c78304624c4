"""A storage unit's memory: blocks, and the regions writes are given inside them.

A block is one shared-memory chunk (a memfd, one descriptor, no mapping) or,
where shared memory is unavailable, one heap buffer. Small regions share a
*slab* (a block of ``slab_bytes``); a region too large for a slab gets a block
of its own. So the number of blocks, and of descriptors, grows with the bytes
held, never with the number of writes.

Space inside a block is handed out once, by bumping a pointer, and never handed
out again while the block lives: a reader that was told where a row lives may
map it a moment later, and copy-on-write mappings see later writes to pages they
have not touched, so published bytes must never change. A block is freed as a
whole when nothing points into it any more (rows and staged regions each hold a
reference). Its memfd is then recycled (kept warm for the next write of its
size, pages and writers' mappings intact) only when no reader lease names it and
no stage in it was reclaimed from a writer that may still be copying; otherwise
it is closed, and a reader's mapping keeps the old pages alive on its own. A
block made from a fresh memfd has a new name, which is what readers verify.

Writers keep their mappings of chunks (see wire/shm.py); ``closed_since`` tells them
which chunks were closed, so they drop mappings nothing will write into again.

Capacity counts what the unit holds: a slab counts in full from its creation.

A durable unit's chunks are named files (``files``, unit/chunk_files.py), recycled as
memfds are at ``process`` level and removed when freed at ``machine`` level (see there
why); a restarted unit re-attaches the blocks its row index names (``attach``), sealed: nothing new is placed in them, as a writer of the dead
process may still copy into a region it was given there.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from dataplane_client.wire import shm
from dataplane_client.wire.encoded import contiguous_runs
from dataplane_client.wire.messages import ChunkRef
from dataplane_server.core.unit.chunk_files import ChunkFiles
from dataplane_server.core.unit.warm_reserve import WarmReserve

SLAB_BYTES = 4 << 20
_SLABS_PER_CAPACITY = 16  # a tiny unit gets small slabs, so one slab never fills it
_CLOSED_REMEMBERED = 4096  # names of closed chunks kept for writers to drop their mappings


@dataclass
class _Block:
    store: shm.MemFd | np.ndarray
    size: int
    used: int = 0  # bump pointer: bytes [0, used) have been handed out
    refs: int = 0  # rows and staged regions pointing into the block
    readers: int = 0  # read leases naming it: a reader may map its pages copy-on-write
    tainted: bool = False  # a stage in it was reclaimed while its writer may still copy


class Arena:
    def __init__(
        self,
        capacity_bytes: int,
        use_shm: bool,
        reserve: WarmReserve,
        files: ChunkFiles | None = None,
    ):
        self.files = files  # a durable unit's: chunks are files that outlive the process
        self.slab_bytes = max(1, min(SLAB_BYTES, capacity_bytes // _SLABS_PER_CAPACITY))
        self.use_shm = use_shm
        self.reserve = reserve
        self.blocks: dict[int, _Block] = {}
        self.used_bytes = 0
        self._slab: int | None = None  # the slab small regions go into now
        self._next_id = 0
        self.recycled = 0  # blocks whose memfd went back to the reserve on freeing
        self._closed: deque[tuple[int, str]] = deque(maxlen=_CLOSED_REMEMBERED)
        # A durable unit's restarted process numbers closures above its dead one's (in
        # microseconds of the wall clock), so a writer's last seq never hides new ones.
        self._closed_seq = time.time_ns() // 1000 if files is not None else 0

    def is_small(self, nbytes: int) -> bool:
        """Whether a region of ``nbytes`` goes into a slab (else a block of its own)."""
        return nbytes <= self.slab_bytes // 4

    def chunk_bytes(self, block: int) -> int:
        """The memory behind a block (a reserve chunk may be a little larger than asked)."""
        store = self.blocks[block].store
        return store.size if isinstance(store, shm.MemFd) else store.nbytes

    def extra_bytes(self, sizes: list[int]) -> int:
        """How much ``alloc(sizes)`` would add to ``used_bytes``."""
        room = self._slab_room()
        extra = 0
        for n in sizes:
            if not self.is_small(n):
                extra += n
                continue
            if n > room:
                extra, room = extra + self.slab_bytes, self.slab_bytes
            room -= n
        return extra

    def _slab_room(self) -> int:
        if self._slab is None:
            return -1  # even an empty region needs a slab to point into
        slab = self.blocks[self._slab]
        return slab.size - slab.used

    def alloc(self, sizes: list[int]) -> list[tuple[int, int]]:
        """(block id, offset) of a new region per size, each holding one reference.

        All or nothing: an ``OSError`` (out of descriptors or memory) leaves no region.
        """
        regions: list[tuple[int, int]] = []
        try:
            for n in sizes:
                block = self._slab_for(n) if self.is_small(n) else self._new_block(n)
                b = self.blocks[block]
                regions.append((block, b.used))
                b.used += n
                b.refs += 1
        except OSError:
            self.release([block for block, _ in regions])
            raise
        return regions

    def alloc_warm(self, nbytes: int) -> tuple[int, int] | None:
        """A block of its own for a region too large for a slab, like ``alloc([nbytes])``,
        but only from a chunk the reserve has ready (None when it has none): nothing is
        made or zeroed here."""
        store = self.reserve.take(nbytes) if self.use_shm else None
        if store is None:
            return None
        block = self._add_block(store, nbytes)
        b = self.blocks[block]
        b.used, b.refs = nbytes, 1
        return block, 0

    def _slab_for(self, nbytes: int) -> int:
        slab = self._slab
        if slab is None or nbytes > self._slab_room():
            # The full slab lives on while rows point into it; it is freed with its last row.
            slab = self._slab = self._new_block(self.slab_bytes)
        return slab

    def _new_block(self, nbytes: int) -> int:
        store: shm.MemFd | np.ndarray
        if self.use_shm:
            store = self.reserve.take(nbytes) or self._make(nbytes)
        else:
            store = np.empty(nbytes, dtype=np.uint8)
        return self._add_block(store, nbytes)

    def _make(self, nbytes: int) -> shm.MemFd:
        return self.files.make(nbytes) if self.files is not None else shm.create(nbytes)

    def _add_block(self, store: shm.MemFd | np.ndarray, nbytes: int) -> int:
        block = self._next_id
        self._next_id += 1
        self.blocks[block] = _Block(store, nbytes)
        self.used_bytes += nbytes
        return block

    def attach(self, block: int, store: shm.MemFd, nbytes: int, refs: int) -> None:
        """Take back a block an earlier process of this durable unit made, full (sealed)."""
        self.blocks[block] = _Block(store, nbytes, used=nbytes, refs=refs)
        self.used_bytes += nbytes
        self._next_id = max(self._next_id, block + 1)

    def skip_ids(self, below: int) -> None:
        """Never hand out a block id below ``below`` (ids an earlier process used)."""
        self._next_id = max(self._next_id, below)

    def file_of(self, block: int) -> tuple[str, int]:
        """(chunk file name, block size) of a durable unit's block."""
        b = self.blocks[block]
        assert isinstance(b.store, shm.MemFd)
        return b.store.name, b.size

    def hold(self, block: int, count: int) -> None:
        self.blocks[block].refs += count

    def release(self, blocks) -> None:
        """Drop one reference per entry of ``blocks`` (ids >= 0); free what nothing holds."""
        ids, counts = np.unique(np.asarray(blocks, dtype=np.int64), return_counts=True)
        for block, n in zip(ids.tolist(), counts.tolist()):
            if block < 0:
                continue
            b = self.blocks[block]
            b.refs -= n
            if b.refs <= 0:
                if block == self._slab:
                    self._slab = None  # an empty unit holds no block at all
                self._free(block)

    def _free(self, block: int) -> None:
        b = self.blocks.pop(block)
        self.used_bytes -= b.size
        if not isinstance(b.store, shm.MemFd):
            return
        if self.files is not None and not self.files.recycle:  # machine level: never reused
            self.files.remove(b.store)
            closed = [b.store.name]
        elif b.readers == 0 and not b.tainted:
            closed = self.reserve.recycle(b.store)  # closes what it does not keep
            self.recycled += b.store.name not in closed
        else:
            # Readers that mapped the chunk keep their bytes; the memory goes back to
            # the kernel when the last mapping does.
            if self.files is not None:
                self.files.remove(b.store)
            else:
                b.store.close()
            closed = [b.store.name]
        for name in closed:
            self._closed_seq += 1
            self._closed.append((self._closed_seq, name))

    # ---- leases: who may still touch a block's pages ---------------------------------
    def lease(self, blocks) -> None:
        """A reader was told where rows of these blocks live (it may map them now)."""
        for block in blocks:
            self.blocks[block].readers += 1

    def unlease(self, blocks) -> None:
        """A reader's mappings of these blocks are gone (freed blocks are skipped)."""
        for block in blocks:
            b = self.blocks.get(block)
            if b is not None:
                b.readers -= 1

    def taint(self, blocks) -> None:
        """Never recycle these blocks: a writer whose stage was reclaimed may still copy."""
        for block in blocks:
            b = self.blocks.get(int(block))
            if b is not None:
                b.tainted = True

    def closed_since(self, seq: int) -> tuple[list[str], int, bool]:
        """(names of chunks closed after ``seq``, the latest seq, whether some were forgotten)."""
        oldest = self._closed[0][0] if self._closed else self._closed_seq + 1
        if seq + 1 < oldest:
            return [], self._closed_seq, True
        return [name for s, name in self._closed if s > seq], self._closed_seq, False

    def close(self) -> None:
        if self.files is not None:  # the files outlive the process: a restart re-attaches
            for b in self.blocks.values():
                if isinstance(b.store, shm.MemFd):
                    b.store.close()
            self.blocks.clear()
        for block in list(self.blocks):
            self._free(block)
        self._slab = None

    # ---- bytes in and out -----------------------------------------------------------
    def write(self, block: int, offset: int, data: np.ndarray) -> None:
        store = self.blocks[block].store
        if isinstance(store, shm.MemFd):
            store.write(offset, data)
        else:
            store[offset : offset + data.nbytes] = data.reshape(-1).view(np.uint8)

    def gather(
        self,
        blocks: list[int],
        which: np.ndarray,
        starts: np.ndarray,
        ends: np.ndarray,
        into: np.ndarray | None = None,
    ) -> np.ndarray:
        """Byte ranges [starts[i], ends[i]) of ``blocks[which[i]]``, back to back in one buffer:
        ``into`` where given (exactly their size: a copy loop reuses one buffer rather than
        fault in fresh pages every time), else a new one."""
        total = int((ends - starts).sum())
        if into is not None and len(into) != total:
            raise ValueError(f"gather of {total} bytes into a buffer of {len(into)}")
        out = np.empty(total, dtype=np.uint8) if into is None else into
        # Merge abutting ranges only inside one block: offset each block far from the others.
        key = which.astype(np.int64) << 48
        run_starts, run_ends = contiguous_runs(starts + key, ends + key)
        pos = 0
        for s, e in zip(run_starts.tolist(), run_ends.tolist()):
            lo, n = s & ((1 << 48) - 1), e - s
            store = self.blocks[blocks[s >> 48]].store
            if isinstance(store, shm.MemFd):
                store.read_into(lo, out[pos : pos + n])
            else:
                out[pos : pos + n] = store[lo : lo + n]
            pos += n
        return out

    def view(self, block: int, start: int, end: int) -> np.ndarray:
        """Bytes [start, end) of a block without copying (read-only; a shared-memory
        block is mapped, and the mapping outlives the block's freeing)."""
        store = self.blocks[block].store
        if isinstance(store, shm.MemFd):
            return shm.map_for_read(store.ref(), start, end)
        return store[start:end]

    def ref(self, block: int) -> ChunkRef:
        """How a same-node process opens the block (shared memory only)."""
        store = self.blocks[block].store
        assert isinstance(store, shm.MemFd), "heap blocks are never offered for mapping"
        return store.ref()
