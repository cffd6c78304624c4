"""A unit's side of the cross-node transfer engine (Mooncake; ``dataplane_client/transport/
payload``): its engine, and its chunks' memory registered with it.

A reader on another node asks ``read_remote`` where a get's bytes sit; the answer names
addresses in this process's mappings of the unit's chunks, registered with the engine,
and the reader pulls them itself (``transfer_sync_read``), with no copy on this side and
nothing through Ray's object store. The unit otherwise holds no mapping of its chunks
(``wire/shm.py``): each is mapped and registered here once, the first time a remote read
names it, and kept while the chunk lives (a recycled chunk keeps its memfd, so its
registration too). A chunk the unit closed is unregistered and unmapped at the next
read or release, unless a read lease of a remote reader still names it: the mapping is
what keeps its pages alive for that reader's transfer (the unit's descriptor is gone).

Registrations made and dropped are counted (``payload_registered_total``,
``payload_unregistered_total``, and ``holdings``), so a test can see that nothing leaks.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np

from dataplane_client.transport.payload import checksum, mooncake
from dataplane_client.transport.payload.base import RAY
from dataplane_client.wire import failpoints, shm
from dataplane_client.wire.encoded import EncodedField
from dataplane_client.wire.errors import CorruptPayload, PayloadTransferFailed, StageReclaimed
from dataplane_client.wire.messages import PayloadOffer, RemoteRows
from dataplane_server.core.unit.store import UnitStore

log = logging.getLogger(__name__)

_PROBE_BYTES = 4096  # what a reader pulls at connect to prove the path works
_CRCS_KEPT = 1 << 16  # runs whose CRC-32C a unit remembers
_PATHS_KEPT = 32  # distinct (path, reason) pairs readers chose that a unit counts
_DETAIL_CHARS = 300


@dataclass
class _Registered:
    mapping: mmap.mmap
    view: np.ndarray  # the whole chunk, for checksums (and the address)
    addr: int


def start_engine(host: str, mode: str) -> tuple[Any, str, str, tuple[str, ...]]:
    """The unit's Mooncake engine on ``host``: (engine, its session "host:port", what it
    moves bytes over, its RDMA devices). Raises as ``mooncake.start_engine`` does."""
    engine = mooncake.start_engine(host, mode)
    protocol, devices = mooncake.transport_of(engine)
    return engine, f"{host}:{engine.get_rpc_port()}", protocol, devices


class UnitPayload:
    """The engine and the registered chunks of one unit (one per ``StorageUnit``; every
    method runs on the unit's event loop, between awaits, as the store's do)."""

    def __init__(self, store: UnitStore, host: str, mode: str, min_bytes: int):
        self.store, self.host, self.mode, self.min_bytes = store, host, mode, min_bytes
        self._offer: PayloadOffer | None = None
        self._starting: asyncio.Task | None = None
        self._engine: Any = None
        self._session = ""
        self._chunks: dict[str, _Registered] = {}  # chunk name -> its registered mapping
        self._leases: dict[int, set[str]] = {}  # remote read lease -> chunk names it names
        self._closed_seq = 0  # the arena's chunk closures already acted on
        self._pending: set[str] = set()  # closed chunks a live remote lease still names
        # Remote writes not yet verified: write id -> (writer, {field: (chunk, offset, n)}).
        self._writes: dict[str, tuple[Hashable | None, dict[str, tuple[str, int, int]]]] = {}
        self._probe: np.ndarray | None = None
        # (block, start, nbytes) -> CRC-32C, least recently used first (see ``_crc``).
        self._crcs: OrderedDict[tuple[int, int, int], int] = OrderedDict()
        # (backend, detail) -> reader processes on other nodes whose probe chose it.
        self._chosen: dict[tuple[str, str], int] = {}

    # ---- the offer: what a reader's capability probe asks --------------------------
    async def offer(self) -> PayloadOffer:
        """How this unit serves readers on other nodes; the engine starts on the first ask
        (in a thread: about 0.8 s here), never at unit start, so a service nobody reads
        across nodes runs none."""
        if self._offer is None:
            if self._starting is None:
                self._starting = asyncio.get_running_loop().create_task(self._start())
            await asyncio.shield(self._starting)
        assert self._offer is not None
        return self._offer

    async def _start(self) -> None:
        if self.mode == RAY:
            self._offer = PayloadOffer(RAY, reason="cross_node_transport is 'ray'")
        elif not self.store.arena.use_shm:
            self._offer = PayloadOffer(RAY, reason="the unit keeps no shared-memory chunks")
        elif checksum.missing() is not None:
            self._offer = PayloadOffer(RAY, reason=f"on the unit's node, {checksum.missing()}")
        else:
            try:
                self._engine, self._session, protocol, devices = await asyncio.to_thread(
                    start_engine, self.host, self.mode
                )
                self._probe = np.frombuffer(os.urandom(_PROBE_BYTES), dtype=np.uint8).copy()
                self._register(self._probe.ctypes.data, _PROBE_BYTES)
            except Exception as e:  # noqa: BLE001 - any failure means the Ray path, with its reason
                self._engine = None
                reason = f"Mooncake unavailable on the unit's node: {type(e).__name__}: {e}"
                self._offer = PayloadOffer(RAY, reason=reason)
            else:
                probe = (self._probe.ctypes.data, _PROBE_BYTES, checksum.of(self._probe.data))
                self._offer = PayloadOffer(
                    mooncake.backend_name(protocol),
                    session=self._session,
                    probe=probe,
                    min_bytes=self.min_bytes,
                    devices=devices,
                )
        log.info("unit %d: cross-node payload %s", self.store.index, self._offer)

    def chosen(self, backend: str, detail: str) -> None:
        """A reader process on another node chose how it reaches this unit's bytes (its
        probe's answer, sent once as it connects): shown in ``dataplane status`` and the
        ``dataplane_payload_path_choices`` metric. Distinct reasons are few (a reason
        names a cause, not a reader), and capped in case one ever does not."""
        key = (backend, detail[:_DETAIL_CHARS])
        if key in self._chosen or len(self._chosen) < _PATHS_KEPT:
            self._chosen[key] = self._chosen.get(key, 0) + 1

    def paths(self) -> list[tuple[str, str, int]]:
        """(backend, detail, reader processes) per path readers chose, most chosen first."""
        return sorted(((b, d, n) for (b, d), n in self._chosen.items()), key=lambda p: -p[2])

    # ---- reads ----------------------------------------------------------------------
    def read(
        self,
        partition_id: str,
        sample_ids: list[str],
        fields: list[str],
        owner: Hashable | None,
        expect: list[int] | None,
    ) -> dict[str, EncodedField | RemoteRows]:
        """Per field, its bytes (a small one) or where to pull them (``RemoteRows``, under
        one read lease of ``owner``), each with the CRC-32C the reader checks."""
        if self._engine is None:
            raise PayloadTransferFailed(
                f"unit {self.store.index} runs no transfer engine ({self._offer})"
            )
        self.prune()
        runs, lease = self.store.read_runs(
            partition_id, sample_ids, fields, owner, expect, inline_below=self.min_bytes
        )
        out: dict[str, EncodedField | RemoteRows] = {}
        named: set[str] = set()
        try:
            for name, part in runs.items():
                if isinstance(part, EncodedField):
                    out[name] = part
                    continue
                header, field_runs = part
                segments, crcs = [], []
                for block, start, nbytes in field_runs:
                    chunk = self._registered(block)
                    named.add(self.store.chunk(block).name)
                    segments.append((chunk.addr + start, nbytes))
                    crcs.append(self._crc(block, chunk, start, nbytes))
                assert lease is not None  # a field with runs leased its blocks
                out[name] = RemoteRows(header, segments, crcs, lease)
        except BaseException:
            if lease is not None:
                self.store.release_reads([lease])
            raise
        if lease is not None:
            self._leases[lease] = named
        return out

    # ---- writes -----------------------------------------------------------------------
    async def alloc(
        self,
        partition_id: str,
        write_id: str,
        sample_ids: list[str],
        headers: dict[str, EncodedField],
        owner: Hashable | None,
        expires_at: float | None,
        group_rows: dict[str, np.ndarray] | None,
    ) -> dict[str, tuple[int, int]]:
        """Stage a write for a writer on another node: per field, the (address, length) in
        registered memory it pushes its bytes to. Its chunk stays registered until the
        writer says it is done (``verify`` or ``discard``) or its process dies, even if the
        stage is reclaimed meanwhile: a late transfer must land in the old chunk, never in
        memory mapped later at the same address."""
        if self._engine is None:
            raise PayloadTransferFailed(
                f"unit {self.store.index} runs no transfer engine ({self._offer})"
            )
        regions = await self.store.alloc_regions(
            partition_id, write_id, sample_ids, headers, owner, expires_at, group_rows
        )
        out, where = {}, {}
        for name, (block, offset) in regions.items():
            chunk = self._registered(block)
            nbytes = headers[name].nbytes
            out[name] = (chunk.addr + offset, nbytes)
            where[name] = (self.store.chunk(block).name, offset, nbytes)
        self._writes[write_id] = (owner, where)
        return out

    def verify(self, write_id: str, crcs: dict[str, int]) -> None:
        """Check the bytes a remote writer pushed against the CRC-32C it computed of what it
        sent, before it commits: CorruptPayload naming the fields that differ (the writer
        pushes once more, then gives up and discards). Done either way for this attempt's
        bookkeeping only when they match."""
        held = self._writes.get(write_id)
        if held is None:
            raise StageReclaimed(
                f"unit {self.store.index}: no remote write {write_id} awaits its bytes "
                "(reclaimed, or discarded)",
                queue="stage",
            )
        _, where = held
        bad = []
        for name, (chunk_name, offset, nbytes) in where.items():
            chunk = self._chunks[chunk_name]
            got = checksum.of(chunk.view[offset : offset + nbytes].data)
            if got != crcs.get(name):
                bad.append(name)
        if bad:
            self.store.stats.inc("payload_put_corrupt_total")
            raise CorruptPayload(
                f"unit {self.store.index}: the bytes pushed for write {write_id} do not match "
                "the writer's CRC-32C",
                fields=bad,
            )
        del self._writes[write_id]

    def forget_write(self, write_id: str) -> None:
        """The writer gave up on a remote write (its stage is discarded)."""
        self._writes.pop(write_id, None)

    def owners(self) -> set:
        """Remote writers whose death frees a chunk (the sweeper watches them)."""
        return {owner for owner, _ in self._writes.values() if owner is not None}

    def writers_died(self, dead: set) -> None:
        """Their transfers ended with them: their stages' chunks may go."""
        for wid in [w for w, (owner, _) in self._writes.items() if owner in dead]:
            del self._writes[wid]

    def release(self, leases: list[int]) -> None:
        """A remote reader pulled these leases' bytes (or gave up): its chunks may go."""
        self.store.release_reads(leases)
        for lease in leases:
            self._leases.pop(lease, None)
        self.prune()

    def _crc(self, block: int, chunk: _Registered, start: int, nbytes: int) -> int:
        """The CRC-32C of a block's bytes [start, start + nbytes), remembered: published
        bytes never change while their block lives (``arena``: space is handed out once),
        and block ids are never reused, so a later read of the same run costs nothing (a
        128 MiB field costs about 25 ms here)."""
        key = (block, start, nbytes)
        crc = self._crcs.get(key)
        if crc is None:
            crc = checksum.of(chunk.view[start : start + nbytes].data)
            self._crcs[key] = crc
            if len(self._crcs) > _CRCS_KEPT:
                self._crcs.popitem(last=False)
        else:
            self._crcs.move_to_end(key)
        return crc

    # ---- registrations --------------------------------------------------------------
    def _registered(self, block: int) -> _Registered:
        memfd = self.store.chunk(block)
        chunk = self._chunks.get(memfd.name)
        if chunk is None:
            # Writable: writers on other nodes put their stages' bytes in through it.
            mapping = mmap.mmap(
                memfd.fd, memfd.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
            )
            view = np.frombuffer(mapping, dtype=np.uint8)
            addr = view.ctypes.data
            try:
                self._register(addr, memfd.size)
            except BaseException:
                del view
                mapping.close()
                raise
            chunk = self._chunks[memfd.name] = _Registered(mapping, view, addr)
        return chunk

    def _register(self, addr: int, nbytes: int) -> None:
        """Register memory with the engine; PayloadTransferFailed when it refuses (counted):
        the reader then reads those rows through Ray, and nothing stays registered."""
        if failpoints.countdown_if_armed(failpoints.PAYLOAD_REGISTER):
            rc = -1  # as the engine answers when it cannot pin the memory
        else:
            rc = self._engine.register_memory(addr, nbytes)
        if rc != 0:
            self.store.stats.inc("payload_register_failures_total")
            raise PayloadTransferFailed(
                f"unit {self.store.index}: Mooncake register_memory({nbytes} bytes) returned {rc}"
            )
        self.store.stats.inc("payload_registered_total")

    def prune(self) -> None:
        """Unregister and unmap the chunks the unit closed that no remote lease names (a
        lease ended by its reader's death is gone from the store's books too)."""
        live = self.store.leases.reads
        for lease in [x for x in self._leases if x not in live]:
            del self._leases[lease]
        closed, self._closed_seq, reset = self.store.arena.closed_since(self._closed_seq)
        if reset:  # too many closures to list: whatever the arena does not hold now
            held = {
                b.store.name
                for b in self.store.arena.blocks.values()
                if isinstance(b.store, shm.MemFd)
            }
            closed = [n for n in self._chunks if n not in held]
        in_use = self._in_use()
        # A closed chunk still named by a lease stays: looked at again on a later prune.
        self._pending = {n for n in (*closed, *self._pending) if n in self._chunks}
        for name in [n for n in self._pending if n not in in_use]:
            self._unregister(name)
            self._pending.discard(name)

    def _unregister(self, name: str) -> None:
        chunk = self._chunks.pop(name)
        self._engine.unregister_memory(chunk.addr)
        self.store.stats.inc("payload_unregistered_total")
        del chunk.view  # the mapping closes only once no array exports its buffer
        chunk.mapping.close()

    def registered(self) -> int:
        """Chunks registered now (tests: nothing leaks)."""
        return len(self._chunks)

    def orphans(self) -> int:
        """Registered chunks the unit neither holds nor keeps warm, and no remote lease
        names: what a leak would look like (0 once a prune has run; tests)."""
        arena = self.store.arena
        kept = {b.store.name for b in arena.blocks.values() if isinstance(b.store, shm.MemFd)}
        kept |= {c.name for c in arena.reserve.ready_chunks()}
        in_use = self._in_use()
        return sum(1 for n in self._chunks if n not in kept and n not in in_use)

    def _in_use(self) -> set[str]:
        """Chunks a remote reader's lease names, or a remote writer may still push into."""
        names: set[str] = set().union(*self._leases.values()) if self._leases else set()
        for _, where in self._writes.values():
            names.update(chunk_name for chunk_name, _, _ in where.values())
        return names

    def close(self) -> None:
        for name in list(self._chunks):
            self._unregister(name)
