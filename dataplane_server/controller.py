"""Controller: the async Ray actor around the key space.

All metadata and every decision live in ``dataplane_server.keyspace`` (no Ray
there); this shell validates arguments, talks to the storage units, and makes
blocking claims wait on a per-partition asyncio condition, so a waiting claim
never stalls another caller. Whenever it awaits, the key space is consistent:
a commit is checked, then published on the units, then applied in one step.

Surviving its own death: Ray restarts the controller with the same arguments
(the unit handles and a journal directory). Before serving the first call a
(re)started controller rebuilds its key space from the units, which hold every
sample's bytes and metadata, and from its journal, which holds what only it
knows (declarations, consumption, leases); see ``recovery`` and ``journal``.
A background task watches unit and node liveness, so a lost unit's samples
become lost (terminal) within seconds, not at the next failed read.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
import sys
import time
from collections import OrderedDict
from typing import Any

import ray

from dataplane_client import arguments
from dataplane_client.errors import (
    ClaimTimeout,
    DataPlaneError,
    InvalidBatch,
    SamplesLost,
    ServiceUnavailable,
    UnknownPartition,
)
from dataplane_client.messages import (
    ClearResult,
    CommitRequest,
    CommitResult,
    ControllerSnapshot,
    FieldCodecs,
    Location,
    PartitionDescription,
    PartitionStats,
    PartitionSummary,
    Routing,
    SamplePage,
    SampleStatus,
    ServiceInfo,
    TaskConsumption,
    UnitInfo,
    UnitSnapshot,
)
from dataplane_client.meta import KVBatchMeta
from dataplane_server import checkpoint, recovery
from dataplane_server.admin import views
from dataplane_server.columns import counts_errors
from dataplane_server.journal import Journal
from dataplane_server.keyspace import CommitPlan, KeySpace, declaration
from dataplane_server.recovery_messages import SampleMeta
from dataplane_server.stats import Stats

VERSION = "0.1.0"
UNIT_PING_TIMEOUT_S = 5.0
_COMMITTED_REMEMBERED = 65536  # write ids of applied commits: a retried commit is a no-op


def _recovered(method):
    """Serve the call only once the key space is rebuilt (after a start or a restart)."""

    @functools.wraps(method)
    async def wrapper(self, *args, **kwargs):
        await self._up()
        result = method(self, *args, **kwargs)
        return await result if inspect.isawaitable(result) else result

    return wrapper


def _is_dead_actor(exc: BaseException) -> bool:
    return isinstance(exc, ray.exceptions.RayActorError)


def _typed(exc: BaseException) -> BaseException:
    """The typed error a unit raised, without Ray's task-error wrapper."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, DataPlaneError) else exc


@ray.remote
class Controller:
    def __init__(self, config: dict, units: list | None = None, state_dir: str | None = None):
        self.config = config
        self.keys = KeySpace()
        self.units: list = list(units or [])
        self.unit_info: list[UnitInfo] = []
        self.journal = (
            Journal(state_dir, fsync=bool(config.get("journal_fsync", False)))
            if state_dir
            else None
        )
        self._recovery: asyncio.Future | None = None
        self._watcher: asyncio.Task | None = None
        self._next_seq = 1  # commit sequence number: row order when rebuilt from the units
        self._committed: OrderedDict[str, None] = OrderedDict()
        self._emptied: dict[str, float] = {}  # partition -> when its last sample was cleared
        self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self.started_at = time.time()
        self.draining = False
        self.stats = Stats()
        self._changed: dict[str, asyncio.Condition] = {}  # partition -> claims wait here
        self._lifecycle = asyncio.Lock()  # register / delete of one id never interleave
        # Tests only: an async callable awaited between publish and apply, to widen that window.
        self.after_publish = None

    # ---- wiring -------------------------------------------------------------------
    async def attach_units(self, handles: list | None = None) -> list[UnitInfo]:
        """Wait for the key space to be rebuilt; ``handles`` only if none were given at start."""
        if handles is not None and not self.units:
            self.units = list(handles)
        await self._up()
        return self.unit_info

    async def _up(self) -> None:
        if self._recovery is None:
            self._recovery = asyncio.ensure_future(self._recover())
        try:
            await asyncio.shield(self._recovery)
        except DataPlaneError:
            raise
        except Exception as e:  # said as the typed error; the cause is kept
            raise ServiceUnavailable(f"the controller could not rebuild its state: {e!r}") from e

    async def _recover(self) -> None:
        """Rebuild the key space from the units and the journal (fresh start: both empty)."""
        t0 = time.perf_counter()
        infos = await asyncio.gather(*[self._ping(i) for i in range(len(self.units))])
        alive = [info is not None for info in infos]
        self.unit_info = [info or UnitInfo(i, "", "", 0, False) for i, info in enumerate(infos)]
        views = await recovery.settle_pending_writes(self.units, alive)
        self.keys = KeySpace()
        self.keys.unit_alive = alive
        state = self.journal.load() if self.journal else {}
        orphans = recovery.rebuild(self.keys, state, views)
        for pid, units in orphans.items():  # deleted just before a crash: free the bytes
            await self._free_on_units(pid, dict.fromkeys(units))
        self._next_seq = recovery.next_commit_seq(views)
        self._committed.update(dict.fromkeys(recovery.published_write_ids(views)))
        if self.journal:
            self.journal.compact(self.keys.export_state())
        self.stats.observe("recovery_seconds", time.perf_counter() - t0)
        if self.restarted:
            self.stats.inc("controller_restarts_total")
        if self._watcher is None:
            self._watcher = asyncio.ensure_future(self._watch())

    async def _ping(self, index: int) -> UnitInfo | None:
        try:
            return await asyncio.wait_for(
                self.units[index].ping.remote(), timeout=UNIT_PING_TIMEOUT_S
            )
        except Exception:  # noqa: BLE001 - no answer: the unit is treated as lost
            return None

    def _log(self, *record) -> None:
        if self.journal is None:
            return
        self.journal.append(*record)
        if self.journal.due():
            self.journal.compact(self.keys.export_state())

    @_recovered
    def unit_handles(self) -> list:
        return self.units

    @_recovered
    def routing(self) -> Routing:
        return Routing(
            units=self.units,
            alive=list(self.keys.unit_alive),
            nodes=[info.node_id for info in self.unit_info],
            shm=[bool(info.shm) for info in self.unit_info],
        )

    @_recovered
    async def mark_unit_lost(self, index: int) -> bool:
        """Called when a client saw a unit die; verify before believing it."""
        if not self.keys.unit_alive[index]:
            return False
        try:
            await asyncio.wait_for(self.units[index].ping.remote(), timeout=UNIT_PING_TIMEOUT_S)
            return False
        except Exception:  # noqa: BLE001 - any failure to answer means the unit is gone
            await self._lose_unit(index)
            return True

    async def _lose_unit(self, index: int) -> None:
        """Its samples are lost (terminal) from now on; waiting claims re-check."""
        if not self.keys.unit_alive[index]:
            return
        self.keys.unit_alive[index] = False
        self.stats.inc("units_lost_total")
        for pid in list(self._changed):
            await self._wake(pid)

    # ---- background: liveness of units and nodes, retention of emptied partitions ----
    async def _watch(self) -> None:
        every_s = float(self.config.get("liveness_interval_s", 1.0))
        while True:
            await asyncio.sleep(every_s)  # a periodic timer, not synchronisation
            try:
                await self._check_liveness(every_s)
                await self._apply_retention()
            except Exception:  # noqa: BLE001 - one failed round must not end watching; counted
                self.stats.inc("liveness_check_errors_total")

    async def _check_liveness(self, timeout_s: float) -> None:
        """A unit is lost when its node is dead in Ray's view or the unit itself died."""
        nodes = await asyncio.to_thread(ray.nodes)
        dead_nodes = {n["NodeID"] for n in nodes if not n.get("Alive")}
        watched = [i for i, ok in enumerate(self.keys.unit_alive) if ok]
        for i in watched:
            if self.unit_info[i].node_id in dead_nodes:
                await self._lose_unit(i)

        async def dead(i: int) -> bool:
            try:
                await asyncio.wait_for(self.units[i].ping.remote(), timeout=max(timeout_s, 1.0))
            except Exception as e:  # noqa: BLE001 - only a dead actor is proof; slow is not
                return _is_dead_actor(e)
            return False

        for i, gone in zip(watched, await asyncio.gather(*[dead(i) for i in watched])):
            if gone:
                await self._lose_unit(i)

    async def _apply_retention(self) -> None:
        """Delete emptied partitions beyond the newest N, or emptied T seconds ago (opt-in)."""
        keep_n = self.config.get("retain_emptied_partitions")
        keep_s = self.config.get("retain_emptied_partitions_s")
        if keep_n is None and keep_s is None:
            return
        for pid in list(self._emptied):  # written to again since: not empty any more
            part = self.keys.partitions.get(pid)
            if part is None or part.num_samples:
                del self._emptied[pid]
        emptied = list(self._emptied.items())  # oldest first
        extra = max(len(emptied) - keep_n, 0) if keep_n is not None else 0
        victims = [pid for pid, _ in emptied[:extra]]
        if keep_s is not None:
            now = time.monotonic()
            victims += [pid for pid, since in emptied if now - since >= keep_s]
        for pid in dict.fromkeys(victims):
            del self._emptied[pid]
            async with self._lifecycle:
                part = self.keys.partitions.get(pid)
                if part is not None and not part.num_samples:
                    await self._delete(pid)
                    self.stats.inc("partitions_retired_total")

    @_recovered
    def ready(self) -> bool:
        """True once the key space is rebuilt: the admin health check's probe of the controller."""
        return True

    def set_draining(self, flag: bool) -> None:
        self.draining = bool(flag)

    async def _wake(self, partition_id: str) -> None:
        cond = self._changed.get(partition_id)
        if cond is not None:
            async with cond:
                cond.notify_all()

    async def _free_on_units(self, partition_id: str, targets: dict[int, list[str] | None]) -> int:
        freed = await asyncio.gather(
            *[self.units[u].clear.remote(partition_id, ids) for u, ids in targets.items()],
            return_exceptions=True,
        )
        return sum(f for f in freed if isinstance(f, int))

    # ---- partitions ---------------------------------------------------------------
    @_recovered
    @counts_errors
    async def register_partition(
        self,
        partition_id: str,
        fields: list[str],
        num_samples: int | None,
        consumer_tasks: list[str],
        grpo_group_size: int | None = None,
        task_leases: dict[str, float] | None = None,
        enums: dict[str, list[str]] | None = None,
        object_fields: list[str] | None = None,
    ) -> None:
        """Declare a partition; an existing one of that id is deleted first (bytes freed).

        Checked in full before the old partition is touched, so a refused
        registration never reaches the partition it would replace.
        """
        declared = declaration(
            partition_id,
            fields,
            num_samples,
            consumer_tasks,
            grpo_group_size,
            task_leases,
            enums,
            object_fields,
        )
        async with self._lifecycle:
            if partition_id in self.keys.partitions:
                await self._delete(partition_id)
            self.keys.register(partition_id, declared)
            self._log("register", partition_id, declared.to_record())

    @_recovered
    @counts_errors
    def field_codecs(self, partition_id: str) -> FieldCodecs:
        """The partition's enums and object fields, for clients that did not register it."""
        return self.keys.partition(partition_id).declaration.codecs

    @_recovered
    @counts_errors
    async def delete_partition(self, partition_id: str) -> ClearResult:
        """Forget the partition and free its bytes; claims waiting on it fail (UnknownPartition)."""
        async with self._lifecycle:
            return await self._delete(partition_id)

    async def _delete(self, partition_id: str) -> ClearResult:
        part = self.keys.delete(partition_id)
        self._log("delete", partition_id)  # before the bytes go: a crash now frees them anyway
        self._emptied.pop(partition_id, None)
        await self._wake(partition_id)
        self._changed.pop(partition_id, None)
        freed = await self._free_on_units(partition_id, dict.fromkeys(self.keys.live_units()))
        self.stats.inc("cleared_samples_total", part.num_samples)
        self.stats.inc("partitions_deleted_total")
        return ClearResult(cleared=part.num_samples, bytes_freed=freed)

    # ---- commit (the single visibility point of a write) --------------------------
    @_recovered
    @counts_errors
    async def commit(self, request: CommitRequest) -> CommitResult:
        """Check, publish the staged bytes on every unit, then make the fields visible.

        A result with ``rerouted`` changed nothing: existing samples live on other
        units than the writer assumed. A commit spanning several units is first
        prepared on each (pinned), so publishing can fail only by a unit's death
        and a controller that dies half way rolls it forward when it restarts.
        A commit retried after a restart (its write already published) is a no-op.
        """
        if request.write_id in self._committed:
            return self._committed_result(request)
        plan = self.keys.check_commit(request)
        if not isinstance(plan, CommitPlan):
            return plan
        metas = self._sample_metas(request)
        try:
            if len(request.staged_units) > 1:
                await self._on_units(
                    plan,
                    request,
                    [
                        self.units[u].prepare.remote(
                            request.write_id, metas[u], request.staged_units
                        )
                        for u in request.staged_units
                    ],
                    published=[],
                )
                calls = [
                    self.units[u].publish.remote(request.write_id) for u in request.staged_units
                ]
            else:
                (u,) = request.staged_units
                calls = [self.units[u].publish.remote(request.write_id, metas[u])]
            await self._on_units(plan, request, calls, published=request.staged_units)
        except BaseException:
            self.keys.release(plan)
            raise
        if self.after_publish is not None:
            await self.after_publish()
        try:
            result, cleared_meanwhile = self.keys.apply_commit(plan)
        except UnknownPartition:
            await self._unpublish(request, request.staged_units)
            raise
        self._remember_commit(request)
        await self._free_on_units(request.partition_id, cleared_meanwhile)
        self.stats.inc("commits_total")
        self.stats.inc("committed_samples_total", len(request.sample_ids))
        await self._wake(request.partition_id)
        return result

    async def _on_units(self, plan, request: CommitRequest, calls: list, published: list) -> None:
        """Await one call per staged unit. A typed refusal (e.g. a stage past its deadline)
        reaches the caller as itself; only a dead unit is a lost unit."""
        results = await asyncio.gather(*calls, return_exceptions=True)
        failed = {
            u: r for u, r in zip(request.staged_units, results) if isinstance(r, BaseException)
        }
        if not failed:
            return
        died = [u for u, r in failed.items() if _is_dead_actor(r)]
        for u in died:
            await self.mark_unit_lost(u)
        # Bytes made visible on a unit for a commit that will not be applied are freed.
        await self._unpublish(request, [u for u in published if u not in failed])
        if not died:
            raise _typed(next(iter(failed.values())))
        raise SamplesLost(
            f"storage units {died} failed while publishing",
            ids=[s for s, u in zip(request.sample_ids, request.units) if u in died],
            partition_id=request.partition_id,
        )

    def _sample_metas(self, request: CommitRequest) -> dict[int, SampleMeta]:
        """What each unit keeps beside the bytes so a restarted controller can rebuild."""
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        lengths: dict[int, dict] = {u: {} for u in request.staged_units}
        tags: dict[int, dict] = {u: {} for u in request.staged_units}
        for i, (sid, u) in enumerate(zip(request.sample_ids, request.units)):
            if request.sequence_lengths is not None:
                lengths[u][sid] = int(request.sequence_lengths[i])
            if request.tags and request.tags[i]:
                tags[u][sid] = request.tags[i]
        return {u: SampleMeta(seq, lengths[u], tags[u]) for u in request.staged_units}

    def _remember_commit(self, request: CommitRequest) -> None:
        self._committed[request.write_id] = None
        while len(self._committed) > _COMMITTED_REMEMBERED:
            self._committed.popitem(last=False)
        self._emptied.pop(request.partition_id, None)

    def _committed_result(self, request: CommitRequest) -> CommitResult:
        part = self.keys.partition(request.partition_id)
        rows = part.rows_of(request.sample_ids)
        lengths = [int(part.seq_len[r]) if r >= 0 else -1 for r in rows.tolist()]
        return CommitResult(sequence_lengths=lengths)

    async def _unpublish(self, request: CommitRequest, units: list[int]) -> None:
        """Free bytes published for a commit that will not become visible."""
        by_unit: dict[int, list[str]] = {}
        for s, u in zip(request.sample_ids, request.units):
            if u in units:
                by_unit.setdefault(u, []).append(s)
        await self._free_on_units(request.partition_id, by_unit)

    # ---- reads --------------------------------------------------------------------
    @_recovered
    @counts_errors
    def locate(self, partition_id: str, sample_ids: list[str], fields: list[str]) -> Location:
        """Validate a read and say where each sample's bytes live."""
        return self.keys.locate(partition_id, sample_ids, fields)

    @_recovered
    def lookup_units(self, partition_id: str, sample_ids: list[str]) -> list[int]:
        """Recorded unit per sample (-1 = not written yet), for inspection and tests."""
        return self.keys.lookup_units(partition_id, sample_ids)

    # ---- claims -------------------------------------------------------------------
    def _condition(self, partition_id: str) -> asyncio.Condition:
        cond = self._changed.get(partition_id)
        if cond is None:
            cond = self._changed[partition_id] = asyncio.Condition()
        return cond

    @_recovered
    @counts_errors
    async def claim_meta(
        self,
        partition_id: str,
        task_name: str,
        required_fields: list[str],
        batch_size: int,
        dp_rank: int | None = None,
        blocking: bool = True,
        timeout_s: float = 60.0,
    ) -> KVBatchMeta | None:
        """Hand out up to ``batch_size`` ready samples the task has not consumed.

        Without a lease the samples are consumed for the task at once; a leased
        task holds them until ``ack`` (or until the lease runs out). A blocking
        claim waits for a full batch (or the tail of a partition of known size)
        and raises ClaimTimeout otherwise.
        """
        required = arguments.name_list(required_fields, "required_fields", allow_empty=True)
        batch_size = arguments.count(batch_size, "batch_size", minimum=1)
        timeout_s = arguments.seconds(timeout_s, "timeout_s")
        part = self.keys.partition(partition_id)
        self.keys.task_of(part, task_name)
        meta = self._claim(part, task_name, required, batch_size, dp_rank, not blocking)
        if meta is None and blocking:
            self._raise_if_unsatisfiable(part, task_name)
            meta = await self._wait_for_claim(
                part, task_name, required, batch_size, dp_rank, timeout_s
            )
        return meta

    def _claim(self, part, task, required, batch_size, dp_rank, partial_ok) -> KVBatchMeta | None:
        meta = self.keys.claim(
            part, task, required, batch_size, partial_ok=partial_ok, dp_rank=dp_rank
        )
        if meta is not None:
            lease = part.declaration.task_leases.get(task)
            deadline = None if lease is None else time.time() + lease
            self._log(
                "claim",
                part.partition_id,
                task,
                meta.sample_ids,
                deadline,
                meta.extra_info.get("lease_id"),
            )
            self.stats.inc("claims_total")
            self.stats.inc("claimed_samples_total", meta.size)
        return meta

    def _raise_if_unsatisfiable(self, part, task: str) -> None:
        lost = self.keys.unsatisfiable(part, task)
        if lost:
            raise SamplesLost(
                f"task {task!r} can never get a batch: every other sample of the partition is "
                "done, and these were lost with their storage unit",
                ids=lost,
                partition_id=part.partition_id,
            )

    async def _wait_for_claim(
        self, part, task, required, batch_size, dp_rank, timeout_s
    ) -> KVBatchMeta:
        deadline = time.monotonic() + timeout_s
        cond = self._condition(part.partition_id)
        part.waiting_claims += 1
        try:
            async with cond:
                while (remaining := deadline - time.monotonic()) > 0:
                    expiry = self.keys.next_lease_expiry(part, task)
                    if expiry is not None:  # wake when a lease runs out, too
                        remaining = min(remaining, max(expiry - self.keys.clock(), 0.001))
                    try:
                        await asyncio.wait_for(cond.wait(), timeout=remaining)
                    except asyncio.TimeoutError:
                        pass
                    if self.keys.partitions.get(part.partition_id) is not part:
                        raise UnknownPartition(
                            "partition deleted while the claim waited",
                            partition_id=part.partition_id,
                        )
                    meta = self._claim(part, task, required, batch_size, dp_rank, False)
                    if meta is not None:
                        return meta
                    self._raise_if_unsatisfiable(part, task)
        finally:
            part.waiting_claims -= 1
        have = self.keys.ready_count(part, task, required, batch_size)
        raise ClaimTimeout(
            f"only {have} of {batch_size} samples ready after {timeout_s}s (task {task!r})",
            fields=required,
            partition_id=part.partition_id,
        )

    @_recovered
    @counts_errors
    async def ack(self, partition_id: str, task_name: str, sample_ids: list[str], lease_id) -> int:
        """Acknowledge leased samples (done for the task); returns how many were newly done."""
        ids = arguments.id_list(sample_ids)
        done = self.keys.ack(partition_id, task_name, ids, lease_id)
        self._log("ack", partition_id, task_name, ids)
        self.stats.inc("acked_samples_total", done)
        return done

    @_recovered
    @counts_errors
    async def reset_consumption(self, partition_id: str, task_name: str) -> None:
        self.keys.reset_consumption(partition_id, task_name)
        self._log("reset", partition_id, task_name)
        await self._wake(partition_id)

    @_recovered
    @counts_errors
    def check_consumption_status(self, partition_id: str, task_names: list[str]) -> bool:
        """True iff every named task has consumed every sample of the partition."""
        return all(t.done for t in self._consumption(partition_id, task_names))

    @_recovered
    @counts_errors
    def consumption_detail(self, partition_id: str, task_names: list[str]) -> list[TaskConsumption]:
        """Per task: consumed / total / expected, leases held and redeliveries."""
        return self._consumption(partition_id, task_names)

    def _consumption(self, partition_id: str, task_names: list[str]) -> list[TaskConsumption]:
        part = self.keys.partition(partition_id)
        return [self.keys.consumption(part, t) for t in arguments.name_list(task_names, "tasks")]

    # ---- clearing -----------------------------------------------------------------
    @_recovered
    @counts_errors
    async def clear(self, partition_id: str, sample_ids: list[str] | None) -> ClearResult:
        """Forget samples and free their bytes; ``None`` deletes the whole partition."""
        if sample_ids is None:
            return await self.delete_partition(partition_id)
        ids = arguments.id_list(sample_ids, partition_id=partition_id)
        targets = self.keys.clear_samples(partition_id, ids)
        if not self.keys.partition(partition_id).num_samples:
            self._emptied[partition_id] = time.monotonic()
        freed = await self._free_on_units(partition_id, targets)
        self.stats.inc("cleared_samples_total", len(ids))
        await self._apply_retention()
        return ClearResult(cleared=len(ids), bytes_freed=freed)

    # ---- inspection (admin endpoint, metrics) --------------------------------------
    async def _unit_snapshots(self) -> list[UnitSnapshot | None]:
        async def one(i: int, unit: Any) -> UnitSnapshot | None:
            if not self.keys.unit_alive[i]:
                return None
            try:
                return await asyncio.wait_for(
                    unit.metrics_snapshot.remote(), timeout=UNIT_PING_TIMEOUT_S
                )
            except Exception:  # noqa: BLE001 - an unreachable unit shows as absent
                return None

        return await asyncio.gather(*[one(i, u) for i, u in enumerate(self.units)])

    @_recovered
    async def service_info(self) -> ServiceInfo:
        return views.service_info(
            self.keys,
            self.unit_info,
            await self._unit_snapshots(),
            name=self.config.get("name", ""),
            namespace=self.config.get("namespace", ""),
            version=VERSION,
            started_at=self.started_at,
            draining=self.draining,
            default_capacity=int(self.config.get("unit_capacity_bytes", 0)),
        )

    @_recovered
    async def list_partitions(self) -> list[PartitionSummary]:
        return views.list_partitions(self.keys, await self._unit_snapshots())

    @_recovered
    @counts_errors
    async def describe_partition(self, partition_id: str) -> PartitionDescription:
        self.keys.partition(partition_id)  # unknown -> typed error before asking the units
        return views.describe_partition(self.keys, partition_id, await self._unit_snapshots())

    @_recovered
    @counts_errors
    def list_samples(
        self, partition_id: str, status: str | None = None, offset: int = 0, limit: int = 100
    ) -> SamplePage:
        return views.list_samples(self.keys, partition_id, status, offset, limit)

    @_recovered
    @counts_errors
    def sample_status(self, partition_id: str, sample_id: str) -> SampleStatus:
        return views.sample_status(self.keys, partition_id, sample_id)

    @_recovered
    def metrics_snapshot(self) -> ControllerSnapshot:
        self.stats.counters["redeliveries_total"] = self.keys.redeliveries_total
        return ControllerSnapshot(
            stats=self.stats.snapshot(),
            claims_waiting=sum(p.waiting_claims for p in self.keys.partitions.values()),
            partitions=[
                PartitionStats(partition_id=pid, num_samples=p.num_samples)
                for pid, p in self.keys.partitions.items()
            ],
        )

    @_recovered
    def memory_footprint(self) -> dict[str, dict[str, int]]:
        """Rough bytes of metadata per partition (benchmarks: bytes per sample)."""
        out = {}
        for pid, p in self.keys.partitions.items():
            tables = (p.produced, p.consumed, p.lease_until, p.holder, p.deliveries)
            arrays = p.live.nbytes + p.seq_len.nbytes + p.unit.nbytes
            arrays += sum(a.nbytes for t in tables for a in t.values())
            dict_bytes = sys.getsizeof(p.row_of) + sum(sys.getsizeof(s) for s in p.row_of)
            lists = sys.getsizeof(p.ids) + sys.getsizeof(p.tags) + sys.getsizeof(p.group_of)
            out[pid] = {"samples": p.num_samples, "bytes": arrays + dict_bytes + lists}
        return out

    # ---- checkpoint and restore of the whole store ------------------------------------
    @_recovered
    @counts_errors
    async def checkpoint(self, directory: str) -> str:
        """Save declarations, samples (metadata and bytes), consumption and leases.

        Each unit writes its own file (the directory must be reachable from every
        unit's node); the manifest with every checksum is written last and the
        directory renamed into place, so a crash mid-save never leaves one that loads.
        Returns the checkpoint's absolute path.
        """
        tmp = checkpoint.start(directory)
        try:
            async with self._lifecycle:  # no partition appears or goes while saving
                state = self.keys.export_state()
                alive = self.keys.live_units()
                files = await asyncio.gather(*[self.units[u].dump.remote(tmp) for u in alive])
            checkpoint.finish(tmp, directory, list(files), state)
        except BaseException as e:
            checkpoint.abandon(tmp)
            if isinstance(e, Exception):
                raise _typed(e) from None
            raise
        self.stats.inc("checkpoints_total")
        return os.path.abspath(directory)

    @_recovered
    @counts_errors
    async def restore(self, directory: str) -> int:
        """Load a checkpoint into this (empty) service; returns the number of samples.

        Every file is checked against the manifest before anything is stored; the
        key space is then rebuilt exactly as after a restart.
        """
        files, state = checkpoint.read(directory)
        async with self._lifecycle:
            if self.keys.partitions:
                raise InvalidBatch(
                    f"restore needs an empty service; this one holds {len(self.keys.partitions)} "
                    "partitions"
                )
            alive = self.keys.live_units()
            if len(files) > len(alive):
                raise InvalidBatch(
                    f"the checkpoint has {len(files)} unit files; this service has "
                    f"{len(alive)} live units"
                )
            path = os.path.abspath(directory)
            loads = [self.units[u].load.remote(path, f) for u, f in zip(alive, files)]
            results = await asyncio.gather(*loads, return_exceptions=True)
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:  # undo what did load: the service stays empty
                await asyncio.gather(
                    *[self._free_on_units(pid, dict.fromkeys(alive)) for pid in state]
                )
                raise _typed(failed[0])
            if self.journal:
                self.journal.compact(state)
            views = await recovery.settle_pending_writes(self.units, list(self.keys.unit_alive))
            keys = KeySpace()
            keys.unit_alive = self.keys.unit_alive
            recovery.rebuild(keys, state, views)
            self.keys = keys
            self._next_seq = recovery.next_commit_seq(views)
        self.stats.inc("restores_total")
        return sum(results)
