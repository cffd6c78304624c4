"""RayDataPlaneClient: the data-plane client on Ray, what rollout actors, drivers and workers use.

It implements NeMo-RL's abstract :class:`~dataplane_client.interface.DataPlaneClient`
(fields in as a TensorDict, dict or BatchedDataDict; out as a TensorDict) and
our typed extras of :class:`~dataplane_client.interface.DataPlaneService` (async
twins, leases and ``ack``, ``delete_partition``, inspection), plus Ray-only ones
(``checkpoint``, ``restore``) and object fields.

Every verb is declared once, in the interface (``@verb``: signature, docstring,
argument checks), and this class writes its body ``_name``, which gets the checked
arguments and serves both the verb and its ``*_async`` twin. A body of several
steps (put, get, claim) is a *flow*: a generator that yields lists of Ray ObjectRefs
(or futures of a batcher's answers) and receives their results (an exception in
place of a result that failed); ``_run_sync`` drives it with ``ray.get``,
``_run_async`` with ``await``, so the twins never block an event loop. A body of
one controller call just returns that call's ObjectRef (``_get_sync`` /
``_get_async`` wait on it).

Data path of a put: wait for one of this process's put credits (``admission``)
-> encode (zero-copy views of the caller's tensors) -> split rows by storage
unit -> stage bytes on the units in parallel -> one commit to the controller,
which publishes them (visibility point). Small stages and all commits of this
process's concurrent puts travel together (``CallBatcher``: one call per unit,
one to the controller, per round trip), each keeping its own answer. A get: one validation
call to the controller (it also says where rows live) -> parallel reads from
the units -> rows reassembled in request order with one copy per field.

What a get returns may view memory it does not own, with no copy: same-node
rows that lie back to back come as a copy-on-write mapping of the unit's
memory (writable, writes stay private), and rows that came through Ray in one
piece (cross-node, or from a unit without shared memory) as views of this
get's own copy in the local object store. The latter are read-only, as
``ray.get`` results are: numpy marks them so, torch cannot, so ``.clone()`` a
tensor before changing it in place.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Generator, Iterable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
import ray
import torch
from ray.exceptions import AuthenticationError, GetTimeoutError, RayActorError, RayTaskError

from dataplane_client.codec import appends, prepare
from dataplane_client.codec.assembly import assemble_fields
from dataplane_client.codec.tensordict_io import to_tensordict
from dataplane_client.interface import DataPlaneClient as DataPlaneClient  # re-exported
from dataplane_client.interface import DataPlaneService, awaitable, checked, service_verbs, verb
from dataplane_client.transport import placement
from dataplane_client.transport.actor_states import ActorStates
from dataplane_client.transport.admission import Admission
from dataplane_client.transport.bulk import SharedMemoryUnavailable, StagedRegionGone, Transport
from dataplane_client.transport.call_batcher import CallBatcher
from dataplane_client.transport.claim_batcher import ClaimBatcher
from dataplane_client.transport.loopback import join_address
from dataplane_client.transport.ray_auth import refused_without_token, token_mode
from dataplane_client.wire import arguments, routes
from dataplane_client.wire.config import DataPlaneConfig
from dataplane_client.wire.errors import (
    AppendConflict,
    CapacityExceeded,
    CodecsChanged,
    CorruptPayload,
    DataPlaneError,
    FieldAlreadyProduced,
    PayloadTransferFailed,
    RoutingUnstable,
    SamplesLost,
    SamplesNotFound,
    ServiceUnavailable,
    StageReclaimed,
    UnknownPartition,
)
from dataplane_client.wire.messages import (
    ClaimOutcome,
    ClaimRequest,
    CommitRequest,
    FieldCodecs,
    PartitionSpec,
    RolloutGrant,
    WriterLoad,
)
from dataplane_client.wire.meta import KVBatchMeta
from dataplane_client.wire.put_deadline import PutDeadline

Flow = Generator[list, list, Any]
_MAX_REROUTES = 3
_MAX_EVICTION_ROUNDS = 8  # a full unit: evict the oldest version at most this often per put
_MAX_COMMIT_BATCH = 1024  # commits per commit_many call
_ROUTE_CACHE_LIMIT = 4_000_000


# A call to a restarting controller is retried by Ray (the controller runs with task
# retries); the client only bounds how long it waits for the restart to finish.
_POLL_S = 1.0
_budget_s: float | None = None


def _retry_budget_s() -> float:
    global _budget_s
    if _budget_s is None:  # the config's default, or DATAPLANE_CONTROLLER_RETRY_BUDGET_S
        _budget_s = DataPlaneConfig().controller_retry_budget_s
    return _budget_s


# Shared by every call this process waits on: one GCS query per actor per poll.
_actor_states = ActorStates(max_age_s=_POLL_S)


def _actor_state(actor_id: str) -> tuple[str, str]:
    """(class name, state) of an actor in Ray's view, now; ('', '') when unknown."""
    return _actor_states.ask(actor_id)


def _unwrap(exc: BaseException) -> BaseException:
    """A typed error raised inside an actor, as its own class (not Ray's wrapper); a dead
    controller (restarts exhausted) as ServiceUnavailable."""
    if isinstance(exc, RayTaskError):
        cause = getattr(exc, "cause", None)
        if isinstance(cause, DataPlaneError):
            return cause
    if (
        isinstance(exc, RayActorError)
        and exc.actor_id
        and _actor_state(exc.actor_id)[0] == "Controller"
    ):
        return ServiceUnavailable(f"the data-plane controller is gone ({exc.error_msg})")
    return exc


class _RestartClock:
    """How long the actor behind a call has been restarting; raises past the budget."""

    def __init__(self, ref: Any):
        self.ref = ref
        self.since: float | None = None

    def check(self) -> None:
        if not hasattr(self.ref, "task_id"):
            return
        actor_id = self.ref.task_id().actor_id().hex()
        cls, state = _actor_states.get(actor_id)  # shared, <= _POLL_S old
        if state != "RESTARTING":
            self.since = None
            return
        now = time.monotonic()
        self.since = self.since or now
        if now - self.since > _retry_budget_s():
            raise ServiceUnavailable(
                f"the data-plane {cls or 'actor'} has been restarting for over "
                f"{_retry_budget_s():.0f}s (controller_retry_budget_s)"
            )


def _give_up(ref: Any, clock: _RestartClock) -> None:
    """Past the budget: cancel the call before raising. Ray would otherwise deliver it to
    the restarted controller later, and a claim or commit the caller was told failed
    would happen after all (a claim nobody receives consumes its samples)."""
    try:
        clock.check()
    except ServiceUnavailable:
        if isinstance(ref, ray.ObjectRef):
            ray.cancel(ref)
        raise


def _wait_sync(ref: Any) -> Any:
    if isinstance(ref, Future):  # a batcher's answer: its sender thread bounds the wait
        return ref.result()
    clock = _RestartClock(ref)
    while True:
        try:
            return ray.get(ref, timeout=_POLL_S)
        except GetTimeoutError:
            _give_up(ref, clock)


async def _wait_async(ref: Any) -> Any:
    if isinstance(ref, Future):  # a batcher's answer: its sender thread bounds the wait
        return await asyncio.wrap_future(ref)
    clock = _RestartClock(ref)
    future = asyncio.ensure_future(ref) if not asyncio.isfuture(ref) else ref
    while True:
        # asyncio.wait, not wait_for: the call's own error may be a TimeoutError
        # (CapacityExceeded, ClaimTimeout are), which wait_for's timeout would look like.
        done, _ = await asyncio.wait({future}, timeout=_POLL_S)
        if done:
            return future.result()
        _give_up(ref, clock)


def _resolve_sync(refs: list) -> list:
    if len(refs) > 1 and all(isinstance(r, ray.ObjectRef) for r in refs):
        try:  # one wait for a step's calls (a get's units): the common, quick case
            return ray.get(refs, timeout=_POLL_S)
        except Exception:  # noqa: BLE001 - a failed or slow call: each is waited on (typed) alone
            pass
    out = []
    for ref in refs:
        try:
            out.append(_wait_sync(ref))
        except Exception as e:  # noqa: BLE001 - handed to the flow, which re-raises typed errors
            out.append(_unwrap(e))
    return out


async def _resolve_async(refs: list) -> list:
    async def one(ref: Any) -> Any:
        try:
            return await _wait_async(ref)
        except Exception as e:  # noqa: BLE001 - handed to the flow, which re-raises typed errors
            return _unwrap(e)

    return list(await asyncio.gather(*[one(r) for r in refs]))


def _run_sync(flow: Flow) -> Any:
    try:
        refs = next(flow)
        while True:
            refs = flow.send(_resolve_sync(refs))
    except StopIteration as stop:
        return stop.value


async def _run_async(flow: Flow) -> Any:
    try:
        refs = next(flow)
        while True:
            refs = flow.send(await _resolve_async(refs))
    except StopIteration as stop:
        return stop.value


def _get_sync(ref: Any) -> Any:
    try:
        return _wait_sync(ref)
    except Exception as e:  # noqa: BLE001 - re-raised, as the typed error when it is one
        raise _unwrap(e) from None


async def _get_async(ref: Any) -> Any:
    try:
        return await _wait_async(ref)
    except Exception as e:  # noqa: BLE001 - re-raised, as the typed error when it is one
        raise _unwrap(e) from None


def _complete_sync(result: Flow | Any) -> Any:
    """A verb body's result completed: a flow driven, one ObjectRef (or Future) waited on."""
    return _run_sync(result) if isinstance(result, Generator) else _get_sync(result)


async def _complete_async(result: Flow | Any) -> Any:
    if isinstance(result, Generator):
        return await _run_async(result)
    return await _get_async(result)


def _claim_answer(request: ClaimRequest, outcome: ClaimOutcome) -> KVBatchMeta:
    if outcome.error is not None:
        raise outcome.error
    return request.nothing_due() if outcome.meta is None else outcome.meta


def _one(results: list) -> Any:
    """The single result of a one-ref step, raising it if it failed."""
    (r,) = results
    if isinstance(r, BaseException):
        raise r
    return r


def _assembled(
    results: list,
    plan: dict[int, np.ndarray],
    fields: list[str],
    n: int,
    device: torch.device | None,
) -> dict:
    """Each field decoded from the units' answers (in ``plan``'s order), rows in request
    order, on ``device`` (None: in host memory)."""
    # Row j of the output is row order[j] of the units' results concatenated.
    position = np.concatenate(list(plan.values()))
    order = np.empty(n, dtype=np.int64)
    order[position] = np.arange(n)
    return assemble_fields({name: [r[name] for r in results] for name in fields}, order, device)


class _RouteCache:
    """(partition, sample) -> (unit, generation), learnt from puts and gets: only a hint. A
    put's is checked by the controller (a commit of samples that live elsewhere is
    re-routed); a get's by the unit, which serves a direct read only at the generation
    named (``routes``), so a stale or missing entry costs a round trip, never data.

    Shared by every thread of a client. One dict of samples per partition, so forgetting
    a partition is one pop, not a scan of every route. Writers hold ``_lock``; readers take
    no lock: they look a partition's dict up once, then single samples in it, and a single
    dict lookup never sees a dict half-changed. Nothing iterates a dict another thread may
    change (that is what raised ``dictionary changed size during iteration`` here).
    """

    # One int per route, not a tuple: unit in the low bits, generation + 1 above them.
    _UNIT_BITS = 16

    def __init__(self, limit: int):
        self._lock = threading.Lock()
        self._parts: dict[str, dict[str, int]] = {}
        self._size = 0  # routes held, over all partitions (changed only under _lock)
        self._limit = limit

    def _packed(self, partition_id: str, sample_ids: Sequence[str]) -> np.ndarray:
        part = self._parts.get(partition_id, {})
        routes = map(part.get, sample_ids, itertools.repeat(-1))
        return np.fromiter(routes, dtype=np.int64, count=len(sample_ids))

    def units(self, partition_id: str, sample_ids: Sequence[str]) -> np.ndarray:
        """Each sample's unit, -1 where unknown."""
        packed = self._packed(partition_id, sample_ids)
        return np.where(packed < 0, -1, packed & ((1 << self._UNIT_BITS) - 1))

    def routes(
        self, partition_id: str, sample_ids: Sequence[str]
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """(unit, generation) of every sample; None unless all are known with a generation."""
        packed = self._packed(partition_id, sample_ids)
        gens = (packed >> self._UNIT_BITS) - 1
        if not len(packed) or (packed < 0).any() or (gens < 0).any():
            return None
        return packed & ((1 << self._UNIT_BITS) - 1), gens

    def knows(self, partition_id: str, sample_id: str) -> bool:
        return sample_id in self._parts.get(partition_id, {})

    def remember(
        self,
        partition_id: str,
        sample_ids: Sequence[str],
        units: Iterable[int],
        generations: Any = -1,
    ) -> None:
        """``generations``: per sample or one for all (-1: unknown, no direct reads)."""
        gens = np.broadcast_to(np.asarray(generations, dtype=np.int64), (len(sample_ids),))
        packed = np.asarray(units, dtype=np.int64) + ((np.maximum(gens, -1) + 1) << self._UNIT_BITS)
        routes = zip(sample_ids, packed.tolist())
        with self._lock:
            if self._size > self._limit:  # bounded: start over rather than grow forever
                self._parts, self._size = {}, 0
            part = self._parts.setdefault(partition_id, {})
            before = len(part)
            part.update(routes)
            self._size += len(part) - before

    def forget(self, partition_id: str, sample_ids: Sequence[str] | None) -> None:
        """The samples' routes; ``None``: the whole partition's."""
        with self._lock:
            if sample_ids is None:
                self._size -= len(self._parts.pop(partition_id, {}))
                return
            part = self._parts.get(partition_id, {})
            before = len(part)
            for s in sample_ids:
                part.pop(s, None)
            self._size -= before - len(part)

    def clear(self) -> None:
        with self._lock:
            self._parts, self._size = {}, 0


class RayDataPlaneClient(DataPlaneService):
    """Client of one data-plane service (controller + storage units) on Ray.

    One client may be shared by threads: its caches are safe to use concurrently (see
    "Shared mutable state" in docs/architecture.md), and a verb racing ``close()``
    either completes or raises ``ServiceUnavailable``.
    """

    def __init__(
        self,
        controller: Any,
        name: str = "dataplane",
        namespace: str = "dataplane",
        cross_node_transport: str | None = None,
    ):
        self.name, self.namespace = name, namespace
        self._controller = controller
        routing = ray.get(controller.routing.remote())
        self._transport: Transport | None = Transport(
            routing.units,
            routing.nodes,
            routing.shm,
            ray.get_runtime_context().get_node_id(),
            wait=_get_sync,
            # The service's setting, unless this client asks for Ray's path (the other
            # way round is not offered: the units run an engine only when allowed to).
            cross_node_transport=(
                "ray" if cross_node_transport == "ray" else routing.cross_node_transport
            ),
            alive=routing.alive,
            transfer_puts=routing.transfer_puts,
        )
        self._writer_id = uuid.uuid4().hex  # names our figures in the service's metrics
        self._admission = Admission(
            routing.put_credits,
            routing.put_admission_timeout_s,
            routing.put_queue_limit,
            report=self._report_load,
        )
        self._stage_ttl_s = routing.stage_ttl_s  # a put's deadline, from its admission
        # Rebound to a fresh list, never changed in place: a reader sees one whole view.
        self._alive = list(routing.alive)
        self._nodes, self._replicas = list(routing.nodes), routing.replicas
        self._routes = _RouteCache(_ROUTE_CACHE_LIMIT)
        self._direct_backoff = routes.DirectReadBackoff()  # when cached routes keep going stale
        # partition -> its enums and object fields, as declared to the controller (asked once).
        # Only single-key operations (atomic); a stale entry is caught by its key.
        self._codecs: dict[str, FieldCodecs] = {}
        # partition -> the controller call asking its codecs, while one is out: every flow
        # that misses the cache meanwhile shares it (a fleet's first puts of a partition
        # asked once each, hundreds of calls queued at the controller per process).
        self._codecs_asked: dict[str, Any] = {}
        self._batcher: ClaimBatcher | None = None
        self._commit_batcher: CallBatcher | None = None
        self._batcher_lock = threading.Lock()  # one batcher each per client; none after close

    # ---- helpers ------------------------------------------------------------------
    def _open_controller(self) -> Any:
        """The controller's handle; ServiceUnavailable once the client is closed. Every use
        goes through here (read once per call), so a verb racing ``close()`` fails typed."""
        controller = self._controller
        if controller is None:
            raise ServiceUnavailable(f"this client of {self.name!r} was closed")
        return controller

    # ---- how a verb runs: its body's flow or ObjectRef, waited on or awaited ----------
    def _check_open(self) -> None:
        self._open_controller()

    def _run_verb(self, body: Callable[[], Any]) -> Any:
        return _complete_sync(body())

    async def _run_verb_async(self, body: Callable[[], Any]) -> Any:
        return await _complete_async(body())

    def _open_transport(self) -> Transport:
        """The transport to the units; ServiceUnavailable once the client is closed."""
        if self._transport is None:
            raise ServiceUnavailable(f"this client of {self.name!r} was closed")
        return self._transport

    def _codecs_of(self, partition_id: str) -> Flow:
        """The partition's enums and object fields: from the controller on first use, so a
        client that did not register the partition encodes and decodes like the one that did.
        An unknown partition has none (the verb's own controller call then says so)."""
        arguments.partition_name(partition_id)  # a typed error before any dict lookup
        codecs = self._codecs.get(partition_id)
        if codecs is None:
            try:
                codecs = _one((yield [self._ask_codecs(partition_id)]))
            except UnknownPartition:
                return FieldCodecs()
            finally:
                self._codecs_asked.pop(partition_id, None)  # answered: a later miss asks anew
            self._codecs[partition_id] = codecs
        return codecs

    def _ask_codecs(self, partition_id: str) -> Any:
        """The controller call answering the partition's codecs: the one already out, or a
        new one. (Two threads may both start one: harmless, one answer wins the cache.)"""
        ref = self._codecs_asked.get(partition_id)
        if ref is None:
            ref = self._open_controller().field_codecs.remote(partition_id)
            self._codecs_asked[partition_id] = ref
        return ref

    def _drop_codecs(self, partition_id: str) -> None:
        """Forget the partition's codecs, and any call asking them (its answer may be the
        codecs being dropped)."""
        self._codecs.pop(partition_id, None)
        self._codecs_asked.pop(partition_id, None)

    def _forget(self, partition_id: str, sample_ids: Sequence[str] | None) -> None:
        arguments.partition_name(partition_id)  # a typed error before any dict lookup
        if sample_ids is None:
            self._drop_codecs(partition_id)
        self._routes.forget(partition_id, sample_ids)

    def _assign_new(
        self, sample_ids: Sequence[str], idx: np.ndarray, groups: list | None = None
    ) -> np.ndarray:
        """Units for samples never written: contiguous chunks over the live units.

        Contiguous runs keep the per-unit split of the caller's buffers a
        zero-copy slice; the first id picks the starting unit so many small
        writers spread evenly. The controller records the choice at commit.
        ``groups`` (a put of group fields): a group's members go to one unit, picked
        by its group_id, so every writer of the group finds its stored value there.
        """
        alive = [u for u, ok in enumerate(self._alive) if ok]
        if not alive:
            raise SamplesLost("no storage unit is alive", ids=[sample_ids[i] for i in idx])
        if groups is not None:
            picks = [zlib.crc32(repr(groups[i]).encode()) % len(alive) for i in idx.tolist()]
            return np.asarray(alive, dtype=np.int64)[np.asarray(picks, dtype=np.int64)]
        start = zlib.crc32(sample_ids[int(idx[0])].encode()) % len(alive) if len(idx) else 0
        chunk = np.arange(len(idx)) * len(alive) // max(len(idx), 1)
        return np.asarray(alive, dtype=np.int64)[(chunk + start) % len(alive)]

    def _unit_died(self, unit: int) -> Flow:
        """Tell the controller a unit failed; refresh our view of who is alive."""
        yield [self._open_controller().mark_unit_lost.remote(unit)]
        routing = _one((yield [self._open_controller().routing.remote()]))
        self._alive = list(routing.alive)

    # ---- partitions ---------------------------------------------------------------
    def _register_partition(self, spec: PartitionSpec) -> Flow:
        codecs = dataclasses.replace(
            arguments.field_codecs(spec.enums, spec.object_fields),
            group_fields=frozenset(spec.group_fields),
            version_tag=None if spec.staleness is None else spec.staleness.version_tag,
        )
        self._forget(spec.partition_id, None)
        _one((yield [self._open_controller().register_partition.remote(spec)]))
        self._codecs[spec.partition_id] = codecs

    def _delete_partition(self, partition_id: str) -> Any:
        self._forget(partition_id, None)
        return self._open_controller().delete_partition.remote(partition_id)

    # ---- put ----------------------------------------------------------------------
    def _put_samples(self, put: prepare.PutArguments) -> Flow:
        credit = self._admission.enter()
        try:
            admitted = (yield [credit])[0]
            _one([admitted])  # Overloaded when not admitted in time: nothing staged
            deadline = PutDeadline.after(self._stage_ttl_s)  # every later step runs against it
            return (yield from self._admitted_put(put, deadline))
        finally:
            self._admission.leave(credit)

    def _admitted_put(self, put: prepare.PutArguments, deadline: PutDeadline) -> Flow:
        """A put holding a credit: encoded, then staged and committed (``_put_flow``)."""
        partition_id = put.partition_id
        codecs = yield from self._codecs_of(partition_id)
        w = prepare.write(put, codecs)
        try:
            return (yield from self._put_making_room(partition_id, w, codecs.key, deadline))
        except CodecsChanged:
            # Registered again with another vocabulary since we cached it: encode anew.
            self._drop_codecs(partition_id)
            codecs = yield from self._codecs_of(partition_id)
            w = prepare.write(put, codecs)
            return (yield from self._put_making_room(partition_id, w, codecs.key, deadline))

    def _put_making_room(
        self, partition_id: str, w: prepare.Write, codecs_key: str, deadline: PutDeadline
    ) -> Flow:
        """``_put_flow``; a put that finds a unit full asks the controller to evict the oldest
        version's unclaimed groups (a partition registered with ``evict_stale``) and tries
        again while that freed something; otherwise CapacityExceeded stands."""
        for _round in range(_MAX_EVICTION_ROUNDS):
            try:
                return (yield from self._put_flow(partition_id, w, codecs_key, deadline))
            except CapacityExceeded:
                evicted = _one((yield [self._open_controller().make_room.remote(partition_id)]))
                if not evicted:
                    raise
        return (yield from self._put_flow(partition_id, w, codecs_key, deadline))

    def _put_flow(
        self, partition_id: str, w: prepare.Write, codecs_key: str, deadline: PutDeadline
    ) -> Flow:
        """The put of checked and encoded rows: staged on the units, then committed, each
        step only before the put's ``deadline`` (Overloaded after it, nothing visible)."""
        sample_ids, encoded = w.sample_ids, w.encoded

        units = self._routes.units(partition_id, sample_ids)
        # Second copies (replicas: 2): -2 = derive from the unit; else as the controller said.
        replicas = np.full(len(sample_ids), -2, dtype=np.int64)
        via_ray: set[int] = set()  # units this put reaches through Ray after a failed copy
        use_leases = True
        for _attempt in range(_MAX_REROUTES + 1):
            new = np.nonzero(units < 0)[0]
            if len(new):
                units[new] = self._assign_new(sample_ids, new, w.groups if w.shared else None)
            if self._replicas > 1:
                derived = placement.second_units(units, self._alive, self._nodes)
                replicas = np.where(replicas == -2, derived, replicas)
            deadline.check("stage")
            write_id = uuid.uuid4().hex
            plan = placement.stage_plan(units, replicas if self._replicas > 1 else None)
            staged = list(plan)
            results = yield from self._open_transport().stage_flow(
                partition_id,
                write_id,
                sample_ids,
                encoded,
                plan,
                via_ray=frozenset(via_ray),
                use_leases=use_leases,
                expires_at=deadline.expires_at,
                shared=w.shared,
            )
            errors = [(u, r) for u, r in zip(staged, results) if isinstance(r, BaseException)]
            if errors:
                yield [
                    self._open_transport().discard(u, write_id)
                    for u, r in zip(staged, results)
                    if not isinstance(r, BaseException)
                ]
                if all(
                    isinstance(e, (SharedMemoryUnavailable, PayloadTransferFailed))
                    for _, e in errors
                ):
                    # Stage again: in a fresh region where a lease was taken back (once),
                    # through Ray where a copy or a transfer engine's push could not be made.
                    via_ray.update(
                        u for u, e in errors if not (isinstance(e, StagedRegionGone) and use_leases)
                    )
                    use_leases = False
                    continue
                died = [u for u, e in errors if isinstance(e, RayActorError)]
                if not died:
                    raise errors[0][1]
                for u in died:
                    yield from self._unit_died(u)
                # Samples that were new go elsewhere; ones already living there are lost
                # (unless replicated: the controller then re-routes them to their survivor).
                known = {s for s in sample_ids if self._routes.knows(partition_id, s)}
                lost = [s for s, u in zip(sample_ids, units) if u in died and s in known]
                if lost and self._replicas == 1:
                    raise SamplesLost(
                        "their storage unit died", ids=lost, partition_id=partition_id
                    )
                units[np.isin(units, died)] = -1
                replicas[:] = -2
                continue
            request = CommitRequest(
                partition_id=partition_id,
                write_id=write_id,
                sample_ids=sample_ids,
                units=units.tolist(),
                schemas=w.schemas,
                sequence_lengths=w.sequence_lengths,
                tags=w.tags,
                overwrite=w.overwrite,
                staged_units=staged,
                replicas=replicas.tolist() if self._replicas > 1 else None,
                codecs_key=codecs_key,
                expires_at=deadline.expires_at,
            )
            # Closed meanwhile: ServiceUnavailable here, before anything is committed (the
            # units drop the staged bytes when their stage expires).
            controller = self._open_controller()
            try:
                deadline.check("commit")  # its stages are discarded below
                result = _one((yield [self._commits().submit(request)]))
            except BaseException as e:
                yield [self._open_transport().discard(u, write_id) for u in staged]
                if isinstance(e, StageReclaimed):
                    continue  # reclaimed all the same (a unit's clock ahead): stage again in time
                if not (isinstance(e, SamplesLost) and self._replicas > 1):
                    raise
                # A unit died while publishing; nothing is visible. Copies go to live units
                # (a sample with no copy left is SamplesLost from the controller's check).
                alive = list(_one((yield [controller.routing.remote()])).alive)
                self._alive = alive
                gone = [u for u, ok in enumerate(alive) if not ok]
                if not (np.isin(units, gone).any() or np.isin(replicas, gone).any()):
                    raise
                units[np.isin(units, gone)] = -1
                replicas[:] = -2
                continue
            if result.rerouted:
                yield [self._open_transport().discard(u, write_id) for u in staged]
                position = {s: i for i, s in enumerate(sample_ids)}
                for s, u in result.rerouted.items():
                    units[position[s]] = u
                    replicas[position[s]] = result.rerouted_replicas.get(s, -1)
                continue
            self._routes.remember(partition_id, sample_ids, units, result.generation)
            return KVBatchMeta(
                partition_id=partition_id,
                sample_ids=sample_ids,
                fields=list(encoded),
                sequence_lengths=result.sequence_lengths,
                tags=w.tags,
            )
        raise RoutingUnstable(
            "samples kept moving between units while writing; retry",
            ids=sample_ids,
            partition_id=partition_id,
        )

    def _append_tokens(self, args: appends.AppendArguments) -> Flow:
        """Read what the store holds of the samples, join, put (``codec.appends``); read
        again when another append landed in between."""
        pid = args.partition_id
        for attempt in range(appends.MAX_APPEND_TRIES):
            held = _one(
                (yield [self._open_controller().partial_rollouts.remote(pid, args.sample_ids)])
            )
            ids = appends.stored_ids(args, held)
            stored = (
                (yield from self._get_samples(ids, pid, list(args.rows), None)) if ids else None
            )
            try:
                return (yield from self._put_samples(appends.appended_put(args, held, stored)))
            except (AppendConflict, FieldAlreadyProduced):  # another append went first, or
                # is committing the same cells right now: read again
                if attempt == appends.MAX_APPEND_TRIES - 1:
                    raise
        raise AssertionError("unreachable")

    def _commits(self) -> CallBatcher:
        """This client's commit batcher: the commits of concurrent puts go to the controller
        together, one ``commit_many`` per round trip (``_made_once``); ServiceUnavailable
        once closed."""
        return self._made_once(
            "_commit_batcher",
            lambda controller: CallBatcher(
                lambda requests: _get_sync(controller.commit_many.remote(requests, self._load())),
                "dataplane-commits",
                _MAX_COMMIT_BATCH,
            ),
        )

    def _made_once(self, attribute: str, make: Callable[[Any], Any]) -> Any:
        """The batcher kept in ``attribute``, made from the controller's handle on first
        use under ``_batcher_lock``: concurrent first callers share one (each batcher
        starts a sender thread, and only the kept one is closed)."""
        made = getattr(self, attribute)
        if made is not None:
            return made
        with self._batcher_lock:
            if getattr(self, attribute) is None:
                setattr(self, attribute, make(self._open_controller()))
            return getattr(self, attribute)

    def _load(self) -> WriterLoad:
        """Our put admission figures, for the service's metrics (``writer_loads``)."""
        return self._admission.load(self._writer_id)

    def _report_load(self) -> None:
        """Send our put admission figures to the service (not awaited)."""
        self._open_controller().report_writer_load.remote(self._load())

    # ---- get ----------------------------------------------------------------------
    def _get_data(
        self, meta: KVBatchMeta, sample_ids: list[str], fields: list[str], device: Any
    ) -> Flow:
        """A claimed meta says where its rows live (``routes``): read straight from the units."""
        hints = routes.hinted(meta.extra_info, sample_ids)
        return self._get_samples(sample_ids, meta.partition_id, fields, device, hints)

    def _get_samples(
        self,
        ids: list[str],
        partition_id: str,
        names: list[str],
        to: torch.device | None,
        hints: tuple[str | None, np.ndarray, np.ndarray] | None = None,
    ) -> Flow:
        """The get flow, of checked arguments: straight from the units where the rows'
        (unit, generation) are known (the meta's ``hints``, else this client's route
        cache), else located by the controller."""
        cached = hints is None
        if cached and self._direct_backoff.try_direct(partition_id):
            known = self._routes.routes(partition_id, ids)
            hints = None if known is None else (None, *known)
        if hints is not None:
            codecs_key, units, gens = hints
            got = yield from self._direct_get(
                ids, partition_id, names, units, gens, codecs_key, to, learn=not cached
            )
            if cached and got is None:
                self._direct_backoff.refused(partition_id)  # the locate path reads it
            elif cached:
                self._direct_backoff.served(partition_id)
            if got is not None:
                return got
        return (yield from self._get_flow(ids, partition_id, names, device=to))

    def _direct_get(
        self,
        sample_ids: list[str],
        partition_id: str,
        fields: list[str],
        units: np.ndarray,
        gens: np.ndarray,
        codecs_key: str | None,
        device: torch.device | None,
        learn: bool = True,
    ) -> Flow:
        """A get straight from the units that hold the rows at generations ``gens``: one
        round trip. None when it cannot be served so (a unit no longer holds a row at its
        generation, died, or any other failure): the caller asks the controller, whose
        answer is the truth, so a stale hint costs a round trip, never data nor an error.
        ``codecs_key``: the codecs the rows were written with (a claim's hints say so);
        ``learn``: remember the routes once served (False: they came from our cache)."""
        transport = self._open_transport()
        if ((units < 0) | (units >= len(transport.units))).any():
            return None
        cached = self._codecs.get(partition_id)
        codecs_ref = None
        if cached is None:  # asked now, answered while the units read: no round trip of its own
            codecs_ref = self._ask_codecs(partition_id)
        elif codecs_key is not None and cached.key != codecs_key:  # registered again since
            codecs_ref = self._open_controller().field_codecs.remote(partition_id)
        plan = {int(u): np.nonzero(units == u)[0] for u in np.unique(units)}
        by_unit = {u: [sample_ids[i] for i in rows] for u, rows in plan.items()}
        expect = {u: gens[rows].tolist() for u, rows in plan.items()}
        results = yield from transport.read_flow(partition_id, by_unit, fields, expect=expect)
        for r in results:
            if isinstance(r, CorruptPayload):
                raise r  # already pulled twice: not a stale route, reading again would hide it
        if any(isinstance(r, BaseException) for r in results):
            return None
        try:
            decoded = _assembled(results, plan, fields, len(sample_ids), device)
        except OSError:  # a chunk freed under us: the locate path re-reads
            return None
        codecs = cached
        if codecs_ref is not None:
            answer = (yield [codecs_ref])[0]
            self._codecs_asked.pop(partition_id, None)  # answered: a later miss asks anew
            if isinstance(answer, BaseException):
                return None
            codecs = answer
            if codecs_key is not None and codecs.key != codecs_key:
                return None  # registered again since the claim: the locate path says so
            self._codecs[partition_id] = codecs
        assert codecs is not None
        if learn:
            self._routes.remember(partition_id, sample_ids, units, gens)
        return to_tensordict(decoded, len(sample_ids), enums=codecs.enums, device=device)

    def _get_flow(
        self,
        sample_ids: list[str],
        partition_id: str,
        fields: list[str],
        failover: bool = True,
        device: torch.device | None = None,
    ) -> Flow:
        controller = self._open_controller()
        cached = self._codecs.get(partition_id)
        # Not read here before: its codecs are asked beside the locate, answered while the
        # units read rather than in a round trip after them (a fresh reader's first get).
        codecs_ref = controller.field_codecs.remote(partition_id) if cached is None else None
        where = _one((yield [controller.locate.remote(partition_id, sample_ids, fields)]))
        if cached is not None and cached.key != where.codecs_key:
            # Registered again since: decode with its codecs. Another thread may have
            # dropped it already (no KeyError), or cached the new ones (asked again).
            self._drop_codecs(partition_id)
        units = np.asarray(where.units, dtype=np.int64)
        self._routes.remember(
            partition_id,
            sample_ids,
            units,
            -1 if where.generations is None else where.generations,
        )
        plan = {int(u): np.nonzero(units == u)[0] for u in np.unique(units)}
        by_unit = {u: [sample_ids[i] for i in rows] for u, rows in plan.items()}
        results = yield from self._open_transport().read_flow(partition_id, by_unit, fields)
        for (u, rows), r in zip(plan.items(), results):
            if isinstance(r, RayActorError):
                yield from self._unit_died(u)
                if self._replicas > 1 and failover:  # their second copies serve them now
                    return (
                        yield from self._get_flow(sample_ids, partition_id, fields, False, device)
                    )
                raise SamplesLost(
                    "their storage unit died",
                    ids=[sample_ids[i] for i in rows],
                    partition_id=partition_id,
                )
            if isinstance(r, BaseException):
                raise r
        try:
            decoded = _assembled(results, plan, fields, len(sample_ids), device)
        except OSError:
            # A chunk was freed between our validation and our mapping (a concurrent
            # clear or overwrite): read through Ray, which re-validates on the unit.
            results = yield from self._open_transport().read_flow(
                partition_id, by_unit, fields, via_ray=True
            )
            for r in results:
                if isinstance(r, BaseException):
                    raise r from None
            decoded = _assembled(results, plan, fields, len(sample_ids), device)
        codecs = None
        if codecs_ref is not None:
            answer = (yield [codecs_ref])[0]
            # Answered before a registration the locate saw: the codecs are asked again.
            if not isinstance(answer, BaseException) and answer.key == where.codecs_key:
                codecs = self._codecs[partition_id] = answer
        if codecs is None:
            codecs = yield from self._codecs_of(partition_id)
        if codecs.key != where.codecs_key:  # registered again (samples deleted) while we read
            raise SamplesNotFound(
                "the partition was registered again while they were read",
                ids=sample_ids,
                partition_id=partition_id,
            )
        return to_tensordict(decoded, len(sample_ids), enums=codecs.enums, device=device)

    # ---- claims and consumption ---------------------------------------------------
    def _claims(self) -> ClaimBatcher:
        """This client's claim batcher (made on first use, so a client that never claims
        starts no thread; ``_made_once``); once closed, the closed batcher stays and
        refuses claims with ServiceUnavailable."""
        return self._made_once(
            "_batcher",
            lambda controller: ClaimBatcher(
                lambda requests: _get_sync(controller.claim_many.remote(requests))
            ),
        )

    def _claim_meta(self, request: ClaimRequest) -> Flow:
        """The claim goes to the controller with this client's concurrent ones (the claim
        batcher's answer, a Future, is waited on like a ref); a blocking one with nothing
        due then waits at the controller, alone, for what is left of its timeout."""
        started = time.monotonic()
        request = dataclasses.replace(request, request_id=uuid.uuid4().hex)
        outcome = _one((yield [self._claims().submit(request)]))
        if outcome.must_wait:
            return _one((yield [self._wait_claim(request, started)]))
        return _claim_answer(request, outcome)

    def _wait_claim(self, request: ClaimRequest, started: float) -> Any:
        """A blocking claim with nothing due when its batch was served: now a claim of its
        own that waits at the controller for what is left of its timeout."""
        left = max(request.timeout_s - (time.monotonic() - started), 0.0)
        return self._open_controller().claim_meta.remote(
            dataclasses.replace(request, timeout_s=left)
        )

    def _ack(self, partition_id: str, task: str, ids: list[str], lease_id: int) -> Any:
        return self._open_controller().ack.remote(partition_id, task, ids, lease_id)

    def _reset_consumption(self, partition_id: str, task_name: str) -> Any:
        return self._open_controller().reset_consumption.remote(partition_id, task_name)

    def _commit_step(self, partition_id: str, task_name: str, step: int) -> Any:
        return self._open_controller().commit_step.remote(partition_id, task_name, step)

    def _rewind_to_step(self, partition_id: str, task_name: str, step: int | None) -> Any:
        return self._open_controller().rewind_to_step.remote(partition_id, task_name, step)

    def _check_consumption_status(self, partition_id: str, task_names: list[str]) -> Any:
        return self._open_controller().check_consumption_status.remote(partition_id, task_names)

    def _consumption_detail(self, partition_id: str, task_names: list[str]) -> Any:
        return self._open_controller().consumption_detail.remote(partition_id, task_names)

    def _describe_partition(self, partition_id: str) -> Any:
        return self._open_controller().describe_partition.remote(partition_id)

    def _service_info(self) -> Flow:
        info = _one((yield [self._open_controller().service_info.remote()]))
        # How this process reaches each unit's bytes: the client's own view (its probe).
        return dataclasses.replace(info, payload_paths=self._open_transport().payload_paths())

    # ---- async RL: versions, admission, introspection ------------------------------
    def _set_policy_version(self, partition_id: str, version: int) -> Any:
        return self._open_controller().set_policy_version.remote(partition_id, version)

    def _policy_version(self, partition_id: str) -> Any:
        return self._open_controller().policy_version.remote(partition_id)

    def _admit_rollouts(
        self, partition_id: str, n: int, wait: bool, timeout_s: float, lease_s: float
    ) -> Any:
        return self._open_controller().admit_rollouts.remote(
            partition_id, n, wait, timeout_s, lease_s
        )

    def _release_rollouts(self, grant: RolloutGrant) -> Any:
        return self._open_controller().release_rollouts.remote(grant.partition_id, grant.grant_id)

    def _evict_samples(self, ids: list[str], partition_id: str) -> Any:
        self._forget(partition_id, ids)
        return self._open_controller().evict_samples.remote(partition_id, ids)

    def _peek_meta(self, request: ClaimRequest) -> Any:
        return self._open_controller().peek_meta.remote(request)

    def _ready_depth(
        self, partition_id: str, task_names: list[str], required_fields: list[str]
    ) -> Any:
        return self._open_controller().ready_depth.remote(partition_id, task_names, required_fields)

    def _capabilities(self) -> Any:
        return self._open_controller().capabilities.remote(service_verbs(type(self)))

    def _ping(self) -> Any:
        return self._open_controller().ping.remote()

    # ---- clear --------------------------------------------------------------------
    def _clear_versions(self, partition_id: str, lowest: int, highest: int) -> Any:
        self._routes.forget(partition_id, None)
        return self._open_controller().clear_versions.remote(partition_id, lowest, highest)

    def _clear_samples(self, ids: list[str] | None, partition_id: str) -> Any:
        self._forget(partition_id, ids)
        return self._open_controller().clear.remote(partition_id, ids)

    def close(self) -> None:
        """Release the handles; idempotent. A verb still running then completes or raises
        ServiceUnavailable; claims already queued are still sent."""
        with self._batcher_lock:  # no batcher is made after this
            self._controller = None
            transport, self._transport = self._transport, None
            batchers = [self._batcher, self._commit_batcher]
        for batcher in batchers:
            if batcher is not None:
                batcher.close()
        if transport is not None:
            transport.close()
        self._routes.clear()
        self._codecs.clear()

    # ---- Ray only: the store to files and back ---------------------------------------
    @verb
    def checkpoint(self, directory: str, parent: str | None = None) -> str:
        """Save the whole store (declarations, samples, cursors, leases) as of one instant to
        a new directory, reachable from every storage unit's node, while writers and
        claimers go on; returns its absolute path. ``parent``: an earlier checkpoint of
        this service, whose files are hard-linked for the bytes it holds already, so only
        bytes new since it are copied."""
        return checked(
            arguments.directory(directory),
            None if parent is None else arguments.directory(parent),
        )

    checkpoint_async = awaitable(checkpoint)

    @verb
    def restore(self, directory: str) -> int:
        """Load a checkpoint into this (empty) service; returns the number of samples."""
        return checked(arguments.directory(directory))

    restore_async = awaitable(restore)

    def _checkpoint(self, directory: str, parent: str | None) -> Any:
        return self._open_controller().checkpoint.remote(directory, parent)

    def _restore(self, directory: str) -> Any:
        return self._open_controller().restore.remote(directory)


def connect(
    name: str = "dataplane",
    namespace: str = "dataplane",
    address: str | None = None,
    *,
    warm_reads: bool = True,
    cross_node_transport: str | None = None,
) -> RayDataPlaneClient:
    """Attach to a running service from any process of the Ray cluster.

    ``address`` (e.g. ``"10.0.0.5:6379"``, ``"auto"``) joins that Ray cluster
    first when this process has not initialised Ray; an initialised Ray is used
    as it is. ``warm_reads``: import now what this process's first read needs
    (:func:`warm_read_path`) and introduce the process to the units on its node
    (``Transport.introduce``), so its first put and get cost what later ones do;
    False for a process that never moves samples (the admin endpoint's mutations).
    ``cross_node_transport="ray"``: read from units on other nodes through Ray's object
    transfer even where the service offers a transfer engine (the probe's choice is
    logged once and shown in ``service_info().payload_paths``).
    """
    if not ray.is_initialized():
        if address is None:
            raise ServiceUnavailable(
                "Ray is not initialised in this process; pass connect(..., address=...) "
                "or call ray.init(address=...) first"
            )
        _join_ray(address)
    try:
        controller = ray.get_actor(name, namespace=namespace)
    except ValueError:
        raise ServiceUnavailable(
            f"no data-plane service named {name!r} in namespace {namespace!r}"
        ) from None
    if warm_reads:
        warm_read_path()
    client = RayDataPlaneClient(
        controller, name=name, namespace=namespace, cross_node_transport=cross_node_transport
    )
    if warm_reads:
        client._open_transport().introduce()
        client._open_transport().payload_paths()  # the capability probe, at connect
    return client


# How Ray's messages name a refused token; Ray 2.60 reports it inside a ConnectionError
# (from a RuntimeError carrying the last GCS error as text), not as AuthenticationError.
_AUTH_FAILURE_MARKS = ("InvalidAuthToken", "Unauthenticated", "AuthenticationError")


def _auth_failure(exc: BaseException) -> str | None:
    """Ray's words for a cluster-auth failure anywhere in ``exc``'s chain, else None."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, AuthenticationError):
            return cause.message
        text = str(cause)
        mark = next((m for m in _AUTH_FAILURE_MARKS if m in text), None)
        if mark is not None:
            line = next(x for x in text.splitlines() if mark in x)
            return _in_words(line[line.index(mark) :].strip())
        cause = cause.__cause__ or cause.__context__
    return None


def _in_words(text: str, limit: int = 200) -> str:
    """``text`` up to ``limit`` characters, cut after a whole word (marked "...")."""
    if len(text) <= limit:
        return text
    return text[:limit].rsplit(" ", 1)[0] + " ..."


def warm_read_path() -> None:
    """Import what the first read of a process would otherwise import inside the call.

    A fresh reader's first 128 MiB get took 838 ms against 22 ms warm (issue 25): almost
    all of it importing ``tensordict``, which imports ``torch._dynamo`` (0.6-0.8 s on an
    idle 2-core machine, seconds under load), and ``numpy.ma``, which ``np.unique``
    reaches. Paid here, once per process and in the caller's thread (an import on a
    background thread could race a user's own imports of the same modules), it is part
    of starting a worker rather than a stall inside its first training step.
    """
    import numpy.ma  # noqa: F401
    import tensordict  # noqa: F401


def _join_ray(address: str) -> None:
    """``ray.init(address)``, its failures as ServiceUnavailable saying what to do. A GCS
    that refuses a process without token auth is asked first (``ray_auth``): one call,
    rather than Ray's 20 retries."""
    try:
        # 'auto' resolved and a loopback cluster kept on loopback, as `dataplane serve` does
        resolved = join_address(address)
        said = refused_without_token(resolved)
        if said is None:
            ray.init(address=resolved, log_to_driver=False)
    except (AuthenticationError, ConnectionError, RuntimeError) as e:
        said = _auth_failure(e)
        if said is None:
            raise ServiceUnavailable(f"cannot reach a Ray cluster at {address!r}: {e}") from None
    if said is not None:
        how = (
            "and give it"
            if token_mode()
            else "this process is not in token mode: set RAY_AUTH_MODE=token before it "
            "imports ray, and give it"
        )
        raise ServiceUnavailable(
            f"Ray token authentication failed joining {address!r}: the cluster needs a token "
            f"(RAY_AUTH_MODE=token); {how} the cluster's token in RAY_AUTH_TOKEN, in the file "
            f"RAY_AUTH_TOKEN_PATH names, or in ~/.ray/auth_token (Ray said: {said})"
        )
