"""StorageUnit: a Ray actor that holds the bytes, in columnar jagged arenas.

Layout, per partition:

- ``slot_of``: sample_id -> slot (a unit-local row number);
- per field one :class:`_Column`: for every slot, which block holds its bytes,
  at what offset, how many bytes (and, jagged, its first-dim length);
- the bytes: one region per (write, field) in the unit's :class:`Arena` (small
  regions share slabs). A write of K samples is one copy into one region; a read
  of K samples is a handful of range copies (adjacent rows are merged), never
  K x fields small messages.

Writes are two-phase: ``stage`` copies bytes in under a write id (invisible),
the controller's commit calls ``publish`` to make them the slots' bytes, or the
client calls ``discard``. A stage nobody commits is reclaimed after its
deadline, or as soon as its writer's process dies (see ``_sweep_stages``).
Blocks are freed when nothing points into them, so clearing returns memory.

A commit spanning several units is first ``prepare``d on each (the stage is
pinned: no deadline or writer death reclaims it), then published; a commit on
one unit publishes at once. Beside the bytes a unit keeps each sample's commit
order, length and tags, and remembers recently published write ids, so a
restarted controller rebuilds its key space from the units (``recovery_view``)
and a retried commit is a no-op.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
import os
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import msgpack
import numpy as np
import ray
import torch

from dataplane_client import shm
from dataplane_client.codec import DENSE, DTYPES, JAGGED, OBJECT, EncodedField
from dataplane_client.errors import (
    CapacityExceeded,
    CorruptPayload,
    FieldNotProduced,
    InvalidBatch,
    SamplesNotFound,
    SchemaConflict,
)
from dataplane_client.messages import (
    SharedRows,
    ShmAlloc,
    ShmRegion,
    UnitInfo,
    UnitSnapshot,
    WriteLease,
)
from dataplane_server.arena import Arena
from dataplane_server.columns import counts_errors, grown
from dataplane_server.recovery_messages import (
    DumpedFile,
    PinnedWrite,
    SampleMeta,
    StoredRows,
    UnitRecovery,
)
from dataplane_server.stats import Stats
from dataplane_server.warm_reserve import WarmReserve

_EXPIRED_REMEMBERED = 4096  # write ids of reclaimed stages kept to explain a late publish
_PUBLISHED_REMEMBERED = 65536  # write ids of published stages: a retried commit is a no-op
# A same-node read of a field this small gets its bytes in the answer: copying them costs
# less than the reader mapping the chunks and the lease messages that guard its mappings.
INLINE_READ_BYTES = 64 * 1024


@dataclass
class _Column:
    schema: tuple
    chunk: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # block id
    offset: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    nbytes: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    length: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def ensure(self, n: int) -> None:
        self.chunk = grown(self.chunk, n, -1)
        self.offset = grown(self.offset, n, 0)
        self.nbytes = grown(self.nbytes, n, 0)
        self.length = grown(self.length, n, 0)


@dataclass
class _Partition:
    slot_of: dict = field(default_factory=dict)
    free_slots: list = field(default_factory=list)
    next_slot: int = 0
    columns: dict = field(default_factory=dict)
    # Per slot, for a controller that rebuilds from the units: commit order, length, tags.
    seq: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    seq_len: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    tags: dict = field(default_factory=dict)  # slot -> tags

    def grow_meta(self) -> None:
        self.seq = grown(self.seq, self.next_slot, -1)
        self.seq_len = grown(self.seq_len, self.next_slot, -1)

    def remember(self, slots: np.ndarray, sample_ids: list[str], meta: SampleMeta) -> None:
        """Record what the key space knows of new slots (first commit wins, tags merge)."""
        self.grow_meta()
        self.seq[slots[self.seq[slots] < 0]] = meta.seq
        if meta.sequence_lengths:
            lengths = np.fromiter(
                map(meta.sequence_lengths.get, sample_ids, itertools.repeat(-1)),
                dtype=np.int64,
                count=len(sample_ids),
            )
            unset = (lengths >= 0) & (self.seq_len[slots] < 0)
            self.seq_len[slots[unset]] = lengths[unset]
        if meta.tags:
            for slot, sid in zip(slots.tolist(), sample_ids):
                tag = meta.tags.get(sid)
                if tag:
                    self.tags[slot] = {**self.tags.get(slot, {}), **tag}

    def forget_slots(self, slots: np.ndarray) -> None:
        self.grow_meta()
        self.seq[slots] = -1
        self.seq_len[slots] = -1
        for slot in slots.tolist():
            self.tags.pop(slot, None)


@dataclass
class _Staged:
    partition_id: str
    sample_ids: list
    fields: dict  # name -> (schema, block id, row offsets, row nbytes, row lengths | None)
    deadline: float  # time.monotonic() after which the stage is reclaimed
    owner: ray.ObjectRef | None  # owned by the writer's process: unresolvable once it died
    meta: SampleMeta | None = None  # set by prepare: the commit is under way, never reclaimed
    staged_units: list[int] = field(default_factory=list)  # every unit of the prepared commit

    def blocks(self) -> np.ndarray:
        return np.array([block for (_, block, *_rest) in self.fields.values()], dtype=np.int64)


@dataclass
class _WriteLease:
    """A region set aside for one writer's next same-node put (see ``WriteLease``)."""

    block: int
    offset: int
    nbytes: int
    deadline: float  # time.monotonic() after which it is reclaimed
    owner: ray.ObjectRef | None  # the writer's process: its death reclaims the lease


@ray.remote
class StorageUnit:
    def __init__(
        self,
        index: int,
        capacity_bytes: int,
        put_wait_timeout_s: float = 0.0,
        use_shm: bool = True,
        warm_reserve_bytes: int = 0,
        stage_ttl_s: float = 30.0,
    ):
        self.index = index
        self.use_shm = bool(use_shm) and shm.supported()
        self.reserve = WarmReserve(warm_reserve_bytes if self.use_shm else 0)
        self.capacity_bytes = int(capacity_bytes)
        self.arena = Arena(self.capacity_bytes, self.use_shm, self.reserve)
        self.put_wait_timeout_s = float(put_wait_timeout_s)
        self.stage_ttl_s = float(stage_ttl_s)
        self.partitions: dict[str, _Partition] = {}
        self.staged: dict[str, _Staged] = {}
        self.expired: OrderedDict[str, str] = OrderedDict()  # write id -> why it was reclaimed
        self.published: OrderedDict[str, None] = OrderedDict()
        self.stats = Stats()
        # Read leases: id -> (block ids a same-node reader was told to map, its owner ref).
        self.read_leases: dict[int, tuple[list[int], ray.ObjectRef | None]] = {}
        self.write_leases: dict[int, _WriteLease] = {}
        self._next_lease = 0
        self._space = asyncio.Condition()
        self._sweeper: asyncio.Task | None = None
        self.node_id = ray.get_runtime_context().get_node_id()
        # The address Ray registered for this node (127.0.0.1 on loopback clusters),
        # not the machine's default-route guess.
        self.node_ip = next(
            (n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == self.node_id),
            ray.util.get_node_ip_address(),
        )

    # ---- identity / health ------------------------------------------------------
    def ping(self) -> UnitInfo:
        return UnitInfo(self.index, self.node_id, self.node_ip, os.getpid(), self.use_shm)

    @property
    def used_bytes(self) -> int:
        return self.arena.used_bytes

    # ---- write path ---------------------------------------------------------------
    async def stage(
        self,
        partition_id: str,
        write_id: str,
        sample_ids: list[str],
        encoded: dict[str, EncodedField],
        owner: list | None = None,
    ) -> int:
        """Copy a write's bytes in (through Ray), invisible until publish. Returns bytes staged.

        ``owner``: ``[ObjectRef]`` owned by the writer's process (see ``_sweep_stages``).
        """
        regions = await self._stage(
            partition_id, write_id, sample_ids, encoded, owner, header_only=False
        )
        for name, enc in encoded.items():
            self.arena.write(*regions[name], enc.values)  # out of the object store
        return sum(enc.nbytes for enc in encoded.values())

    async def alloc_shm(
        self,
        partition_id: str,
        write_id: str,
        sample_ids: list[str],
        headers: dict[str, EncodedField],
        owner: list | None = None,
        closed_seq: int = -1,
    ) -> ShmAlloc:
        """Stage a same-node write whose bytes the client copies into shared memory itself.

        Returns, per field, the region the client copies its bytes into (through
        its mapping of the chunk, kept across writes), and the chunks closed since
        ``closed_seq`` (the client's last answer). The write stays invisible until
        the controller's commit publishes it, which the client only asks for after
        its copy is complete.
        """
        regions = await self._stage(
            partition_id, write_id, sample_ids, headers, owner, header_only=True
        )
        return self._answer(regions, headers, owner, closed_seq)

    async def stage_leased(
        self,
        partition_id: str,
        write_id: str,
        sample_ids: list[str],
        headers: dict[str, EncodedField],
        owner: list | None,
        lease: int,
        closed_seq: int = -1,
    ) -> ShmAlloc | None:
        """Stage a same-node write into the region of a ``WriteLease`` this writer holds.

        The writer sends this before copying into the region (the copy and this
        call overlap); the write is invisible until its commit, which the writer
        sends once both are done. None: the lease is gone (its deadline passed, or
        the unit needed the room), nothing was staged, and the writer stages anew.
        """
        held = self.write_leases.pop(lease, None)
        if held is None:
            return None
        try:
            regions = await self._stage(
                partition_id, write_id, sample_ids, headers, owner, header_only=True, lease=held
            )
        except BaseException:
            self.arena.taint([held.block])  # the writer is copying into it right now
            raise
        finally:
            self._release([np.array([held.block])])  # the lease's own reference
        return self._answer(regions, headers, owner, closed_seq)

    def _answer(
        self,
        regions: dict[str, tuple[int, int]],
        headers: dict[str, EncodedField],
        owner: list | None,
        closed_seq: int,
    ) -> ShmAlloc:
        """A same-node stage's answer: its regions, closed chunks, the writer's next lease."""
        closed, seq, reset = self.arena.closed_since(closed_seq)
        return ShmAlloc(
            regions={
                name: ShmRegion(self.arena.ref(block), offset, headers[name].nbytes)
                for name, (block, offset) in regions.items()
            },
            closed=closed,
            closed_seq=seq,
            reset=reset,
            chunk_prefix=shm.chunk_prefix(),
            next_lease=self._grant_lease(
                shm.layout([h.nbytes for h in headers.values()])[1], owner
            ),
        )

    def _grant_lease(self, nbytes: int, owner: list | None) -> WriteLease | None:
        """Set a region of ``nbytes`` aside for the writer's next put, from memory that is
        ready (never made and zeroed here, on the writer's critical path); None when
        there is none or no room."""
        box = owner[0] if owner else None
        if box is not None:  # one lease per writer: the one it held before is replaced
            held = [
                i
                for i, w in self.write_leases.items()
                if w.owner is not None and w.owner.hex() == box.hex()
            ]
            self._reclaim_write_leases(held, writer_alive=True)
        if nbytes <= 0 or self.used_bytes + self.arena.extra_bytes([nbytes]) > self.capacity_bytes:
            return None
        if self.arena.is_small(nbytes):
            return None  # only writes with a chunk of their own: a slab would stay held for it
        placed = self.arena.alloc_warm(nbytes)
        if placed is None:
            return None
        block, offset = placed
        lease = self._next_lease
        self._next_lease += 1
        deadline = time.monotonic() + self.stage_ttl_s
        self.write_leases[lease] = _WriteLease(block, offset, nbytes, deadline, box)
        self._start_sweeper()
        return WriteLease(lease, ShmRegion(self.arena.ref(block), offset, nbytes), self.stage_ttl_s)

    def _reclaim_write_leases(self, leases: list[int], writer_alive: bool) -> None:
        """Free leased regions; a writer that may still be copying into one taints its block."""
        for lease in leases:
            held = self.write_leases.pop(lease, None)
            if held is None:
                continue
            if writer_alive:
                self.arena.taint([held.block])
            self.stats.inc("write_leases_reclaimed_total")
            self._release([np.array([held.block])])

    @counts_errors
    async def _stage(
        self,
        partition_id,
        write_id,
        sample_ids,
        encoded,
        owner,
        *,
        header_only,
        lease: _WriteLease | None = None,
    ) -> dict[str, tuple[int, int]]:
        """Validate, wait for room, allocate one region for the write (or take ``lease``'s),
        its fields laid out in it back to back: {field: (block, offset)}."""
        t0 = time.perf_counter()
        for name, enc in encoded.items():
            enc.validate(name, header_only=header_only)
            if enc.num_rows != len(sample_ids):
                raise SchemaConflict(
                    f"{enc.num_rows} rows for {len(sample_ids)} ids", fields=[name]
                )
        self._check_schema(partition_id, encoded)
        names = list(encoded)
        sizes = [encoded[name].nbytes for name in names]
        offsets, total = shm.layout(sizes)
        if lease is not None:
            if total > lease.nbytes:
                raise InvalidBatch(
                    f"unit {self.index}: a write of {total} bytes does not fit its "
                    f"{lease.nbytes}-byte lease"
                )
            block, base = lease.block, lease.offset
        else:
            await self._wait_for_room([total], sample_ids)
            try:
                ((block, base),) = self.arena.alloc([total])
            except OSError as e:  # out of descriptors (EMFILE) or shared memory (ENOMEM, ENOSPC)
                raise CapacityExceeded(
                    f"unit {self.index}: cannot allocate {total} bytes of shared memory "
                    f"({e.strerror or e})",
                    ids=sample_ids,
                ) from None
        # One reference per field (what publish and discard count), none for the region.
        self.arena.hold(block, len(names))
        if lease is None:
            self.arena.release([block])
        placed = [(block, base + off) for off in offsets]
        fields = {}
        for name, (block, offset) in zip(names, placed):
            enc = encoded[name]
            nbytes = enc.row_nbytes()
            offs = np.full(len(nbytes), offset, dtype=np.int64)
            if len(nbytes) > 1:
                offs[1:] += np.cumsum(nbytes[:-1])
            lengths = enc.lengths if enc.kind != DENSE else None
            fields[name] = (enc.schema, block, offs, nbytes, lengths)
        deadline = time.monotonic() + self.stage_ttl_s
        box = owner[0] if owner else None
        self.discard(write_id)  # a retried stage under the same id replaces the first
        self.staged[write_id] = _Staged(partition_id, list(sample_ids), fields, deadline, box)
        self._start_sweeper()
        self.stats.inc("put_bytes_total", sum(sizes))
        self.stats.inc("put_requests_total")
        self.stats.observe("put_latency_seconds", time.perf_counter() - t0)
        return dict(zip(names, placed))

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

    async def _wait_for_room(self, sizes: list[int], sample_ids: list[str]) -> None:
        """Return once allocating ``sizes`` keeps the unit within capacity (or raise).

        The caller allocates right after, with no await in between, so the room
        found here is still there.
        """

        def fits() -> bool:
            return self.used_bytes + self.arena.extra_bytes(sizes) <= self.capacity_bytes

        if fits():
            return
        # Regions set aside for writers' next puts give way to a write that needs the room.
        self._reclaim_write_leases(list(self.write_leases), writer_alive=True)
        if fits():
            return
        need = sum(sizes)
        if need > self.capacity_bytes or self.put_wait_timeout_s <= 0:
            raise CapacityExceeded(
                f"unit {self.index}: write of {need} bytes does not fit "
                f"({self.used_bytes} of {self.capacity_bytes} used)",
                ids=sample_ids,
            )
        self.stats.inc("put_waits_total")  # observable: a put is waiting for room
        async with self._space:
            try:
                await asyncio.wait_for(self._space.wait_for(fits), self.put_wait_timeout_s)
            except asyncio.TimeoutError:
                raise CapacityExceeded(
                    f"unit {self.index}: no room for {need} bytes after waiting "
                    f"{self.put_wait_timeout_s}s ({self.used_bytes} of {self.capacity_bytes} used)",
                    ids=sample_ids,
                ) from None

    def _staged_or_raise(self, write_id: str) -> _Staged:
        st = self.staged.get(write_id)
        if st is None:
            why = self.expired.get(write_id, "it was never staged here, or was discarded")
            raise SamplesNotFound(
                f"unit {self.index}: no staged write {write_id} to publish ({why}); "
                "nothing of it became visible"
            )
        return st

    @counts_errors
    def prepare(self, write_id: str, meta: SampleMeta, staged_units: list[int]) -> None:
        """Pin a stage for a commit spanning several units: once every unit of the commit
        has it pinned, publishing cannot fail short of a unit's death."""
        if write_id in self.published:
            return
        st = self._staged_or_raise(write_id)
        st.meta = meta
        st.staged_units = list(staged_units)
        # A controller that dies now is rebuilt and rolls the write forward or back; if none
        # ever comes back, the stage still goes after a second deadline.
        st.deadline = time.monotonic() + self.stage_ttl_s

    @counts_errors
    def publish(self, write_id: str, meta: SampleMeta | None = None) -> bool:
        """Make a staged write the bytes of its slots (called by the controller's commit).

        Returns False when the write was published already (a retried commit).
        """
        if write_id in self.published:
            return False
        st = self._staged_or_raise(write_id)
        del self.staged[write_id]
        part = self.partitions.setdefault(st.partition_id, _Partition())
        slots = self._slots_for(part, st.sample_ids)
        part.remember(slots, st.sample_ids, meta or st.meta or SampleMeta(seq=0))
        replaced = []
        for name, (schema, block, offs, nbytes, lengths) in st.fields.items():
            col = part.columns.get(name)
            if col is None:
                col = part.columns[name] = _Column(schema)
            col.ensure(part.next_slot)
            replaced.append(col.chunk[slots].copy())
            col.chunk[slots] = block
            col.offset[slots] = offs
            col.nbytes[slots] = nbytes
            if lengths is not None:
                col.length[slots] = lengths
            self.arena.hold(block, len(slots))
        self._release([*replaced, st.blocks()])
        self.published[write_id] = None
        while len(self.published) > _PUBLISHED_REMEMBERED:
            self.published.popitem(last=False)
        return True

    def staged_write_ids(self) -> list[str]:
        """Writes staged and not yet published or reclaimed (for inspection and tests)."""
        return list(self.staged)

    # ---- what a (re)starting controller rebuilds from --------------------------------
    def recovery_view(self) -> UnitRecovery:
        """Every stored sample (ids, fields, lengths, tags, commit order) and pending commits."""
        return UnitRecovery(
            index=self.index,
            partitions={pid: self._stored_rows(part) for pid, part in self.partitions.items()},
            pinned={
                w: PinnedWrite(st.partition_id, st.staged_units)
                for w, st in self.staged.items()
                if st.meta is not None
            },
            published=list(self.published),
        )

    @staticmethod
    def _stored_rows(part: _Partition, skip: frozenset[str] = frozenset()) -> StoredRows:
        ids = [s for s in part.slot_of if s not in skip]
        slots = np.fromiter((part.slot_of[s] for s in ids), dtype=np.int64, count=len(ids))
        part.grow_meta()
        produced = {}
        for name, col in part.columns.items():
            col.ensure(part.next_slot)
            produced[name] = (col.chunk[slots] >= 0).tolist()
        return StoredRows(
            sample_ids=ids,
            seq=part.seq[slots].tolist(),
            sequence_lengths=part.seq_len[slots].tolist(),
            tags=[part.tags.get(s) for s in slots.tolist()],
            fields={name: col.schema for name, col in part.columns.items()},
            produced=produced,
        )

    # ---- checkpoints: this unit's samples to a file and back --------------------------
    def dump(self, directory: str, skip: dict[str, list[str]] | None = None) -> DumpedFile:
        """Write every stored sample (metadata and bytes) to one file in ``directory``.

        One record of rows per partition, then one record per field with the
        bytes of the rows that hold it, gathered a field at a time. ``skip``
        (partition -> ids) leaves out second copies, so a checkpoint holds each
        sample once.
        """
        name = f"unit-{self.index}.bin"
        digest, size = hashlib.sha256(), 0
        with open(os.path.join(directory, name), "wb") as f:

            def put(record: dict) -> None:
                nonlocal size
                try:
                    data = msgpack.packb(record, use_bin_type=True)
                except TypeError as e:
                    raise InvalidBatch(
                        f"partition {record['partition']!r} holds tags that cannot be saved ({e})"
                    ) from None
                digest.update(data)
                size += len(data)
                f.write(data)

            for pid, part in self.partitions.items():
                left_out = frozenset((skip or {}).get(pid, ()))
                rows = self._stored_rows(part, left_out)
                put(
                    {
                        "kind": "rows",
                        "partition": pid,
                        "ids": rows.sample_ids,
                        "seq": rows.seq,
                        "seq_len": rows.sequence_lengths,
                        "tags": rows.tags,
                    }
                )
                slots = np.fromiter(
                    (part.slot_of[s] for s in rows.sample_ids), dtype=np.int64, count=len(rows.seq)
                )
                for fname, col in part.columns.items():
                    have = np.nonzero(col.chunk[slots] >= 0)[0]
                    picked = slots[have]
                    starts = col.offset[picked]
                    uniq, which = np.unique(col.chunk[picked], return_inverse=True)
                    values = self.arena.gather(
                        uniq.tolist(), which, starts, starts + col.nbytes[picked]
                    )
                    put(
                        {
                            "kind": "field",
                            "partition": pid,
                            "field": fname,
                            "schema": list(col.schema[:2]) + [list(col.schema[2])],
                            "rows": have.tolist(),
                            "nbytes": col.nbytes[picked].tolist(),
                            "lengths": col.length[picked].tolist(),
                            "values": values.tobytes(),
                        }
                    )
        return DumpedFile(self.index, name, size, digest.hexdigest())

    def load(self, directory: str, dumped: DumpedFile) -> int:
        """Store the samples of a file ``dump`` wrote (checked against its digest first).

        The unit must hold none of its partitions. Returns the number of samples loaded.
        """
        path = os.path.join(directory, dumped.name)
        with open(path, "rb") as f:
            data = f.read()
        if len(data) != dumped.nbytes or hashlib.sha256(data).hexdigest() != dumped.sha256:
            raise CorruptPayload(f"checkpoint file {path} does not match its manifest")
        loaded = 0
        ids_of: dict[str, list[str]] = {}
        for rec in _records(data):
            pid = rec["partition"]
            if rec["kind"] == "rows":
                if pid in self.partitions:
                    raise InvalidBatch(
                        f"unit {self.index} already holds partition {pid!r}: restore into a "
                        "fresh service"
                    )
                part = self.partitions[pid] = _Partition()
                ids_of[pid] = rec["ids"]
                slots = self._slots_for(part, rec["ids"])
                part.grow_meta()
                part.seq[slots] = rec["seq"]
                part.seq_len[slots] = rec["seq_len"]
                part.tags.update((int(s), t) for s, t in zip(slots, rec["tags"]) if t)
                loaded += len(slots)
            else:
                self._load_field(self.partitions[pid], ids_of[pid], rec)
        return loaded

    def _load_field(self, part: _Partition, ids: list[str], rec: dict) -> None:
        kind, dtype, shape = rec["schema"]
        schema = (kind, dtype, tuple(shape))
        values = np.frombuffer(rec["values"], dtype=np.uint8)
        if self.used_bytes + self.arena.extra_bytes([len(values)]) > self.capacity_bytes:
            raise CapacityExceeded(
                f"unit {self.index}: the checkpoint's {len(values)} bytes of field "
                f"{rec['field']!r} do not fit ({self.used_bytes} of {self.capacity_bytes} used)"
            )
        ((block, offset),) = self.arena.alloc([len(values)])
        self.arena.write(block, offset, values)
        slots = np.fromiter(
            (part.slot_of[ids[i]] for i in rec["rows"]), dtype=np.int64, count=len(rec["rows"])
        )
        nbytes = np.asarray(rec["nbytes"], dtype=np.int64)
        col = part.columns[rec["field"]] = _Column(schema)
        col.ensure(part.next_slot)
        col.chunk[slots] = block
        col.offset[slots] = offset + np.cumsum(nbytes) - nbytes  # rows back to back
        col.nbytes[slots] = nbytes
        col.length[slots] = rec["lengths"]
        self.arena.hold(block, len(slots))
        self.arena.release([block])  # the allocation's own reference

    def discard(self, write_id: str) -> None:
        st = self.staged.pop(write_id, None)
        if st is not None:
            self._release([st.blocks()])

    def _slots_for(self, part: _Partition, sample_ids: list[str]) -> np.ndarray:
        """The slot of each id, new ids given freed slots first (last freed first), then
        fresh ones. Vectorised: Python touches a sample only in C-level dict calls."""
        slots = np.fromiter(
            map(part.slot_of.get, sample_ids, itertools.repeat(-1)),
            dtype=np.int64,
            count=len(sample_ids),
        )
        new = np.flatnonzero(slots < 0)
        if not len(new):
            return slots
        # First appearance order, as the one-by-one rule gives slots; an id twice in one
        # write gets one slot.
        new_ids = list(dict.fromkeys(sample_ids[i] for i in new.tolist()))
        reused = min(len(new_ids), len(part.free_slots))
        taken = part.free_slots[len(part.free_slots) - reused :][::-1]
        del part.free_slots[len(part.free_slots) - reused :]
        fresh = len(new_ids) - reused
        given = np.concatenate(
            [
                np.asarray(taken, dtype=np.int64),
                np.arange(part.next_slot, part.next_slot + fresh, dtype=np.int64),
            ]
        )
        part.next_slot += fresh
        part.slot_of.update(zip(new_ids, given.tolist()))
        if len(new_ids) == len(new):
            slots[new] = given
        else:
            slots[new] = [part.slot_of[sample_ids[i]] for i in new.tolist()]
        return slots

    def _release(self, block_refs: list[np.ndarray]) -> None:
        """Drop one reference per block id (-1 = none); wake writers waiting for room."""
        before = self.used_bytes
        self.arena.release(np.concatenate(block_refs) if block_refs else [])
        if self.used_bytes < before:
            asyncio.get_event_loop().create_task(self._notify_space())

    async def _notify_space(self) -> None:
        async with self._space:
            self._space.notify_all()

    # ---- reclaiming stages nobody will commit --------------------------------------
    def _start_sweeper(self) -> None:
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_stages())

    async def _sweep_stages(self) -> None:
        """Reclaim stages past their deadline, and those whose writer's process died.

        A writer passes an object it owns with each stage; resolving it raises
        ``OwnerDiedError`` once the owner is gone, so a killed writer's capacity
        comes back within a sweep or two instead of a whole deadline.
        """
        every_s = min(self.stage_ttl_s / 4, 1.0)
        while True:
            await asyncio.sleep(every_s)  # a periodic timer, not synchronisation
            try:
                await self._sweep_once(every_s)
            except Exception:  # noqa: BLE001 - a failed sweep must not end sweeping; it is counted
                self.stats.inc("stage_sweep_errors_total")

    async def _sweep_once(self, timeout_s: float) -> None:
        now = time.monotonic()
        for wid in [w for w, st in self.staged.items() if st.deadline <= now]:
            self._reclaim(wid, f"its {self.stage_ttl_s}s deadline passed before its commit")
        owned = [
            (w, st.owner)
            for w, st in self.staged.items()
            if st.owner is not None and st.meta is None  # a prepared commit is under way
        ]
        died = await asyncio.gather(*[self._owner_died(ref, timeout_s) for _, ref in owned])
        for (wid, _), dead in zip(owned, died):
            if dead and wid in self.staged:
                self._reclaim(wid, "its writer's process died before its commit")
        now = time.monotonic()
        expired = [i for i, w in self.write_leases.items() if w.deadline <= now]
        self._reclaim_write_leases(expired, writer_alive=True)
        writers = [(i, w.owner) for i, w in self.write_leases.items() if w.owner is not None]
        gone = await asyncio.gather(*[self._owner_died(r, timeout_s) for _, r in writers])
        self._reclaim_write_leases([i for (i, _), dead in zip(writers, gone) if dead], False)
        # A reader's mappings die with its process: release its leases.
        readers = {ref.hex(): ref for _, ref in self.read_leases.values() if ref is not None}
        gone = await asyncio.gather(*[self._owner_died(r, timeout_s) for r in readers.values()])
        dead_readers = {h for h, dead in zip(readers, gone) if dead}
        if dead_readers:
            self.release_reads(
                [i for i, (_, ref) in self.read_leases.items() if ref and ref.hex() in dead_readers]
            )

    @staticmethod
    async def _owner_died(owner: ray.ObjectRef, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(owner, timeout_s)
        except ray.exceptions.OwnerDiedError:
            return True
        except Exception:  # noqa: BLE001 - slow or unreachable is no proof of death: the deadline decides
            return False
        return False

    def _reclaim(self, write_id: str, why: str) -> None:
        self.expired[write_id] = why
        while len(self.expired) > _EXPIRED_REMEMBERED:
            self.expired.popitem(last=False)
        self.stats.inc("stages_reclaimed_total")
        st = self.staged.get(write_id)
        if st is not None:  # its writer may be copying still: its blocks are never recycled
            self.arena.taint(st.blocks().tolist())
        self.discard(write_id)

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
            if col is not None:
                col.ensure(part.next_slot)  # slots added by writes of other fields read as absent
            present = col.chunk[slots] if col is not None else None
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
        """The fields' bytes, shipped through Ray (cross-node reads).

        Rows that lie back to back in one block go out as a view of the block,
        which Ray copies straight into the object store (the one copy on this
        side); others are gathered first.
        """
        t0 = time.perf_counter()
        out: dict[str, EncodedField] = {}
        for name, rows in self._rows(partition_id, sample_ids, fields):
            if isinstance(rows, tuple):
                header, chunk_ids, which, starts, ends = rows
                if len(chunk_ids) == 1 and np.array_equal(starts[1:], ends[:-1]):
                    values = self._leased_view(chunk_ids[0], int(starts[0]), int(ends[-1]))
                else:
                    values = self.arena.gather(chunk_ids, which, starts, ends)
                rows = dataclasses.replace(header, values=values)
            out[name] = rows
        self._count_read(out, t0)
        return out

    def _leased_view(self, block: int, start: int, end: int) -> np.ndarray:
        """A view of a block's bytes for ``read`` to return. Ray copies it into the object
        store only after ``read`` has returned, when a concurrent clear may have freed the
        block: the view maps it (a closed chunk's pages live on in the mapping) and
        leases it, so it is not recycled for a new write until the view is gone."""
        values = self.arena.view(block, start, end)
        self.arena.lease([block])
        # The view may die on a Ray thread; the lease goes back on the unit's event loop.
        loop = asyncio.get_running_loop()
        weakref.finalize(values, loop.call_soon_threadsafe, self.arena.unlease, [block])
        return values

    def read_shm(
        self,
        partition_id: str,
        sample_ids: list[str],
        fields: list[str],
        owner: list | None = None,
    ) -> dict:
        """Where the fields' bytes sit in shared memory, for a reader on this node to map.

        The chunks named are leased to the reader until it calls ``release_reads``
        (or its process, ``owner``, dies): a leased chunk is never recycled. A field
        of at most ``INLINE_READ_BYTES`` comes back as its bytes instead (no lease).
        """
        t0 = time.perf_counter()
        out: dict = {}
        lease, leased = self._next_lease, []
        for name, rows in self._rows(partition_id, sample_ids, fields):
            if isinstance(rows, tuple):
                header, chunk_ids, which, starts, ends = rows
                if int((ends - starts).sum()) <= INLINE_READ_BYTES:
                    values = self.arena.gather(chunk_ids, which, starts, ends)
                    rows = dataclasses.replace(header, values=values)
                else:
                    chunks = [self.arena.ref(c) for c in chunk_ids]
                    rows = SharedRows(header, chunks, which, starts, ends, lease)
                    leased.extend(chunk_ids)
            out[name] = rows
        if leased:
            self._next_lease += 1
            self.arena.lease(leased)
            self.read_leases[lease] = (leased, owner[0] if owner else None)
            self._start_sweeper()
        self._count_read(out, t0)
        return out

    def release_reads(self, leases: list[int]) -> None:
        """A reader's mappings of these leases' chunks are gone: they may be recycled."""
        for lease in leases:
            held = self.read_leases.pop(lease, None)
            if held is not None:
                self.arena.unlease(held[0])

    def recycled_chunks(self) -> int:
        """Freed chunks kept warm for later writes instead of closed (tests and metrics)."""
        return self.arena.recycled

    def _count_read(self, out: dict, t0: float) -> None:
        self.stats.inc("get_bytes_total", sum(v.nbytes for v in out.values()))
        self.stats.inc("get_requests_total")
        self.stats.observe("get_latency_seconds", time.perf_counter() - t0)

    # ---- clearing -----------------------------------------------------------------
    def clear(self, partition_id: str, sample_ids: list[str] | None) -> int:
        """Forget samples (None = the whole partition); returns the bytes of data dropped.

        Memory goes back as blocks empty (a slab may outlive some of its rows).
        """
        part = self.partitions.get(partition_id)
        if part is None:
            return 0
        if sample_ids is None:
            del self.partitions[partition_id]
            slots = np.arange(part.next_slot)
        else:
            slots = np.array(
                [part.slot_of.pop(s) for s in sample_ids if s in part.slot_of], dtype=np.int64
            )
            part.free_slots.extend(slots.tolist())
            part.forget_slots(slots)
        dropped, held = 0, []
        for col in part.columns.values():
            col.ensure(part.next_slot)
            blocks = col.chunk[slots]
            dropped += int(col.nbytes[slots][blocks >= 0].sum())
            held.append(blocks.copy())
            col.chunk[slots] = -1
        self._release(held)
        return dropped

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
            start = np.array([col.offset[slot]])
            raw = self.arena.gather(
                [int(col.chunk[slot])], np.zeros(1, np.int64), start, start + col.nbytes[slot]
            )
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
        """Live bytes of data per partition (the rows' own bytes, not the blocks around them)."""
        out = {}
        for pid, part in self.partitions.items():
            total = 0
            for col in part.columns.values():
                live = col.chunk[: part.next_slot] >= 0
                total += int(col.nbytes[: part.next_slot][live].sum())
            out[pid] = total
        return out

    def metrics_snapshot(self) -> UnitSnapshot:
        return UnitSnapshot(
            index=self.index,
            node_id=self.node_id,
            node_ip=self.node_ip,
            # Regions leased to writers for their next put count as memory kept ready for
            # writes (like the reserve), not as data; capacity counts them in both.
            bytes=self.used_bytes - sum(w.nbytes for w in self.write_leases.values()),
            samples=sum(len(p.slot_of) for p in self.partitions.values()),
            capacity_bytes=self.capacity_bytes,
            warm_reserve_bytes=self.reserve.held_bytes
            + sum(self.arena.chunk_bytes(w.block) for w in self.write_leases.values()),
            partition_bytes=self.partition_bytes(),
            stats=self.stats.snapshot(),
        )


def _records(data: bytes):
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=len(data) + 1)
    unpacker.feed(data)
    yield from unpacker
