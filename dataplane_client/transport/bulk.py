"""The bulk-data seam: how encoded bytes travel between a client and the units.

Everything above this module speaks ``EncodedField`` and flows (see client.py);
below it there are two paths, chosen per unit:

- same node (the unit's node is ours and it keeps chunks in shared memory): a
  put allocates the region in the unit and copies the rows straight into it,
  through this process's kept mapping of the chunk (``shm.write_maps``); a get
  views contiguous rows through this process's kept copy-on-write mapping of the
  chunk (no copy) and gathers any others out of its kept read-only mapping (see
  ``assembly.assemble``), holding the unit's read lease on the chunks
  (:class:`ReadLease`) until its last view is gone;
- otherwise through Ray actor calls whose numpy buffers Ray moves out-of-band.

A put's CUDA tensor is copied device-to-host straight into the unit's region
(``devices.copy_rows_to_host``); through Ray it goes to host memory first.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import threading
import time
from collections.abc import Callable, Generator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import ray

from dataplane_client.codec import devices
from dataplane_client.transport.call_batcher import CallBatcher
from dataplane_client.transport.payload import mooncake, probe
from dataplane_client.transport.payload.base import MOONCAKE, PayloadBackend, RayObjects
from dataplane_client.wire import group_fields, parallel_copy, shm
from dataplane_client.wire.encoded import EncodedField, row_copy_pairs, take_rows
from dataplane_client.wire.errors import DataPlaneError, PayloadTransferFailed, ReaderUnknown
from dataplane_client.wire.messages import (
    ChunkClosures,
    ChunkRef,
    PayloadPath,
    SharedRows,
    ShmAlloc,
    WriteLease,
    read_request,
    unpack_read_answer,
)

log = logging.getLogger(__name__)

Flow = Generator[list, list, Any]
_RAY_OBJECTS = RayObjects()
_PULL_THREADS = 8  # units pulled from at once by this process's gets (each blocks a thread)
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _pull_pool() -> ThreadPoolExecutor:
    """The threads transfer-engine pulls run on (made on first use: a process that never
    reads across nodes through an engine starts none)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_PULL_THREADS, thread_name_prefix="dataplane-pull")
        return _pool


# A stage of at most this many bytes goes to its unit with the other small stages of this
# process in one ``stage_many`` call; a larger one is a call of its own (its copy, not a
# round trip, is its cost, and it must not hold small ones back).
BATCHED_STAGE_BYTES = 1 << 20
MAX_STAGE_BATCH = 512  # stages per stage_many call


class SharedMemoryUnavailable(DataPlaneError):
    """This process could not copy into a same-node unit's shared memory; the write is
    staged again through Ray (``unit``: which unit)."""

    def __init__(self, message: str, unit: int | None = None, **kwargs: Any):
        super().__init__(message, **kwargs)
        self.unit = unit


class StagedRegionGone(SharedMemoryUnavailable):
    """The region a unit staged for this write was reclaimed before the copy (the
    stage expired, or a write lease was taken back); nothing of the write is visible,
    and the writer stages again in shared memory, without a lease."""


class ReadLease:
    """A unit's lease on the chunks one read named, released when this object goes.

    The read's parts (``SharedRows``) and every view made of them hold it, so it goes
    with the last of those (the tensors the caller kept). The release is one message,
    not awaited.
    """

    def __init__(self, unit: Any, lease: int):
        self.unit, self.lease = unit, lease

    def __del__(self) -> None:
        try:
            self.unit.release_reads.remote([self.lease])
        except Exception:  # noqa: BLE001 - Ray shut down or the unit is gone: nothing to release
            pass


_INTRODUCE_TIMEOUT_S = 5.0  # how long connect() waits for the same-node units to answer


class Transport:
    def __init__(
        self,
        unit_handles: list,
        unit_nodes: list[str | None],
        unit_shm: list[bool],
        local_node: str | None,
        use_shm: bool = True,
        wait: Callable[[Any], Any] = ray.get,
        cross_node_transport: str = "auto",
        alive: list[bool] | None = None,
        transfer_puts: bool = False,
    ):
        self.units = list(unit_handles)
        self._nodes, self._local_node = list(unit_nodes), local_node
        self._alive = list(alive) if alive is not None else [True] * len(self.units)
        self._cross_node_mode = cross_node_transport
        self._transfer_puts = transfer_puts  # large cross-node stages pushed by the engine
        # How we reach each unit's bytes (``payload.probe``), chosen once: at connect, or by
        # the first read that needs it. Read without the lock once set (rebound, never
        # changed in place).
        self._paths: list[PayloadPath] | None = None
        self._backends: dict[int, PayloadBackend] = {}
        self._paths_lock = threading.Lock()
        self._wait = wait  # how a batch sender waits for its call (the client's, typed)
        self._batchers: dict[int, CallBatcher] = {}  # unit -> its small stages' batcher
        self._batchers_lock = threading.Lock()
        self.shared = [
            bool(use_shm and ok and node == local_node and local_node is not None)
            for node, ok in zip(unit_nodes, unit_shm)
        ]
        self._owner: ray.ObjectRef | None = None
        self._token_sent: set[int] = set()  # units we sent our process token to
        self._closed_seq = [-1] * len(self.units)  # per unit: the chunk closures we know of
        # Per unit: the region it set aside for our next write, and when we got it. Puts of
        # several threads (and coroutines) take and replace it: only under this lock, so no
        # two puts ever copy into one leased region.
        self._leases: list[tuple[WriteLease, float] | None] = [None] * len(self.units)
        self._lease_lock = threading.Lock()

    def _stage_owner(self) -> list:
        """A boxed object this process owns: units reclaim our stages once it is gone.

        Resolving it raises ``OwnerDiedError`` after this process dies, which is how
        a unit learns of a writer's death without any other service. Boxed in a list
        so Ray passes the reference itself, not its value.
        """
        if self._owner is None:
            self._owner = ray.put(None)
        return [self._owner]

    # ---- writes -------------------------------------------------------------------
    def stage_flow(
        self,
        partition_id: str,
        write_id: str,
        sample_ids: list[str],
        encoded: dict[str, EncodedField],
        plan: dict[int, np.ndarray],
        *,
        via_ray: frozenset[int] = frozenset(),
        use_leases: bool = True,
        expires_at: float | None = None,
        shared: dict[str, np.ndarray] | None = None,
    ) -> Flow:
        """Stage a write's rows on each unit of ``plan``; returns one result (or error) per unit.

        Same node, with a lease from this unit's last answer that the write fits
        in: the stage call goes out first and the rows are copied into the leased
        region while it travels (allocation costs no round trip of its own).
        Otherwise the unit allocates, then the rows are copied. ``via_ray``: units
        this write reaches through Ray whatever ``shared`` says; ``use_leases``
        False: allocate anew (a retry after a lease was reclaimed under us);
        ``expires_at``: the put's deadline (``put_deadline``), which each unit keeps;
        ``shared``: group fields (``group_fields.share``), whose encoded rows are one per
        group; each unit gets the rows its samples need and who reads which.

        How each unit was staged is decided once, here, and kept in this flow:
        ``shared`` may change while the stage calls travel (another put of this
        client can find a unit unusable), and a write staged in shared memory must
        still get its copy, or its commit would publish the unit's zeroed region.
        """
        refs, owner = [], self._stage_owner()
        in_shm = {u: self.shared[u] and u not in via_ray for u in plan}
        # unit -> (per field, the rows it gets; the backend that pushes them)
        pushed: dict[int, tuple[dict[str, np.ndarray], mooncake.Mooncake]] = {}
        copied: dict[int, BaseException | None] = {}  # unit -> error of a copy made up front
        rows_of: dict[int, dict[str, np.ndarray]] = {}  # unit -> per field, the rows it gets
        for u, rows in plan.items():
            ids = [sample_ids[i] for i in rows]
            rows_of[u], positions = group_fields.rows_for_unit(list(encoded), shared or {}, rows)
            group_rows = positions or None  # sent only for group fields
            if in_shm[u]:
                headers = {
                    k: take_rows(e, rows_of[u][k], header_only=True) for k, e in encoded.items()
                }
                sizes = [h.nbytes for h in headers.values()]
                lease = self._take_lease(u, sizes) if use_leases else None
                nbytes = sum(sizes)
                if lease is not None:
                    call = self._stage_call(
                        u,
                        nbytes,
                        "stage_leased",
                        (
                            partition_id,
                            write_id,
                            ids,
                            headers,
                            owner,
                            lease.lease,
                            self._closed_seq[u],
                            expires_at,
                            group_rows,
                        ),
                    )
                    offsets, _ = shm.layout(sizes)
                    base = lease.region.offset
                    targets = [
                        (enc, lease.region.chunk, base + off, rows_of[u][k])
                        for (k, enc), off in zip(encoded.items(), offsets)
                    ]
                    copied[u] = self._copy_in(u, targets)
                else:
                    call = self._stage_call(
                        u,
                        nbytes,
                        "alloc_shm",
                        (
                            partition_id,
                            write_id,
                            ids,
                            headers,
                            owner,
                            self._closed_seq[u],
                            expires_at,
                            group_rows,
                        ),
                    )
            else:
                headers = {
                    k: take_rows(e, rows_of[u][k], header_only=True) for k, e in encoded.items()
                }
                nbytes = sum(h.nbytes for h in headers.values())
                backend = self.backend(u) if self._transfer_puts and u not in via_ray else None
                # Small stages go batched through Ray (cheaper than a push's round trips).
                if nbytes > BATCHED_STAGE_BYTES and isinstance(backend, mooncake.Mooncake):
                    # Through the transfer engine: the unit sets the region aside, we push.
                    pushed[u] = (rows_of[u], backend)
                    call = self.units[u].alloc_remote.remote(
                        partition_id, write_id, ids, headers, owner, expires_at, group_rows
                    )
                else:
                    parts = {k: take_rows(e, rows_of[u][k]) for k, e in encoded.items()}
                    call = self._stage_call(
                        u,
                        nbytes,
                        "stage",
                        (partition_id, write_id, ids, parts, owner, expires_at, group_rows),
                    )
            refs.append(call)
        results = yield refs
        units = list(plan)
        pushes = [i for i, u in enumerate(units) if u in pushed and isinstance(results[i], dict)]
        if pushes:  # the bytes of each, pushed and checked on the pull threads
            pool = _pull_pool()
            done = yield [
                pool.submit(
                    mooncake.MooncakePush(pushed[units[i]][1]).push,
                    self.units[units[i]],
                    write_id,
                    {
                        k: take_rows(e, pushed[units[i]][0][k]).require_values()
                        for k, e in encoded.items()
                    },
                    results[i],
                    expires_at,
                )
                for i in pushes
            ]
            for i, r in zip(pushes, done):
                results[i] = r
                if isinstance(r, BaseException):  # staged, but its bytes never arrived intact
                    self.discard(units[i], write_id)  # not awaited
        for i, u in enumerate(plan):
            if not in_shm[u] or isinstance(results[i], BaseException):
                continue
            alloc: ShmAlloc | None = results[i]
            if alloc is None:  # the unit took the lease back: the copy went nowhere visible
                results[i] = StagedRegionGone(f"unit {u}: its write lease was reclaimed")
                continue
            self._learn_closures(u, alloc.closures)
            with self._lease_lock:
                self._leases[u] = (alloc.next_lease, time.monotonic()) if alloc.next_lease else None
            if u in copied:
                error = copied[u]
            else:
                targets = [
                    (encoded[n], r.chunk, r.offset, rows_of[u][n]) for n, r in alloc.regions.items()
                ]
                error = self._copy_in(u, targets)
            if error is not None:
                results[i] = error
                self.discard(u, write_id)  # staged, but its bytes never arrived: not awaited
        return results

    def _stage_call(self, unit: int, nbytes: int, method: str, args: tuple) -> Any:
        """A unit's stage call: a small one joins this process's next ``stage_many`` to the
        unit (a Future of its answer), a large one is sent alone (an ObjectRef)."""
        if nbytes > BATCHED_STAGE_BYTES:
            return getattr(self.units[unit], method).remote(*args)
        with self._batchers_lock:
            batcher = self._batchers.get(unit)
            if batcher is None:
                handle = self.units[unit]
                batcher = self._batchers[unit] = CallBatcher(
                    lambda calls: self._wait(handle.stage_many.remote(calls)),
                    f"dataplane-stages-{unit}",
                    MAX_STAGE_BATCH,
                )
        return batcher.submit((method, args))

    def stages_queued(self) -> int:
        """Small stages waiting for their unit's next ``stage_many`` call."""
        return sum(b.queued() for b in list(self._batchers.values()))

    def close(self) -> None:
        """Stop the stage batchers' threads (what is queued is still sent)."""
        with self._batchers_lock:
            for batcher in self._batchers.values():
                batcher.close()

    def _take_lease(self, unit: int, sizes: list[int]) -> WriteLease | None:
        """This unit's lease for our next write, taken (no other put gets it) if the write
        fits and it is fresh."""
        with self._lease_lock:
            held = self._leases[unit]
            if held is None:
                return None
            lease, got = held
            if shm.layout(sizes)[1] > lease.region.nbytes:
                return None  # kept: a later write may fit (the unit reclaims it when idle)
            self._leases[unit] = None
        # Half its time left at least, so the unit never reclaims it under our copy.
        return lease if time.monotonic() - got < lease.ttl_s / 2 else None

    def _copy_in(
        self,
        unit: int,
        targets: list[tuple[EncodedField, ChunkRef, int, np.ndarray]],
    ) -> BaseException | None:
        """Copy the given rows of each field to its (chunk, offset); the error if not."""
        try:
            pairs = []  # every field's copies run together, split over threads
            for enc, chunk, offset, rows in targets:
                nbytes = take_rows(enc, rows, header_only=True).nbytes
                dest = shm.map_for_write(chunk, offset, nbytes)
                field_pairs = row_copy_pairs(enc, rows, dest)
                if enc.device_values is not None:  # a CUDA tensor's: device-to-host, into place
                    devices.copy_rows_to_host(enc, rows, dest)
                elif field_pairs is None:
                    take_rows(enc, rows, out=dest)  # a string column, written row by row
                else:
                    pairs.extend(field_pairs)
            parallel_copy.copy_pairs(pairs)  # the one copy of a same-node put
        except (shm.ChunkChanged, FileNotFoundError) as e:
            # The chunk was closed or replaced (a reclaimed lease): this write stages again.
            return StagedRegionGone(f"unit {unit}: {e}")
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EPERM):
                self.shared[unit] = False  # another user's unit: reach it through Ray from now on
            return SharedMemoryUnavailable(f"unit {unit}: {e}", unit=unit)
        return None

    def discard(self, unit: int, write_id: str):
        return self.units[unit].discard.remote(write_id)

    # ---- reads --------------------------------------------------------------------
    def read_flow(
        self,
        partition_id: str,
        plan: dict[int, list[str]],
        fields: list[str],
        via_ray: bool = False,
        expect: dict[int, list[int]] | None = None,
    ) -> Flow:
        """Per unit of ``plan``: {field: EncodedField | SharedRows} (or the error).

        ``via_ray`` forces the Ray path (the fallback when a mapping failed);
        ``expect``: per unit, the generation of each row a direct read means (the unit
        answers ``RouteChanged`` unless it holds every row at it).
        """
        expect = expect or {}
        # Each unit's cross-node backend, fixed for this flow (its answer is completed by
        # the backend that asked for it).
        backend = {
            u: _RAY_OBJECTS if via_ray else self.backend(u) for u in plan if not self.shared[u]
        }

        def call(u: int) -> Any:
            if self.shared[u] and not via_ray:
                return self.units[u].read_shm.remote(
                    read_request(
                        partition_id,
                        plan[u],
                        fields,
                        self._reader_token(u),
                        expect.get(u),
                        self._closed_seq[u],
                    )
                )
            b = backend.get(u, _RAY_OBJECTS)
            token = self._reader_token(u) if b is not _RAY_OBJECTS else None
            return b.read_call(self.units[u], partition_id, plan[u], fields, expect.get(u), token)

        units = list(plan)
        results = list((yield [call(u) for u in units]))
        forgot_us = [i for i, r in enumerate(results) if isinstance(r, ReaderUnknown)]
        if forgot_us:  # restarted, or too many readers since: our token itself again
            self._token_sent.difference_update(units[i] for i in forgot_us)
            again = yield [call(units[i]) for i in forgot_us]
            for i, r in zip(forgot_us, again):
                results[i] = r
        results = [unpack_read_answer(r) if isinstance(r, bytes) else r for r in results]
        pulls = [
            i
            for i, u in enumerate(units)
            if u in backend and backend[u].needs_completion(results[i])
        ]
        if pulls:  # a transfer engine's answers: pull the bytes (in parallel, off this thread)
            pool = _pull_pool()
            done = yield [
                pool.submit(backend[units[i]].complete, self.units[units[i]], results[i])
                for i in pulls
            ]
            for i, r in zip(pulls, done):
                results[i] = r
        # The engine could not move them (or the unit runs none): the same rows through
        # Ray, once.
        failed = [
            i
            for i, u in enumerate(units)
            if u in backend
            and backend[u] is not _RAY_OBJECTS
            and isinstance(results[i], PayloadTransferFailed)
        ]
        if failed:
            for i in failed:
                log.warning("%s; reading through Ray instead", results[i])
            again = yield [
                _RAY_OBJECTS.read_call(
                    self.units[units[i]],
                    partition_id,
                    plan[units[i]],
                    fields,
                    expect.get(units[i]),
                    None,
                )
                for i in failed
            ]
            for i, r in zip(failed, again):
                results[i] = r
        for u, result in zip(plan, results):
            if isinstance(result, dict):
                self._forget_closed(u, result)
                result.update(self._leased(u, result))
        return results

    # ---- cross-node payload backends ---------------------------------------------------
    def payload_paths(self) -> list[PayloadPath]:
        """How this process reaches each unit's bytes, probed on first ask (``connect()``
        asks, so the probe is part of starting a worker, not of its first get)."""
        paths = self._paths
        if paths is not None:
            return paths
        with self._paths_lock:
            if self._paths is None:
                paths = probe.choose(
                    self.units,
                    self._nodes,
                    self.shared,
                    self._alive,
                    self._local_node,
                    self._cross_node_mode,
                )
                here = ray.util.get_node_ip_address()
                self._backends = {
                    p.unit: mooncake.Mooncake(p.unit, p.detail, here, p.backend)
                    for p in paths
                    if p.backend in MOONCAKE
                }
                self._paths = paths
            return self._paths

    def backend(self, unit: int) -> PayloadBackend:
        """The backend that moves ``unit``'s bytes here (Ray's object transfer unless the
        probe chose another)."""
        self.payload_paths()
        return self._backends.get(unit, _RAY_OBJECTS)

    def introduce(self, timeout_s: float = _INTRODUCE_TIMEOUT_S) -> None:
        """Send our process token to every same-node unit now, as the process connects.

        A fresh process's first call to a unit sets up its connection (about 2 ms more
        than a later call, 2026-11-27) and its first read sends the token (a ``ray.put``
        and Ray's borrower books): here they are part of starting a worker, not of its
        first step. A unit that does not answer in ``timeout_s`` (or died) is left to the
        first read, which then sends the token itself.
        """
        units = [u for u, ok in enumerate(self.shared) if ok and u not in self._token_sent]
        if not units:
            return
        calls = {self.units[u].meet.remote(self._stage_owner()): u for u in units}
        answered, _ = ray.wait(list(calls), num_returns=len(calls), timeout=timeout_s)
        for ref in answered:
            try:
                ray.get(ref)
            except ray.exceptions.RayError:
                continue
            self._token_sent.add(calls[ref])

    def _reader_token(self, unit: int) -> list | bytes:
        """Our process token for a same-node read from ``unit`` (a dead reader's leases are
        released by the unit): the token itself the first time, its key from then on
        (``dataplane_server.unit.reader_tokens``)."""
        owner = self._stage_owner()
        if unit in self._token_sent:
            return owner[0].binary()
        self._token_sent.add(unit)  # a call lost on the way is answered ReaderUnknown later
        return owner

    def _forget_closed(self, unit: int, result: dict) -> None:
        """Learn the closures a unit's read answer carries (every shared part of one answer
        carries the same)."""
        for part in result.values():
            if isinstance(part, SharedRows) and part.closures is not None:
                self._learn_closures(unit, part.closures)
                return

    def _learn_closures(self, unit: int, c: ChunkClosures) -> None:
        """Drop this process's kept mappings of the chunks the unit closed; ask from there."""
        shm.forget_closed(c.closed, c.chunk_prefix if c.reset else None)
        self._closed_seq[unit] = c.closed_seq

    def _leased(self, unit: int, result: dict) -> dict:
        """The result's shared rows holding one :class:`ReadLease` (a lease id came back)."""
        shared = {k: v for k, v in result.items() if isinstance(v, SharedRows)}
        ids = {v.lease for v in shared.values() if v.lease is not None}
        if not ids:
            return shared
        (lease_id,) = ids
        lease = ReadLease(self.units[unit], lease_id)
        return {k: dataclasses.replace(v, lease=lease) for k, v in shared.items()}
