"""StorageUnit: a Ray actor that holds the bytes, in columnar jagged arenas.

Layout, per partition:

- ``slot_of``: sample_id -> slot (a unit-local row number);
- per field one :class:`_Column`: for every slot, which chunk holds its bytes,
  at what offset, how many bytes (and, jagged, its first-dim length);
- chunks: one flat ``uint8`` buffer per (write, field). A write of K samples is
  one copy into one chunk; a read of K samples is a handful of range copies
  (adjacent rows are merged), never K x fields small messages.

Writes are two-phase: ``stage`` copies bytes in under a write id (invisible),
the controller's commit calls ``publish`` to make them the slots' bytes, or the
client calls ``discard``. A chunk is freed when no slot points at it any more,
so clearing returns its memory.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from dataclasses import dataclass, field

import msgpack
import numpy as np
import ray
import torch

from dataplane_client import shm
from dataplane_client.codec import DENSE, DTYPES, JAGGED, OBJECT, EncodedField, gather_bytes
from dataplane_client.errors import (
    CapacityExceeded,
    FieldNotProduced,
    SamplesNotFound,
    SchemaConflict,
)
from dataplane_server.columns import counts_errors, grown
from dataplane_server.stats import Stats
from dataplane_server.warm_reserve import WarmReserve

STAGE_TTL_S = 600.0  # staged bytes of a writer that never committed are dropped after this


@dataclass
class _Column:
    schema: tuple
    chunk: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    offset: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    nbytes: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    length: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def ensure(self, n: int) -> None:
        self.chunk = grown(self.chunk, n, -1)
        self.offset = grown(self.offset, n, 0)
        self.nbytes = grown(self.nbytes, n, 0)
        self.length = grown(self.length, n, 0)


@dataclass
class _Chunk:
    buffer: np.ndarray
    live_rows: int
    fd: int = -1  # memfd holding the buffer (-1: private heap memory)


@dataclass
class _Partition:
    slot_of: dict = field(default_factory=dict)
    free_slots: list = field(default_factory=list)
    next_slot: int = 0
    columns: dict = field(default_factory=dict)


@dataclass
class _Staged:
    partition_id: str
    sample_ids: list
    fields: dict  # name -> (schema, chunk_id, row offsets, row nbytes, row lengths | None)
    nbytes: int
    created: float


@ray.remote
class StorageUnit:
    def __init__(
        self,
        index: int,
        capacity_bytes: int,
        put_wait_timeout_s: float = 0.0,
        use_shm: bool = True,
        warm_reserve_bytes: int = 0,
    ):
        self.index = index
        self.use_shm = bool(use_shm) and shm.supported()
        self.reserve = WarmReserve(warm_reserve_bytes if self.use_shm else 0)
        self.capacity_bytes = int(capacity_bytes)
        self.put_wait_timeout_s = float(put_wait_timeout_s)
        self.partitions: dict[str, _Partition] = {}
        self.chunks: dict[int, _Chunk] = {}
        self.staged: dict[str, _Staged] = {}
        self.next_chunk = 0
        self.used_bytes = 0
        self.stats = Stats()
        self._space = asyncio.Condition()
        self.node_id = ray.get_runtime_context().get_node_id()
        # The address Ray registered for this node (127.0.0.1 on loopback clusters),
        # not the machine's default-route guess.
        self.node_ip = next(
            (n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == self.node_id),
            ray.util.get_node_ip_address(),
        )

    # ---- identity / health ------------------------------------------------------
    def ping(self) -> dict:
        return {
            "index": self.index,
            "node_id": self.node_id,
            "node_ip": self.node_ip,
            "pid": os.getpid(),
            "shm": self.use_shm,
        }

    # ---- write path ---------------------------------------------------------------
    async def stage(
        self,
        partition_id: str,
        write_id: str,
        sample_ids: list[str],
        encoded: dict[str, EncodedField],
    ) -> int:
        """Copy a write's bytes in (through Ray), invisible until publish. Returns bytes staged."""
        chunks = await self._stage(partition_id, write_id, sample_ids, encoded, header_only=False)
        for name, enc in encoded.items():
            if name in chunks:
                self.chunks[chunks[name]].buffer[:] = enc.values  # out of the object store
        return self.staged[write_id].nbytes

    async def alloc_shm(
        self,
        partition_id: str,
        write_id: str,
        sample_ids: list[str],
        headers: dict[str, EncodedField],
    ) -> dict[str, str]:
        """Stage a same-node write whose bytes the client copies into shared memory itself.

        Returns, per bulk field, the path the client opens to write the chunk.
        The write stays invisible until the controller's commit publishes it,
        which the client only asks for after its copy is complete.
        """
        chunks = await self._stage(partition_id, write_id, sample_ids, headers, header_only=True)
        return {name: shm.path_of(self.chunks[c].fd) for name, c in chunks.items()}

    @counts_errors
    async def _stage(
        self, partition_id, write_id, sample_ids, encoded, *, header_only
    ) -> dict[str, int]:
        t0 = time.perf_counter()
        for name, enc in encoded.items():
            enc.validate(name, header_only=header_only)
            if enc.num_rows != len(sample_ids):
                raise SchemaConflict(
                    f"{enc.num_rows} rows for {len(sample_ids)} ids", fields=[name]
                )
        self._check_schema(partition_id, encoded)
        # Object fields are small Python values kept beside the arenas; capacity
        # counts the bulk bytes.
        need = sum(enc.nbytes for enc in encoded.values())
        await self._reserve(need, sample_ids)
        fields, chunks = {}, {}
        for name, enc in encoded.items():
            chunk_id = chunks[name] = self._new_chunk(enc.nbytes, touched_here=not header_only)
            nbytes = enc.row_nbytes()
            offs = np.zeros(len(nbytes), dtype=np.int64)
            if len(nbytes) > 1:
                np.cumsum(nbytes[:-1], out=offs[1:])
            lengths = enc.lengths if enc.kind != DENSE else None
            fields[name] = (enc.schema, chunk_id, offs, nbytes, lengths)
        self.staged[write_id] = _Staged(partition_id, list(sample_ids), fields, need, time.time())
        self.stats.inc("put_bytes_total", need)
        self.stats.inc("put_requests_total")
        self.stats.observe("put_latency_seconds", time.perf_counter() - t0)
        self._expire_stale_stages()
        return chunks

    def _new_chunk(self, nbytes: int, touched_here: bool) -> int:
        """An arena chunk: shared memory (memfd) when the platform has it, else private heap.

        ``touched_here``: this process copies the bytes in (the Ray path), so its own
        mapping is pre-faulted; on the same-node path only the client writes.
        """
        chunk_id = self.next_chunk
        self.next_chunk += 1
        if self.use_shm:
            warm = self.reserve.take(nbytes)
            fd, buf = warm or shm.create(
                nbytes, f"dataplane-u{self.index}-c{chunk_id}", map_populated=touched_here
            )
            self.chunks[chunk_id] = _Chunk(buf[:nbytes], 0, fd)
        else:
            self.chunks[chunk_id] = _Chunk(np.empty(nbytes, dtype=np.uint8), 0)
        return chunk_id

    def _check_schema(self, partition_id: str, encoded: dict[str, EncodedField]) -> None:
        part = self.partitions.get(partition_id)
        if part is None:
            return
        for name, enc in encoded.items():
            col = part.columns.get(name)
            if col is not None and col.schema != enc.schema:
                raise SchemaConflict(
                    f"field stored as {col.schema}, this write has {enc.schema}",
                    fields=[name],
                    partition_id=partition_id,
                )

    async def _reserve(self, need: int, sample_ids: list[str]) -> None:
        if self.used_bytes + need <= self.capacity_bytes:
            self.used_bytes += need
            return
        if need > self.capacity_bytes or self.put_wait_timeout_s <= 0:
            raise CapacityExceeded(
                f"unit {self.index}: write of {need} bytes does not fit "
                f"({self.used_bytes} of {self.capacity_bytes} used)",
                ids=sample_ids,
            )
        self.stats.inc("put_waits_total")  # observable: a put is waiting for room
        async with self._space:
            try:
                await asyncio.wait_for(
                    self._space.wait_for(lambda: self.used_bytes + need <= self.capacity_bytes),
                    timeout=self.put_wait_timeout_s,
                )
            except asyncio.TimeoutError:
                raise CapacityExceeded(
                    f"unit {self.index}: no room for {need} bytes after waiting "
                    f"{self.put_wait_timeout_s}s ({self.used_bytes} of {self.capacity_bytes} used)",
                    ids=sample_ids,
                ) from None
            self.used_bytes += need

    def publish(self, write_id: str) -> None:
        """Make a staged write the bytes of its slots (called by the controller's commit)."""
        st = self.staged.pop(write_id, None)
        if st is None:
            raise SamplesNotFound(f"unit {self.index}: no staged write {write_id}")
        part = self.partitions.setdefault(st.partition_id, _Partition())
        slots = self._slots_for(part, st.sample_ids)
        freed = []
        for name, (schema, chunk_id, offs, nbytes, lengths) in st.fields.items():
            col = part.columns.get(name)
            if col is None:
                col = part.columns[name] = _Column(schema)
            col.ensure(part.next_slot)
            freed.extend(self._release(col.chunk[slots]))
            col.chunk[slots] = chunk_id
            col.offset[slots] = offs
            col.nbytes[slots] = nbytes
            if lengths is not None:
                col.length[slots] = lengths
            self.chunks[chunk_id].live_rows += len(slots)
        self._free_chunks(freed)

    def discard(self, write_id: str) -> None:
        st = self.staged.pop(write_id, None)
        if st is not None:
            self._drop_staged(st)

    def _drop_staged(self, st: _Staged) -> None:
        self._free_chunks([chunk_id for (_, chunk_id, *_rest) in st.fields.values()])

    def _expire_stale_stages(self) -> None:
        cutoff = time.time() - STAGE_TTL_S
        for wid in [w for w, st in self.staged.items() if st.created < cutoff]:
            self._drop_staged(self.staged.pop(wid))

    def _slots_for(self, part: _Partition, sample_ids: list[str]) -> np.ndarray:
        slots = np.empty(len(sample_ids), dtype=np.int64)
        for i, sid in enumerate(sample_ids):
            s = part.slot_of.get(sid)
            if s is None:
                s = part.free_slots.pop() if part.free_slots else part.next_slot
                if s == part.next_slot:
                    part.next_slot += 1
                part.slot_of[sid] = s
            slots[i] = s
        return slots

    def _release(self, chunk_ids: np.ndarray) -> list[int]:
        """Drop one row reference from each chunk id (>= 0); return chunks now unreferenced."""
        ids, counts = np.unique(chunk_ids[chunk_ids >= 0], return_counts=True)
        dead = []
        for c, n in zip(ids.tolist(), counts.tolist()):
            ch = self.chunks[c]
            ch.live_rows -= n
            if ch.live_rows <= 0:
                dead.append(c)
        return dead

    def _free_chunks(self, chunk_ids: list[int]) -> None:
        for c in chunk_ids:
            ch = self.chunks.pop(c, None)
            if ch is not None:
                self.used_bytes -= ch.buffer.nbytes
                if ch.fd >= 0:
                    # Readers that mapped the chunk keep their bytes; the memory goes
                    # back to the kernel when the last mapping does.
                    os.close(ch.fd)
        if chunk_ids:
            asyncio.get_event_loop().create_task(self._notify_space())

    async def _notify_space(self) -> None:
        async with self._space:
            self._space.notify_all()

    # ---- read path ----------------------------------------------------------------
    def _rows(self, partition_id: str, sample_ids: list[str], fields: list[str]):
        """Per field: object values, or (header, chunk ids, which chunk per row, byte starts, ends)."""
        part = self.partitions.get(partition_id)
        slot_of = part.slot_of if part else {}
        missing = [s for s in sample_ids if s not in slot_of]
        if missing:
            raise SamplesNotFound(
                f"unit {self.index} holds no bytes for these samples",
                ids=missing,
                partition_id=partition_id,
            )
        slots = np.fromiter((slot_of[s] for s in sample_ids), dtype=np.int64, count=len(sample_ids))
        for name in fields:
            col = part.columns.get(name)
            present = col.chunk[slots] if col is not None and len(col.chunk) else None
            if present is None or (present == -1).any():
                bad = (
                    sample_ids
                    if present is None
                    else [sample_ids[i] for i in np.nonzero(present == -1)[0]]
                )
                raise FieldNotProduced(
                    "field has no bytes for these samples",
                    ids=bad,
                    fields=[name],
                    partition_id=partition_id,
                )
            kind, dtype, shape = col.schema
            header = EncodedField(
                kind=kind,
                dtype=dtype,
                shape=tuple(shape),
                num_rows=len(slots),
                lengths=col.length[slots].copy() if kind != DENSE else None,
            )
            starts = col.offset[slots]
            uniq, which = np.unique(col.chunk[slots], return_inverse=True)
            yield name, (header, uniq.tolist(), which, starts, starts + col.nbytes[slots])

    def read(
        self, partition_id: str, sample_ids: list[str], fields: list[str]
    ) -> dict[str, EncodedField]:
        """The fields' bytes, gathered here and shipped through Ray (cross-node reads)."""
        t0 = time.perf_counter()
        out: dict[str, EncodedField] = {}
        for name, rows in self._rows(partition_id, sample_ids, fields):
            if isinstance(rows, tuple):
                header, chunk_ids, which, starts, ends = rows
                buffers = [self.chunks[c].buffer for c in chunk_ids]
                rows = dataclasses.replace(
                    header, values=gather_bytes(buffers, which, starts, ends)
                )
            out[name] = rows
        self._count_read(out, t0)
        return out

    def read_shm(self, partition_id: str, sample_ids: list[str], fields: list[str]) -> dict:
        """Where the fields' bytes sit in shared memory, for a reader on this node to map."""
        t0 = time.perf_counter()
        out: dict = {}
        for name, rows in self._rows(partition_id, sample_ids, fields):
            if isinstance(rows, tuple):
                header, chunk_ids, which, starts, ends = rows
                paths = [shm.path_of(self.chunks[c].fd) for c in chunk_ids]
                rows = shm.SharedRows(header, paths, which, starts, ends)
            out[name] = rows
        self._count_read(out, t0)
        return out

    def _count_read(self, out: dict, t0: float) -> None:
        self.stats.inc("get_bytes_total", sum(v.nbytes for v in out.values()))
        self.stats.inc("get_requests_total")
        self.stats.observe("get_latency_seconds", time.perf_counter() - t0)

    # ---- clearing -----------------------------------------------------------------
    def clear(self, partition_id: str, sample_ids: list[str] | None) -> int:
        """Forget samples (None = the whole partition); returns bytes freed."""
        before = self.used_bytes
        part = self.partitions.get(partition_id)
        if part is None:
            return 0
        if sample_ids is None:
            del self.partitions[partition_id]
            freed: list[int] = []
            for col in part.columns.values():
                freed.extend(self._release(col.chunk[: part.next_slot]))
            self._free_chunks(freed)
        else:
            slots = np.array(
                [part.slot_of.pop(s) for s in sample_ids if s in part.slot_of], dtype=np.int64
            )
            freed = []
            for col in part.columns.values():
                col.ensure(part.next_slot)
                freed.extend(self._release(col.chunk[slots]))
                col.chunk[slots] = -1
            part.free_slots.extend(slots.tolist())
            self._free_chunks(freed)
        return before - self.used_bytes

    # ---- inspection ---------------------------------------------------------------
    def preview(
        self, partition_id: str, sample_id: str, fields: list[str] | None, max_elems: int
    ) -> dict:
        part = self.partitions.get(partition_id)
        if part is None or sample_id not in part.slot_of:
            raise SamplesNotFound(
                "no bytes for this sample", ids=[sample_id], partition_id=partition_id
            )
        slot = part.slot_of[sample_id]
        out = {}
        for name in fields or sorted(part.columns):
            col = part.columns.get(name)
            if col is None or slot >= len(col.chunk) or col.chunk[slot] == -1:
                continue
            kind, dtype, shape = col.schema
            buf = self.chunks[int(col.chunk[slot])].buffer
            start = int(col.offset[slot])
            raw = buf[start : start + int(col.nbytes[slot])]
            if kind == OBJECT:
                v = msgpack.unpackb(raw.tobytes(), raw=False)
                shown = v if isinstance(v, (int, float, str, bool)) else repr(v)
                out[name] = {
                    "dtype": "object",
                    "layout": kind,
                    "shape": [],
                    "values": [shown][:max_elems],
                }
                continue
            t = torch.from_numpy(raw.copy()).view(DTYPES[dtype])
            rows = int(col.length[slot]) if kind == JAGGED else None
            row_shape = ([rows] if rows is not None else []) + list(shape)
            out[name] = {
                "dtype": dtype,
                "layout": kind,
                "shape": row_shape,
                "values": t.reshape(-1)[:max_elems].float().tolist()
                if t.dtype.is_floating_point
                else t.reshape(-1)[:max_elems].tolist(),
            }
        return out

    def partition_bytes(self) -> dict[str, int]:
        """Live bytes held per partition (chunks counted by their referenced rows)."""
        out = {}
        for pid, part in self.partitions.items():
            total = 0
            for col in part.columns.values():
                live = col.chunk[: part.next_slot] >= 0
                total += int(col.nbytes[: part.next_slot][live].sum())
            out[pid] = total
        return out

    def metrics_snapshot(self) -> dict:
        return {
            "index": self.index,
            "node_id": self.node_id,
            "node_ip": self.node_ip,
            "bytes": self.used_bytes,
            "samples": sum(len(p.slot_of) for p in self.partitions.values()),
            "capacity_bytes": self.capacity_bytes,
            "warm_reserve_bytes": self.reserve.held_bytes,
            "partition_bytes": self.partition_bytes(),
            "stats": self.stats.snapshot(),
        }
