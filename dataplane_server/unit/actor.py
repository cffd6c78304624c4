"""StorageUnit: the Ray actor around one :class:`~dataplane_server.core.unit.store.UnitStore`.

The store holds the bytes and every rule about them (staging, publish, leases,
reads, checkpoints, recovery, previews, figures) and runs without Ray. This
shell owns what needs Ray:

- who the unit is: its node id and the address Ray registered for that node;
- writers' and readers' process tokens: each call may pass ``[ObjectRef]``, an
  object the caller's process owns; the store keeps it as an opaque token (a
  same-node reader sends its once, then its key: ``reader_tokens``);
- telling whether such a process died: resolving its object raises
  ``OwnerDiedError`` once the owner is gone, so a killed writer's stage or a dead
  reader's leases come back within a sweep or two instead of a whole deadline;
- the sweeper, a background task started with the first stage or lease.

Remote method names and signatures are the unit's wire interface (the client's
transport, the controller's commit, recovery and checkpoints, the admin
endpoint call them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from typing import Any

import numpy as np
import ray

from dataplane_client.wire import failpoints, parallel_copy
from dataplane_client.wire.config import DataPlaneConfig
from dataplane_client.wire.encoded import EncodedField
from dataplane_client.wire.errors import DataPlaneError, InvalidBatch
from dataplane_client.wire.messages import (
    PayloadOffer,
    ShmAlloc,
    UnitInfo,
    UnitSnapshot,
    pack_read_answer,
)
from dataplane_server.core.recovery_messages import (
    DumpedFile,
    DumpedUnit,
    SampleMeta,
    UnitRecovery,
)
from dataplane_server.core.unit import durable_layout
from dataplane_server.core.unit.store import UnitHoldings, UnitStore
from dataplane_server.unit.payload import UnitPayload
from dataplane_server.unit.reader_tokens import ReaderTokens

_STAGE_CALLS = frozenset({"stage", "alloc_shm", "stage_leased"})  # what stage_many runs


def _owner(owner: list | None) -> ray.ObjectRef | None:
    """The caller's process token: ``[ObjectRef]`` (a list, so Ray passes the ref itself
    instead of resolving it), or None."""
    return owner[0] if owner else None


def _read_request(verb: str, request: Any) -> tuple:
    """``messages.read_request``'s 6-tuple, or InvalidBatch naming the verb given another."""
    if not isinstance(request, tuple) or len(request) != 6:
        raise InvalidBatch(f"{verb} takes messages.read_request's 6-tuple, not {request!r:.200}")
    return request


@ray.remote
class StorageUnit:
    def __init__(self, index: int, config: DataPlaneConfig):
        failpoints.sleep_if_armed(failpoints.UNIT_START)
        parallel_copy.configure(config)  # this process's large copies follow the service
        # Durable levels: chunk files and a row index that a restarted process re-attaches.
        files, log = durable_layout.open_unit(config, index)
        self.store = UnitStore(
            index,
            config.unit_capacity_bytes,
            put_wait_timeout_s=config.put_wait_timeout_s,
            use_shm=True,
            warm_reserve_bytes=config.unit_warm_reserve_bytes,
            stage_ttl_s=config.stage_ttl_s,
            files=files,
            log=log,
        )
        self._sweeper: asyncio.Task | None = None
        self._readers = ReaderTokens()  # same-node readers name their process token by key
        self.node_id = ray.get_runtime_context().get_node_id()
        # The address Ray registered for this node (127.0.0.1 on loopback clusters),
        # not the machine's default-route guess.
        self.node_ip = next(
            (n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == self.node_id),
            ray.util.get_node_ip_address(),
        )
        # Readers on other nodes pull through a transfer engine where one runs (started on
        # the first reader's probe, not here).
        self.payload = UnitPayload(
            self.store, self.node_ip, config.cross_node_transport, config.transfer_min_bytes
        )

    # ---- identity / health ------------------------------------------------------
    async def ping(self) -> UnitInfo:
        await failpoints.pause_if_armed(failpoints.UNIT_PING)  # tests: a unit slow to answer
        return UnitInfo(
            self.store.index, self.node_id, self.node_ip, os.getpid(), self.store.use_shm
        )

    # ---- write path ---------------------------------------------------------------
    async def stage(
        self,
        partition_id: str,
        write_id: str,
        sample_ids: list[str],
        encoded: dict[str, EncodedField],
        owner: list | None = None,
        expires_at: float | None = None,
        group_rows: dict[str, np.ndarray] | None = None,
    ) -> int:
        """Copy a write's bytes in (through Ray), invisible until publish. Returns bytes staged."""
        self._start_sweeper()
        return await self.store.stage(
            partition_id,
            write_id,
            sample_ids,
            encoded,
            _owner(owner),
            expires_at,
            group_rows,
        )

    async def alloc_shm(
        self,
        partition_id: str,
        write_id: str,
        sample_ids: list[str],
        headers: dict[str, EncodedField],
        owner: list | None = None,
        closed_seq: int = -1,
        expires_at: float | None = None,
        group_rows: dict[str, np.ndarray] | None = None,
    ) -> ShmAlloc:
        """Stage a same-node write whose bytes the client copies into shared memory itself."""
        self._start_sweeper()
        return await self.store.alloc_shm(
            partition_id,
            write_id,
            sample_ids,
            headers,
            _owner(owner),
            closed_seq,
            expires_at,
            group_rows,
        )

    async def stage_leased(
        self,
        partition_id: str,
        write_id: str,
        sample_ids: list[str],
        headers: dict[str, EncodedField],
        owner: list | None,
        lease: int,
        closed_seq: int = -1,
        expires_at: float | None = None,
        group_rows: dict[str, np.ndarray] | None = None,
    ) -> ShmAlloc | None:
        """Stage a same-node write into the region of a ``WriteLease`` this writer holds
        (None: the lease is gone, nothing was staged)."""
        self._start_sweeper()
        return await self.store.stage_leased(
            partition_id,
            write_id,
            sample_ids,
            headers,
            _owner(owner),
            lease,
            closed_seq,
            expires_at,
            group_rows,
        )

    async def stage_many(self, calls: list[tuple[str, tuple]]) -> list:
        """Many small stages of one writer process in one call (``Transport``'s batcher):
        each ``(method, args)`` is one of the three stage calls above, run concurrently
        (one may wait for room while the others go on); one answer per call, in order, a
        failed call's error as its answer."""
        for method, _ in calls:
            if method not in _STAGE_CALLS:
                raise InvalidBatch(f"stage_many: {method!r} is not a stage call")
        return await asyncio.gather(
            *[getattr(self, method)(*args) for method, args in calls], return_exceptions=True
        )

    def prepare(self, write_id: str, meta: SampleMeta, staged_units: list[int]) -> None:
        self.store.prepare(write_id, meta, staged_units)

    def publish(self, write_id: str, meta: SampleMeta | None = None) -> bool:
        return self.store.publish(write_id, meta)

    def publish_many(self, writes: list[tuple[str, SampleMeta | None]]) -> list:
        """Many commits' publishes in one call (the controller's ``publish.UnitBatches``):
        one answer per write, in order, a refused write's typed error as its answer."""
        out: list = []
        for write_id, meta in writes:
            try:
                out.append(self.store.publish(write_id, meta))
            except DataPlaneError as e:
                out.append(e)
        return out

    def unpublish(
        self, partition_id: str, write_id: str, sample_ids: list[str] | None = None
    ) -> int:
        """Undo only what publishing ``write_id`` filled (fields the samples had stay)."""
        return self.store.unpublish(partition_id, write_id, sample_ids)

    def discard(self, write_id: str) -> None:
        self.store.discard(write_id)
        self.payload.forget_write(write_id)

    def staged_write_ids(self) -> list[str]:
        return self.store.staged_write_ids()

    # ---- recovery and checkpoints ------------------------------------------------
    def recovery_view(self) -> UnitRecovery:
        return self.store.recovery_view()

    async def pin_checkpoint(self, checkpoint_id: str) -> None:
        self._start_sweeper()  # it releases a pin whose controller died before the copy
        self.store.pin_checkpoint(checkpoint_id)

    async def write_checkpoint(
        self,
        checkpoint_id: str,
        directory: str,
        cut: dict[str, list[str]],
        parent_dir: str | None = None,
        parent_files: list[DumpedFile] | None = None,
        copy_share: float = 1.0,
    ) -> DumpedUnit:
        return await self.store.write_checkpoint(
            checkpoint_id, directory, cut, parent_dir, parent_files, copy_share
        )

    def load(self, directory: str, files: list[DumpedFile]) -> int:
        return self.store.load(directory, files)

    # ---- read path ----------------------------------------------------------------
    def read(
        self,
        partition_id: str,
        sample_ids: list[str],
        fields: list[str],
        expect: list[int] | None = None,
    ) -> dict[str, EncodedField]:
        """The fields' bytes, shipped through Ray (cross-node reads); ``expect``: the
        generations a direct read means (``UnitStore.read``)."""
        return self.store.read(partition_id, sample_ids, fields, expect)

    def read_shm(self, request: tuple) -> bytes:
        """Where the fields' bytes sit in shared memory, leased to a same-node reader
        (with the chunks closed since ``closed_seq``).

        ``request``: ``messages.read_request``'s tuple, and the answer comes back pickled
        (``messages.unpack_read_answer``): this call's floor is one round trip, and Ray
        serialises each argument on its own (about 0.06 ms each) and ships an answer's
        small numpy arrays out of band (about 0.2 ms more than the same answer as bytes).
        """
        partition_id, sample_ids, fields, owner, expect, closed_seq = _read_request(
            "read_shm", request
        )
        if failpoints.once_if_armed(failpoints.READER_TOKENS_LOST):
            self._readers.forget_all()
        out = self.store.read_shm(
            partition_id, sample_ids, fields, self._readers.resolve(owner), expect, closed_seq
        )
        if self.store.leases.reads:
            self._start_sweeper()  # a dead reader's leases are released by the sweeper
        return pack_read_answer(out)

    async def payload_offer(self) -> PayloadOffer:
        """How readers on other nodes may pull this unit's bytes (a client's capability
        probe at connect; the unit's transfer engine starts on the first ask)."""
        return await self.payload.offer()

    def payload_chosen(self, backend: str, detail: str) -> None:
        """A reader on another node reports the path its probe chose to this unit."""
        self.payload.chosen(backend, detail)

    def read_remote(self, request: tuple) -> bytes:
        """Where the fields' bytes sit in this unit's registered memory, for a reader on
        another node to pull with its transfer engine (small fields come inline), under a
        read lease it gives back with ``release_remote``. ``request``: as ``read_shm``'s;
        the answer is one in-band pickle."""
        partition_id, sample_ids, fields, owner, expect, _ = _read_request("read_remote", request)
        out = self.payload.read(
            partition_id, sample_ids, fields, self._readers.resolve(owner), expect
        )
        if self.store.leases.reads:
            self._start_sweeper()  # a dead reader's leases are released by the sweeper
        return pack_read_answer(out)

    def release_remote(self, leases: list[int]) -> None:
        self.payload.release(leases)

    async def alloc_remote(
        self,
        partition_id: str,
        write_id: str,
        sample_ids: list[str],
        headers: dict[str, EncodedField],
        owner: list | None = None,
        expires_at: float | None = None,
        group_rows: dict[str, np.ndarray] | None = None,
    ) -> dict[str, tuple[int, int]]:
        """Stage a write whose writer, on another node, pushes its bytes with its transfer
        engine: per field, the (address, length) to push to; then ``verify_remote``."""
        self._start_sweeper()
        return await self.payload.alloc(
            partition_id, write_id, sample_ids, headers, _owner(owner), expires_at, group_rows
        )

    def verify_remote(self, write_id: str, crcs: dict[str, int]) -> None:
        """The pushed bytes against the writer's CRC-32 per field (CorruptPayload if not)."""
        self.payload.verify(write_id, crcs)

    def meet(self, owner: list) -> None:
        """A same-node client's process token, sent once as it connects
        (``Transport.introduce``): its reads name it by key from the first on."""
        self._readers.resolve(owner)

    def release_reads(self, leases: list[int]) -> None:
        self.store.release_reads(leases)

    def recycled_chunks(self) -> int:
        return self.store.recycled_chunks()

    def clear(self, partition_id: str, sample_ids: list[str] | None) -> int:
        return self.store.clear(partition_id, sample_ids)

    # ---- inspection ---------------------------------------------------------------
    def preview(
        self, partition_id: str, sample_id: str, fields: list[str] | None, max_elems: int
    ) -> dict:
        return self.store.preview(partition_id, sample_id, fields, max_elems)

    def partition_bytes(self) -> dict[str, int]:
        return self.store.partition_bytes()

    def holdings(self) -> UnitHoldings:
        """Leases out, memory kept ready and readers remembered (tests and inspection)."""
        return dataclasses.replace(
            self.store.holdings(),
            reader_tokens=len(self._readers),
            payload_registered=self.payload.registered(),
            payload_orphans=self.payload.orphans(),
        )

    def metrics_snapshot(self) -> UnitSnapshot:
        snap = self.store.metrics_snapshot(self.node_id, self.node_ip)
        snap.stats["payload_paths"] = self.payload.paths()  # readers' cross-node paths
        return snap

    # ---- reclaiming what dead or silent processes left ------------------------------
    def _start_sweeper(self) -> None:
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        """Reclaim stages and write leases past their deadline, and whatever a process
        that died held: its unpinned stages, its write lease, its read leases."""
        every_s = min(self.store.stage_ttl_s / 4, 1.0)
        while True:
            await asyncio.sleep(every_s)  # a periodic timer, not synchronisation
            try:
                self.store.reclaim_expired()
                self.store.release_unwritten_checkpoints()
                watched = list(self.store.watched_owners() | self.payload.owners())
                died = await asyncio.gather(*[_owner_died(o, every_s) for o in watched])
                gone = {o for o, dead in zip(watched, died) if dead}
                self.store.owners_died(gone)
                self._readers.forget(gone)
                self.payload.writers_died(gone)
                self.payload.prune()  # chunks only a dead remote reader or writer kept
            except Exception:  # noqa: BLE001 - a failed sweep must not end sweeping; it is counted
                self.store.stats.inc("stage_sweep_errors_total")


async def _owner_died(owner: ray.ObjectRef, timeout_s: float) -> bool:
    try:
        await asyncio.wait_for(owner, timeout_s)
    except ray.exceptions.OwnerDiedError:
        return True
    except Exception:  # noqa: BLE001 - slow or unreachable is no proof of death: the deadline decides
        return False
    return False
