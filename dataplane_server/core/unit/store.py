"""UnitStore: what a storage unit does with its bytes, without Ray.

The ``StorageUnit`` actor (unit/actor.py) is a shell around one store: it
owns the Ray parts (actor identity, object refs as writers' and readers'
process tokens, telling whether a process died, the sweeper's timer) and
delegates everything else here, so all of it runs and is tested in one process.

Layout: per partition a :class:`~dataplane_server.core.unit.partition.UnitPartition`
(slots, one column per field pointing into the unit's :class:`Arena`). The
bytes are one region per (write, field) in the arena (small regions share
slabs): a write of K samples is one copy into one region; a read of K samples
is a handful of range copies (adjacent rows are merged), never K x fields
small messages.

Writes are two-phase: ``stage`` copies bytes in under a write id (invisible),
the controller's commit calls ``publish`` to make them the slots' bytes, or the
client calls ``discard``. A stage nobody commits is reclaimed after its
deadline (``reclaim_expired``) or as soon as its writer's process dies
(``owners_died``, told by the shell). Blocks are freed when nothing points into
them, so clearing returns memory.

A commit spanning several units is first ``prepare``d on each (the stage is
pinned: no deadline or writer death reclaims it), then published; a commit on
one unit publishes at once. Beside the bytes a unit keeps each sample's commit
order, length and tags, and remembers recently published write ids, so a
restarted controller rebuilds its key space from the units (``recovery_view``)
and a retried commit is a no-op.

A durable unit (``files`` and ``log`` given: durability ``process`` or ``machine``)
keeps its chunks as files and its row index in a log (unit/chunk_files.py,
unit/row_log.py): each publish, undo and clear is recorded before the blocks it
stops naming are freed, and a new process of the unit re-attaches both, so a
unit's restart loses no committed sample.

A write that does not fit waits here for room (asyncio, up to
``put_wait_timeout_s``): the wait ends in the same step as the allocation it
made room for, with no await between the check and the allocation, which only
this object can promise.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np

from dataplane_client.wire import shm
from dataplane_client.wire.encoded import DENSE, EncodedField, run_bounds
from dataplane_client.wire.errors import (
    CapacityExceeded,
    FieldNotProduced,
    InvalidBatch,
    Overloaded,
    RouteChanged,
    SamplesNotFound,
    SchemaConflict,
    StageReclaimed,
)
from dataplane_client.wire.messages import (
    ChunkClosures,
    SharedRows,
    ShmAlloc,
    ShmRegion,
    UnitSnapshot,
    WriteLease,
)
from dataplane_client.wire.put_deadline import stage_deadline_s
from dataplane_server.core.recovery_messages import (
    DumpedFile,
    DumpedUnit,
    PinnedWrite,
    SampleMeta,
    UnitRecovery,
)
from dataplane_server.core.stats import Stats, counts_errors
from dataplane_server.core.unit import checkpoint as unit_checkpoint
from dataplane_server.core.unit import groups as unit_groups
from dataplane_server.core.unit import preview as unit_preview
from dataplane_server.core.unit.arena import Arena
from dataplane_server.core.unit.chunk_files import ChunkFiles
from dataplane_server.core.unit.leases import LeasedRegion, Leases
from dataplane_server.core.unit.partition import UnitPartition
from dataplane_server.core.unit.row_log import RowLog
from dataplane_server.core.unit.undo import Cells, PublishedWrite, PublishedWrites
from dataplane_server.core.unit.warm_reserve import WarmReserve

log = logging.getLogger(__name__)

_EXPIRED_REMEMBERED = 4096  # write ids of reclaimed stages kept to explain a late publish
_PUBLISHED_REMEMBERED = 65536  # write ids of published stages: a retried commit is a no-op
# A same-node read of a field this small gets its bytes in the answer: copying them costs
# less than the reader mapping the chunks and the lease messages that guard its mappings.
INLINE_READ_BYTES = 64 * 1024


@dataclass
class Staged:
    partition_id: str
    sample_ids: list
    fields: dict  # name -> (schema, block id, row offsets, row nbytes, row lengths | None)
    deadline: float  # time.monotonic() after which the stage is reclaimed
    owner: Hashable | None  # the writer's process: its death reclaims the stage
    meta: SampleMeta | None = None  # set by prepare: the commit is under way, never reclaimed
    staged_units: list[int] = field(default_factory=list)  # every unit of the prepared commit
    shared: frozenset[str] = frozenset()  # group fields: one value per group (unit_groups)

    def blocks(self) -> np.ndarray:
        return np.array([block for (_, block, *_rest) in self.fields.values()], dtype=np.int64)

    def schemas(self) -> dict[str, tuple]:
        return {name: schema for name, (schema, *_rest) in self.fields.items()}


@dataclass(frozen=True)
class UnitHoldings:
    """What a unit has lent out and kept ready beside its data (inspection and tests)."""

    read_leases: int  # readers' leases not yet released
    write_leases: int  # regions set aside for writers' next puts
    write_lease_chunk_bytes: int  # the memory of the chunks behind them
    reserve_bytes: int  # pre-faulted chunks ready in the warm reserve
    reserve_settled: bool  # the reserve is making nothing and was asked for nothing
    chunk_prefix: str  # what the names of this unit's chunks start with
    reader_tokens: int = 0  # same-node readers' process tokens remembered (the actor's)
    payload_registered: int = 0  # chunks registered with the transfer engine (the actor's)
    payload_orphans: int = 0  # ... of which neither held, kept warm nor leased: a leak


def _narrowest(values: np.ndarray) -> np.ndarray:
    """Non-negative ints in the narrowest unsigned dtype that holds them, for an answer's
    row offsets: Ray ships an answer of up to 100 KiB inline, a larger one through its
    object store (about 2 ms more per get here); 1,024 rows of 4 fields at int64 were
    just over (the reader widens them back, ``assembly._sources``)."""
    top = int(values.max()) if len(values) else 0
    return values.astype(np.min_scalar_type(top), copy=False)


class UnitStore:
    def __init__(
        self,
        index: int,
        capacity_bytes: int,
        *,
        put_wait_timeout_s: float,
        use_shm: bool,
        warm_reserve_bytes: int,
        stage_ttl_s: float,
        files: ChunkFiles | None = None,
        log: RowLog | None = None,
    ):
        # No defaults: the settings come from the service's DataPlaneConfig (the actor,
        # StorageUnit, passes them), so each has one default, the config's.
        self.index = index
        self.use_shm = bool(use_shm) and shm.supported()
        if (files is None) != (log is None) or (files is not None and not self.use_shm):
            raise ValueError("a durable unit needs both its chunk files and its row log, on Linux")
        self.files, self.log = files, log
        self.reserve = WarmReserve(
            warm_reserve_bytes if self.use_shm else 0,
            make=files.make if files is not None else None,
            discard=files.remove if files is not None else None,
        )
        self.capacity_bytes = int(capacity_bytes)
        self.arena = Arena(self.capacity_bytes, self.use_shm, self.reserve, files)
        self.put_wait_timeout_s = float(put_wait_timeout_s)
        self.stage_ttl_s = float(stage_ttl_s)
        self.partitions: dict[str, UnitPartition] = {}
        self.staged: dict[str, Staged] = {}
        self.expired: OrderedDict[str, str] = OrderedDict()  # write id -> why it was reclaimed
        self.published: OrderedDict[str, None] = OrderedDict()
        self.undo = PublishedWrites()  # what recent publishes filled, to undo one by write id
        self.stats = Stats()
        self.leases = Leases(self.arena, self._release, self.stats)
        self._room_waiters: list[asyncio.Future] = []  # writes waiting for memory to be freed
        # Checkpoints: a value's key (block, offset) means the same bytes only within one
        # process, so a parent checkpoint's values are reused only by the same incarnation.
        self.incarnation = uuid.uuid4().hex
        self.checkpoint_pins = unit_checkpoint.Pins()
        if log is not None:
            self._reattach()

    @property
    def used_bytes(self) -> int:
        return self.arena.used_bytes

    def close(self) -> None:
        """Free every block and stop the reserve (an actor's memory goes with its process;
        a durable unit's files stay for its next process)."""
        self.arena.close()
        self.reserve.close()
        if self.log is not None:
            self.log.close()

    # ---- durability: the row index on file ------------------------------------------
    def _reattach(self) -> None:
        """Take back what an earlier process of this unit left: its row index and the
        chunk files it names; remove every other chunk file (stages never committed)."""
        assert self.log is not None
        assert self.files is not None
        t0 = time.perf_counter()
        state = self.log.restore()
        self.arena.skip_ids(state.next_block)
        self.partitions, self.published = state.partitions, state.published
        lost = set()
        for block, refs in _cell_counts(self.partitions).items():
            name, size = state.blocks.get(block, ("", 0))
            chunk = self.files.open(name) if name else None
            if chunk is None:
                lost.add(block)
                continue
            self.arena.attach(block, chunk, size, refs)
        if lost:  # files gone under the index (a machine crash): those cells are lost
            for part in self.partitions.values():
                for col in part.columns.values():
                    col.chunk[np.isin(col.chunk, list(lost))] = -1
                part.forget_if_empty(list(part.slot_of), list(part.columns))
        self.files.remove_others({self.arena.file_of(b)[0] for b in self.arena.blocks})
        # Lease ids of the dead process must never match this one's (a late writer's).
        self.leases.next_id = secrets.randbits(48)
        if lost:
            self._compact()  # the index names no lost block from now on
        self.stats.inc("unit_restores_total")
        self.stats.inc("unit_restore_seconds_total", time.perf_counter() - t0)

    def _log_rows(self, partition_id: str, sample_ids: list[str], published: str | None) -> None:
        """Record these samples' rows as they are now (before any block is freed)."""
        assert self.log is not None
        part = self.partitions.get(partition_id)
        blocks: set[int] = set()
        if part is not None:
            slots = [part.slot_of[s] for s in sample_ids if s in part.slot_of]
            for col in part.columns.values():
                col.ensure(part.next_slot)
                blocks.update(col.chunk[slots].tolist())
        blocks.discard(-1)
        files = {b: self.arena.blocks[b].store for b in blocks}
        self.log.rows(partition_id, part, sample_ids, files, published)  # type: ignore[arg-type]

    def _compact_if_due(self) -> None:
        if self.log is not None and self.log.due():
            self._compact()

    def _compact(self) -> None:
        assert self.log is not None
        files = {b: self.arena.blocks[b].store for b in _cell_counts(self.partitions)}
        self.log.compact(self.partitions, self.published, files)  # type: ignore[arg-type]

    # ---- write path ---------------------------------------------------------------
    async def stage(
        self,
        partition_id: str,
        write_id: str,
        sample_ids: list[str],
        encoded: dict[str, EncodedField],
        owner: Hashable | None = None,
        expires_at: float | None = None,
        group_rows: dict[str, np.ndarray] | None = None,
    ) -> int:
        """Copy a write's bytes in, invisible until publish. Returns bytes staged.

        ``expires_at``: the put's deadline (``put_deadline``); the stage is refused
        after it and kept until shortly after it. ``group_rows``: per group field, each
        sample's row (``unit_groups``)."""
        regions = await self._stage(
            partition_id,
            write_id,
            sample_ids,
            encoded,
            owner,
            expires_at,
            header_only=False,
            group_rows=group_rows,
        )
        for name, enc in encoded.items():
            block, offset = regions[name]
            self.arena.write(block, offset, enc.require_values())
        return sum(enc.nbytes for enc in encoded.values())

    async def alloc_shm(
        self,
        partition_id: str,
        write_id: str,
        sample_ids: list[str],
        headers: dict[str, EncodedField],
        owner: Hashable | None = None,
        closed_seq: int = -1,
        expires_at: float | None = None,
        group_rows: dict[str, np.ndarray] | None = None,
    ) -> ShmAlloc:
        """Stage a same-node write whose bytes the client copies into shared memory itself.

        Returns, per field, the region the client copies its bytes into (through
        its mapping of the chunk, kept across writes), and the chunks closed since
        ``closed_seq`` (the client's last answer). The write stays invisible until
        the controller's commit publishes it, which the client only asks for after
        its copy is complete.
        """
        regions = await self.alloc_regions(
            partition_id, write_id, sample_ids, headers, owner, expires_at, group_rows
        )
        return self._answer(regions, headers, owner, closed_seq)

    async def alloc_regions(
        self,
        partition_id: str,
        write_id: str,
        sample_ids: list[str],
        headers: dict[str, EncodedField],
        owner: Hashable | None = None,
        expires_at: float | None = None,
        group_rows: dict[str, np.ndarray] | None = None,
    ) -> dict[str, tuple[int, int]]:
        """Stage a write whose bytes its writer puts into place itself (through its
        shared-memory mapping, ``alloc_shm``, or a transfer engine from another node,
        ``dataplane_server/unit/payload.py``): {field: (block, offset)} of its region
        (``headers[field].nbytes`` long). Invisible until the commit publishes it, which
        the writer asks for only once its bytes are in place."""
        return await self._stage(
            partition_id,
            write_id,
            sample_ids,
            headers,
            owner,
            expires_at,
            header_only=True,
            group_rows=group_rows,
        )

    async def stage_leased(
        self,
        partition_id: str,
        write_id: str,
        sample_ids: list[str],
        headers: dict[str, EncodedField],
        owner: Hashable | None,
        lease: int,
        closed_seq: int = -1,
        expires_at: float | None = None,
        group_rows: dict[str, np.ndarray] | None = None,
    ) -> ShmAlloc | None:
        """Stage a same-node write into the region of a ``WriteLease`` this writer holds.

        The writer sends this before copying into the region (the copy and this
        call overlap); the write is invisible until its commit, which the writer
        sends once both are done. None: the lease is gone (its deadline passed, or
        the unit needed the room), nothing was staged, and the writer stages anew.
        """
        held = self.leases.take_region(lease)
        if held is None:
            return None
        try:
            regions = await self._stage(
                partition_id,
                write_id,
                sample_ids,
                headers,
                owner,
                expires_at,
                header_only=True,
                lease=held,
                group_rows=group_rows,
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
        owner: Hashable | None,
        closed_seq: int,
    ) -> ShmAlloc:
        """A same-node stage's answer: its regions, closed chunks, the writer's next lease."""
        return ShmAlloc(
            regions={
                name: ShmRegion(self.arena.ref(block), offset, headers[name].nbytes)
                for name, (block, offset) in regions.items()
            },
            closures=self._closures(closed_seq),
            next_lease=self._lend_region(
                shm.layout([h.nbytes for h in headers.values()])[1], owner
            ),
        )

    def _closures(self, closed_seq: int) -> ChunkClosures:
        """The chunks closed since a same-node client's ``closed_seq``."""
        return ChunkClosures(*self.arena.closed_since(closed_seq), shm.chunk_prefix())

    def _lend_region(self, nbytes: int, owner: Hashable | None) -> WriteLease | None:
        """Set a region of ``nbytes`` aside for the writer's next put, from memory that is
        ready (never made and zeroed here, on the writer's critical path); None when
        there is none or no room."""
        if owner is not None:  # one lease per writer: the one it held before is replaced
            self.leases.reclaim_regions(self.leases.regions_of(owner), writer_alive=True)
        if nbytes <= 0 or self.used_bytes + self.arena.extra_bytes([nbytes]) > self.capacity_bytes:
            return None
        if self.arena.is_small(nbytes):
            return None  # only writes with a chunk of their own: a slab would stay held for it
        placed = self.arena.alloc_warm(nbytes)
        if placed is None:
            return None
        block, offset = placed
        deadline = time.monotonic() + self.stage_ttl_s
        lease = self.leases.lend_region(block, offset, nbytes, deadline, owner)
        return WriteLease(lease, ShmRegion(self.arena.ref(block), offset, nbytes), self.stage_ttl_s)

    @counts_errors
    async def _stage(
        self,
        partition_id,
        write_id,
        sample_ids,
        encoded,
        owner,
        expires_at: float | None,
        *,
        header_only,
        lease: LeasedRegion | None = None,
        group_rows: dict[str, np.ndarray] | None = None,
    ) -> dict[str, tuple[int, int]]:
        """Validate, wait for room, allocate one region for the write (or take ``lease``'s),
        its fields laid out in it back to back: {field: (block, offset)}."""
        t0 = time.perf_counter()
        keep_s = stage_deadline_s(expires_at, self.stage_ttl_s, self.index)  # or Overloaded
        group_rows = unit_groups.checked_rows(group_rows, encoded, len(sample_ids))
        for name, enc in encoded.items():
            enc.validate(name, header_only=header_only)
            if name not in group_rows and enc.num_rows != len(sample_ids):
                raise SchemaConflict(
                    f"{enc.num_rows} rows for {len(sample_ids)} ids", fields=[name]
                )
        self._check_schema(partition_id, {name: enc.schema for name, enc in encoded.items()})
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
            await self._wait_for_room([total], sample_ids, expires_at)
            keep_s = stage_deadline_s(expires_at, self.stage_ttl_s, self.index)  # waited
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
            rows = group_rows.get(name)
            if rows is not None:  # a group field: each sample's cell is its group's row
                offs, nbytes = offs[rows], nbytes[rows]
                lengths = None if lengths is None else lengths[rows]
            fields[name] = (enc.schema, block, offs, nbytes, lengths)
        deadline = time.monotonic() + keep_s
        self.discard(write_id)  # a retried stage under the same id replaces the first
        self.staged[write_id] = Staged(
            partition_id,
            list(sample_ids),
            fields,
            deadline,
            owner,
            shared=frozenset(group_rows),
        )
        self.stats.inc("put_bytes_total", sum(sizes))
        self.stats.inc("put_requests_total")
        self.stats.observe("put_latency_seconds", time.perf_counter() - t0)
        return dict(zip(names, placed))

    def _check_schema(self, partition_id: str, schemas: dict[str, tuple]) -> None:
        """SchemaConflict when a field's column holds another schema. At stage time only
        published columns are compared, not other stages: a stage that is never committed
        must not refuse the writes after it (the key space decides between concurrent
        first writes). Prepare and publish check again, as a column may have been made
        by a publish since the stage."""
        part = self.partitions.get(partition_id)
        if part is None:
            return
        for name, schema in schemas.items():
            col = part.columns.get(name)
            if col is not None and col.schema != schema:
                raise SchemaConflict(
                    f"field stored as {col.schema}, this write has {schema}",
                    fields=[name],
                    partition_id=partition_id,
                )

    async def _wait_for_room(
        self, sizes: list[int], sample_ids: list[str], expires_at: float | None = None
    ) -> None:
        """Return once allocating ``sizes`` keeps the unit within capacity (or raise).

        The caller allocates right after, with no await in between, so the room
        found here is still there. The wait ends at the put's deadline (``expires_at``)
        if that comes first; the caller then refuses the stage.
        """

        def fits() -> bool:
            return self.used_bytes + self.arena.extra_bytes(sizes) <= self.capacity_bytes

        if fits():
            return
        # Regions set aside for writers' next puts give way to a write that needs the room.
        self.leases.reclaim_regions(list(self.leases.writes), writer_alive=True)
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
        loop = asyncio.get_running_loop()
        wait_s = self.put_wait_timeout_s
        if expires_at is not None:
            wait_s = min(wait_s, max(expires_at - time.time(), 0.0))
        deadline = loop.time() + wait_s
        while not fits():
            freed = loop.create_future()  # resolved by the next release of memory
            self._room_waiters.append(freed)
            try:
                await asyncio.wait_for(freed, deadline - loop.time())
            except asyncio.TimeoutError:
                if wait_s < self.put_wait_timeout_s:  # the put's deadline came first
                    raise Overloaded(
                        f"unit {self.index}: the put's deadline passed while it waited for "
                        f"room for {need} bytes; nothing was staged, retry later",
                        queue="stage",
                    ) from None
                raise CapacityExceeded(
                    f"unit {self.index}: no room for {need} bytes after waiting "
                    f"{self.put_wait_timeout_s}s ({self.used_bytes} of {self.capacity_bytes} used)",
                    ids=sample_ids,
                ) from None
            finally:
                if freed in self._room_waiters:
                    self._room_waiters.remove(freed)

    def _release(self, block_refs: list[np.ndarray]) -> None:
        """Drop one reference per block id (-1 = none); wake writes waiting for room."""
        before = self.used_bytes
        self.arena.release(np.concatenate(block_refs) if block_refs else [])
        if self.used_bytes < before and self._room_waiters:
            waiting, self._room_waiters = self._room_waiters, []
            for freed in waiting:
                if not freed.done():
                    freed.set_result(None)

    def _staged_or_raise(self, write_id: str) -> Staged:
        st = self.staged.get(write_id)
        if st is not None:
            return st
        if write_id in self.expired:  # the put's commit came too late: typed, retryable
            raise StageReclaimed(
                f"unit {self.index}: the staged write {write_id} was reclaimed before its "
                f"commit ({self.expired[write_id]}); nothing of it became visible",
                queue="commit",
            )
        raise SamplesNotFound(
            f"unit {self.index}: no staged write {write_id} to publish (it was never staged "
            "here, or was discarded); nothing of it became visible"
        )

    @counts_errors
    def prepare(self, write_id: str, meta: SampleMeta, staged_units: list[int]) -> None:
        """Pin a stage for a commit spanning several units: once every unit of the commit
        has it pinned, publishing cannot fail short of a unit's death."""
        if write_id in self.published:
            return
        st = self._staged_or_raise(write_id)
        self._check_schema(st.partition_id, st.schemas())
        self._stored_group_values(st, meta, strict=True)  # differing values refused here
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
        # Refused here, nothing published: a column must never hold bytes of two schemas.
        self._check_schema(st.partition_id, st.schemas())
        # A prepared write must publish (other units did): a differing group value it
        # meets now (another write stored it since its prepare) keeps its own bytes.
        reuse = self._stored_group_values(st, meta or st.meta, strict=st.meta is None)
        del self.staged[write_id]
        part = self.partitions.setdefault(st.partition_id, UnitPartition())
        slots = part.slots_for(st.sample_ids)
        sample_meta = meta or st.meta or SampleMeta(seq=0)
        part.remember(slots, st.sample_ids, sample_meta)
        part.stamp(slots, sample_meta.seq)
        replaced, cells = [], {}
        for name, (schema, block, offs, nbytes, lengths) in st.fields.items():
            col = part.column(name, schema)
            replaced.append(col.chunk[slots].copy())
            cells[name] = Cells(block, offs, replaced[-1] < 0)
            col.chunk[slots] = block
            col.offset[slots] = offs
            col.nbytes[slots] = nbytes
            if lengths is not None:
                col.length[slots] = lengths
            if name not in st.shared:
                self.arena.hold(block, len(slots))
                continue
            col.shared = True
            if name in reuse:  # the group's value stored before: the cells point at it
                unit_groups.point_at_stored(col, slots, reuse[name])
                cells[name] = Cells(
                    col.chunk[slots].copy(), col.offset[slots].copy(), cells[name].added
                )
            blocks, counts = np.unique(col.chunk[slots], return_counts=True)
            for b, n in zip(blocks.tolist(), counts.tolist()):
                self.arena.hold(b, n)
        if self.log is not None:
            self._log_rows(st.partition_id, st.sample_ids, write_id)
        self._release([*replaced, st.blocks()])
        self._compact_if_due()
        self.undo.add(write_id, PublishedWrite(st.partition_id, st.sample_ids, cells))
        self.published[write_id] = None
        while len(self.published) > _PUBLISHED_REMEMBERED:
            self.published.popitem(last=False)
        return True

    def _stored_group_values(
        self, st: Staged, meta: SampleMeta | None, *, strict: bool
    ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Which of a staged write's group-field cells point at values stored before."""
        return unit_groups.stored_values(
            self.partitions.get(st.partition_id),
            self.arena,
            st.partition_id,
            st.sample_ids,
            st.fields,
            st.shared,
            meta,
            strict=strict,
        )

    def unpublish(
        self, partition_id: str, write_id: str, sample_ids: list[str] | None = None
    ) -> int:
        """Undo what publishing ``write_id`` made visible; returns the bytes dropped.

        None: the whole write, whose commit will not be applied (a multi-unit publish
        that failed on another unit, a partition deleted meanwhile); the write id is
        no longer published, so a retry of the commit publishes anew. ``sample_ids``:
        only those samples' cells (the commit was applied, but a clear took these
        samples meanwhile).

        Only the cells this write filled are emptied, and only while they still hold
        its bytes; a sample then holding no field at all (this write created it) is
        forgotten. Fields the samples had before stay. Not undone: cells the write
        replaced (``overwrite=True``) keep the new bytes, as the old ones were freed at
        publish; such a cell stays readable, with the refused write's value. A write
        too old to be remembered (``unit_undo``) is left as it is.
        """
        if sample_ids is None:
            self.published.pop(write_id, None)
            if self.log is not None:
                self.log.unpublished(write_id)
        write = self.undo.pop(write_id)
        part = self.partitions.get(partition_id)
        if write is None or part is None or write.partition_id != partition_id:
            return 0
        ids = write.sample_ids
        only = np.ones(len(ids), dtype=bool)
        if sample_ids is not None:
            wanted = set(sample_ids)
            only = np.fromiter(map(wanted.__contains__, ids), dtype=bool, count=len(ids))
        dropped, held = 0, []
        for name, cells in write.fields.items():
            rows = np.flatnonzero(cells.added & only)
            block = cells.block[rows] if isinstance(cells.block, np.ndarray) else cells.block
            nbytes, blocks = part.empty_cells(
                name, [ids[i] for i in rows.tolist()], block, cells.offsets[rows]
            )
            dropped += nbytes
            held.append(blocks)
        part.forget_if_empty([s for s, keep in zip(ids, only.tolist()) if keep], list(write.fields))
        if not part.slot_of:
            del self.partitions[partition_id]
        if self.log is not None:
            self._log_rows(partition_id, ids, None)
        self._release(held)
        self._compact_if_due()
        return dropped

    def discard(self, write_id: str) -> None:
        st = self.staged.pop(write_id, None)
        if st is not None:
            self._release([st.blocks()])

    def staged_write_ids(self) -> list[str]:
        """Writes staged and not yet published or reclaimed (for inspection and tests)."""
        return list(self.staged)

    # ---- reclaiming what nobody will use (the shell's sweeper calls these) -----------
    def reclaim_expired(self) -> None:
        """Reclaim stages and write leases past their deadline."""
        now = time.monotonic()
        for wid in [w for w, st in self.staged.items() if st.deadline <= now]:
            self._reclaim(wid, f"its {self.stage_ttl_s}s deadline passed before its commit")
        self.leases.reclaim_expired(now)

    def watched_owners(self) -> set:
        """Processes whose death frees something: writers of stages no commit has pinned,
        and holders of read or write leases."""
        writers = {
            st.owner for st in self.staged.values() if st.owner is not None and st.meta is None
        }
        return writers | self.leases.owners()

    def owners_died(self, dead: set) -> None:
        """These processes are gone: reclaim their unpinned stages, free their leases."""
        if not dead:
            return
        for wid in [w for w, st in self.staged.items() if st.meta is None and st.owner in dead]:
            self._reclaim(wid, "its writer's process died before its commit")
        self.leases.owners_died(dead)

    def _reclaim(self, write_id: str, why: str) -> None:
        self.expired[write_id] = why
        while len(self.expired) > _EXPIRED_REMEMBERED:
            self.expired.popitem(last=False)
        self.stats.inc("stages_reclaimed_total")
        st = self.staged.get(write_id)
        if st is not None:  # its writer may be copying still: its blocks are never recycled
            self.arena.taint(st.blocks().tolist())
        self.discard(write_id)

    # ---- what a (re)starting controller rebuilds from --------------------------------
    def recovery_view(self) -> UnitRecovery:
        """Every stored sample (ids, fields, lengths, tags, commit order) and pending commits."""
        return UnitRecovery(
            index=self.index,
            partitions={pid: part.stored_rows() for pid, part in self.partitions.items()},
            pinned={
                w: PinnedWrite(st.partition_id, st.staged_units)
                for w, st in self.staged.items()
                if st.meta is not None
            },
            published=list(self.published),
        )

    # ---- checkpoints: a cut of this unit's samples, copied while it serves ----------
    def pin_checkpoint(self, checkpoint_id: str) -> None:
        """Hold this unit's rows and their blocks as they are now (the checkpoint's cut)."""
        self.checkpoint_pins.pin(self, checkpoint_id)

    def release_unwritten_checkpoints(self) -> None:
        """Let go of cuts pinned long ago whose copy never started (their controller died
        mid-checkpoint): their blocks are freed as any unpinned block would be."""
        for checkpoint_id in self.checkpoint_pins.release_unwritten(self):
            log.warning(
                "unit %d: released the cut of checkpoint %s, pinned %.0fs ago and never "
                "written (its controller died mid-checkpoint?)",
                self.index,
                checkpoint_id,
                unit_checkpoint.UNWRITTEN_PIN_TTL_S,
            )

    async def write_checkpoint(
        self,
        checkpoint_id: str,
        directory: str,
        cut: dict[str, list[str]],
        parent_dir: str | None = None,
        parent_files: list[DumpedFile] | None = None,
        copy_share: float = 1.0,
    ) -> DumpedUnit:
        """Write the pinned rows ``cut`` names (partition -> ids) to ``directory``, copying
        only values the parent's files do not hold, at most ``copy_share`` of one core
        busy; the pin is released after."""
        return await self.checkpoint_pins.write(
            self, checkpoint_id, directory, cut, parent_dir, parent_files, copy_share
        )

    def load(self, directory: str, files: list[DumpedFile]) -> int:
        """Store the samples of this unit's checkpoint files (the unit must hold none of
        their partitions). Returns the number of samples loaded."""
        before = set(self.partitions)
        loaded = unit_checkpoint.load(self, directory, files)
        if self.log is not None:
            for pid in set(self.partitions) - before:
                self._log_rows(pid, list(self.partitions[pid].slot_of), None)
            self._compact_if_due()
        return loaded

    # ---- read path ----------------------------------------------------------------
    def _check_generations(
        self, partition_id: str, sample_ids: list[str], expect: list[int] | None
    ) -> None:
        """A direct read (``expect``: the generation meant per sample) of samples this unit
        does not hold at those generations: RouteChanged, and the reader asks the controller."""
        if expect is None:
            return
        part = self.partitions.get(partition_id)
        if part is None or len(expect) != len(sample_ids) or not part.holds(sample_ids, expect):
            self.stats.inc("direct_read_misses_total")
            raise RouteChanged(
                f"unit {self.index} does not hold these samples at the generations asked for",
                partition_id=partition_id,
            )

    def _rows(self, partition_id: str, sample_ids: list[str], fields: list[str]):
        """Per field: (header, chunk ids, which chunk per row, byte starts, ends)."""
        part = self.partitions.get(partition_id)
        slot_of = part.slot_of if part else {}
        missing = [s for s in sample_ids if s not in slot_of]
        if missing:
            raise SamplesNotFound(
                f"unit {self.index} holds no bytes for these samples",
                ids=missing,
                partition_id=partition_id,
            )
        assert part is not None  # every id was found in it
        slots = np.fromiter((slot_of[s] for s in sample_ids), dtype=np.int64, count=len(sample_ids))
        for name in fields:
            col = part.columns.get(name)
            if col is not None:
                col.ensure(part.next_slot)  # slots added by writes of other fields read as absent
            absent = np.ones(len(slots), bool) if col is None else col.chunk[slots] == -1
            if col is None or absent.any():
                raise FieldNotProduced(
                    "field has no bytes for these samples",
                    ids=[sample_ids[i] for i in np.flatnonzero(absent)],
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
        self,
        partition_id: str,
        sample_ids: list[str],
        fields: list[str],
        expect: list[int] | None = None,
    ) -> dict[str, EncodedField]:
        """The fields' bytes, to be shipped through Ray (cross-node reads).

        Rows that lie back to back in one block go out as a view of the block,
        which Ray copies straight into the object store (the one copy on this
        side); others are gathered first. ``expect``: a direct read's generations
        (``RouteChanged`` unless every sample is here at its generation).
        """
        t0 = time.perf_counter()
        self._check_generations(partition_id, sample_ids, expect)
        out: dict[str, EncodedField] = {}
        for name, (header, chunk_ids, which, starts, ends) in self._rows(
            partition_id, sample_ids, fields
        ):
            if len(chunk_ids) == 1 and np.array_equal(starts[1:], ends[:-1]):
                values = self._leased_view(chunk_ids[0], int(starts[0]), int(ends[-1]))
            else:
                values = self.arena.gather(chunk_ids, which, starts, ends)
            out[name] = dataclasses.replace(header, values=values)
        self._count_read(out, t0)
        return out

    def _leased_view(self, block: int, start: int, end: int) -> np.ndarray:
        """A view of a block's bytes for ``read`` to return. Ray copies it into the object
        store only after ``read`` has returned, when a concurrent clear may have freed the
        block: the view maps it (a closed chunk's pages live on in the mapping) and
        leases it, so it is not recycled for a new write until the view is gone."""
        values = self.arena.view(block, start, end)
        self.arena.lease([block])
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a direct caller without an event loop: the view dies with it
            weakref.finalize(values, self.arena.unlease, [block])
        else:  # the view may die on a Ray thread; the lease goes back on the store's loop
            weakref.finalize(values, loop.call_soon_threadsafe, self.arena.unlease, [block])
        return values

    def read_shm(
        self,
        partition_id: str,
        sample_ids: list[str],
        fields: list[str],
        owner: Hashable | None = None,
        expect: list[int] | None = None,
        closed_seq: int | None = None,
    ) -> dict:
        """Where the fields' bytes sit in shared memory, for a reader on this node to map.

        The chunks named are leased to the reader until it calls ``release_reads``
        (or its process, ``owner``, dies): a leased chunk is never recycled. A field
        of at most ``INLINE_READ_BYTES`` comes back as its bytes instead (no lease).
        ``expect``: as ``read``. ``closed_seq``: the chunk closures the reader knows of;
        the chunks closed since come with the rows (``SharedRows.closures``), so it drops
        its kept mappings of them.
        """
        t0 = time.perf_counter()
        self._check_generations(partition_id, sample_ids, expect)
        out: dict = {}
        lease, leased = self.leases.next_id, []
        closures = None
        for name, (header, chunk_ids, which, starts, ends) in self._rows(
            partition_id, sample_ids, fields
        ):
            if int((ends - starts).sum()) <= INLINE_READ_BYTES:
                values = self.arena.gather(chunk_ids, which, starts, ends)
                out[name] = dataclasses.replace(header, values=values)
            else:
                chunks = [self.arena.ref(c) for c in chunk_ids]
                if closures is None and closed_seq is not None:
                    closures = self._closures(closed_seq)
                which, starts, ends = (_narrowest(a) for a in (which, starts, ends))
                out[name] = SharedRows(header, chunks, which, starts, ends, lease, closures)
                leased.extend(chunk_ids)
        if leased:
            self.leases.lend_reads(leased, owner)
        self._count_read(out, t0)
        return out

    def read_runs(
        self,
        partition_id: str,
        sample_ids: list[str],
        fields: list[str],
        owner: Hashable | None = None,
        expect: list[int] | None = None,
        inline_below: int = INLINE_READ_BYTES,
    ) -> tuple[dict, int | None]:
        """Where the fields' bytes sit, for a reader on another node to pull with a transfer
        engine: per field ``(header, runs)``, ``runs`` the (block, start, nbytes) of its
        bytes in request order, abutting rows of one block merged (one transfer each); a
        field under ``inline_below`` bytes comes back as an EncodedField with its bytes
        instead. The blocks named are leased to the reader (the lease id, or None when none
        was) until it calls ``release_reads`` or its process, ``owner``, dies, so they are
        never recycled under a transfer. ``expect``: as ``read``."""
        t0 = time.perf_counter()
        self._check_generations(partition_id, sample_ids, expect)
        out: dict = {}
        leased: list[int] = []
        nbytes = 0
        for name, (header, chunk_ids, which, starts, ends) in self._rows(
            partition_id, sample_ids, fields
        ):
            size = int((ends - starts).sum())
            nbytes += size
            if size < inline_below or not self.arena.use_shm:
                values = self.arena.gather(chunk_ids, which, starts, ends)
                out[name] = dataclasses.replace(header, values=values)
                continue
            first, last = run_bounds(starts, ends, which)
            blocks = np.asarray(chunk_ids, dtype=np.int64)[which[first]]
            out[name] = (
                header,
                list(
                    zip(
                        blocks.tolist(),
                        starts[first].tolist(),
                        (ends[last] - starts[first]).tolist(),
                    )
                ),
            )
            leased.extend(chunk_ids)
        lease = self.leases.lend_reads(leased, owner) if leased else None
        self.stats.inc("get_bytes_total", nbytes)
        self.stats.inc("get_requests_total")
        self.stats.observe("get_latency_seconds", time.perf_counter() - t0)
        return out, lease

    def chunk(self, block: int) -> shm.MemFd:
        """A block's shared-memory chunk (a transfer engine registers a mapping of it)."""
        store = self.arena.blocks[block].store
        assert isinstance(store, shm.MemFd), "heap blocks are never offered for transfer"
        return store

    def release_reads(self, leases: list[int]) -> None:
        """A reader's mappings of these leases' chunks are gone: they may be recycled."""
        self.leases.release_reads(leases)

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
        dropped, held = part.drop(sample_ids)
        if self.log is not None:
            self.log.drop(partition_id, sample_ids)
        self._release(held)
        self._compact_if_due()
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
        return unit_preview.preview(part, self.arena, part.slot_of[sample_id], fields, max_elems)

    def partition_bytes(self) -> dict[str, int]:
        """Live bytes of data per partition (the rows' own bytes, not the blocks around them)."""
        return {pid: part.live_bytes() for pid, part in self.partitions.items()}

    def holdings(self) -> UnitHoldings:
        return UnitHoldings(
            read_leases=len(self.leases.reads),
            write_leases=len(self.leases.writes),
            write_lease_chunk_bytes=self.leases.region_chunk_bytes(),
            reserve_bytes=self.reserve.held_bytes,
            reserve_settled=self.reserve.settled,
            chunk_prefix=shm.chunk_prefix(),
        )

    def metrics_snapshot(self, node_id: str, node_ip: str) -> UnitSnapshot:
        return UnitSnapshot(
            index=self.index,
            node_id=node_id,
            node_ip=node_ip,
            # Regions leased to writers for their next put count as memory kept ready for
            # writes (like the reserve), not as data; capacity counts them in both.
            bytes=self.used_bytes - self.leases.region_bytes(),
            samples=sum(len(p.slot_of) for p in self.partitions.values()),
            capacity_bytes=self.capacity_bytes,
            warm_reserve_bytes=self.reserve.held_bytes + self.leases.region_chunk_bytes(),
            partition_bytes=self.partition_bytes(),
            stats=self.stats.snapshot(),
        )


def _cell_counts(partitions: dict[str, UnitPartition]) -> dict[int, int]:
    """Per block, the cells pointing into it: the references rows hold (as publish counts)."""
    counts: dict[int, int] = {}
    for part in partitions.values():
        for col in part.columns.values():
            cells = col.chunk[: part.next_slot]
            blocks, n = np.unique(cells[cells >= 0], return_counts=True)
            for b, k in zip(blocks.tolist(), n.tolist()):
                counts[b] = counts.get(b, 0) + k
    return counts
