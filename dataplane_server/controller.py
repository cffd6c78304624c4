"""Controller: the async Ray actor around the key space.

All metadata and every decision live in ``dataplane_server.keyspace`` (no Ray
there); this shell validates arguments, talks to the storage units, and makes
blocking claims wait on a per-partition asyncio condition, so a waiting claim
never stalls another caller. Whenever it awaits, the key space is consistent:
a commit is checked, then published on the units, then applied in one step.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import ray

from dataplane_client import arguments
from dataplane_client.errors import ClaimTimeout, InvalidBatch, SamplesLost, UnknownPartition
from dataplane_client.messages import (
    ClearResult,
    CommitRequest,
    CommitResult,
    ControllerSnapshot,
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
from dataplane_server.admin import views
from dataplane_server.columns import counts_errors
from dataplane_server.keyspace import CommitPlan, Declaration, KeySpace
from dataplane_server.stats import Stats

VERSION = "0.1.0"
UNIT_PING_TIMEOUT_S = 5.0


@ray.remote
class Controller:
    def __init__(self, config: dict):
        self.config = config
        self.keys = KeySpace()
        self.units: list = []
        self.unit_info: list[UnitInfo] = []
        self.started_at = time.time()
        self.draining = False
        self.stats = Stats()
        self._changed: dict[str, asyncio.Condition] = {}  # partition -> claims wait here
        self._lifecycle = asyncio.Lock()  # register / delete of one id never interleave
        # Tests only: an async callable awaited between publish and apply, to widen that window.
        self.after_publish = None

    # ---- wiring -------------------------------------------------------------------
    async def attach_units(self, handles: list) -> list[UnitInfo]:
        self.units = list(handles)
        self.unit_info = await asyncio.gather(*[u.ping.remote() for u in self.units])
        self.keys.unit_alive = [True] * len(self.units)
        return self.unit_info

    def unit_handles(self) -> list:
        return self.units

    def routing(self) -> Routing:
        return Routing(
            units=self.units,
            alive=list(self.keys.unit_alive),
            nodes=[info.node_id for info in self.unit_info],
            shm=[bool(info.shm) for info in self.unit_info],
        )

    async def mark_unit_lost(self, index: int) -> bool:
        """Called when a client saw a unit die; verify before believing it."""
        if not self.keys.unit_alive[index]:
            return False
        try:
            await asyncio.wait_for(self.units[index].ping.remote(), timeout=UNIT_PING_TIMEOUT_S)
            return False
        except Exception:  # noqa: BLE001 - any failure to answer means the unit is gone
            self.keys.unit_alive[index] = False
            self.stats.inc("units_lost_total")
            for pid in list(self._changed):
                await self._wake(pid)
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
    @counts_errors
    async def register_partition(
        self,
        partition_id: str,
        fields: list[str],
        num_samples: int | None,
        consumer_tasks: list[str],
        grpo_group_size: int | None = None,
        task_leases: dict[str, float] | None = None,
    ) -> None:
        """Declare a partition; an existing one of that id is deleted first (bytes freed)."""
        arguments.partition_name(partition_id)
        # Declaration refuses lease keys that are not consumer tasks (UnknownTask), so a refused
        # registration never reaches the partition it would replace.
        leases = {
            t: arguments.seconds(s, f"lease of {t!r}") for t, s in (task_leases or {}).items()
        }
        if any(s <= 0 for s in leases.values()):
            raise InvalidBatch("a lease must be longer than 0 s", partition_id=partition_id)
        declaration = Declaration(
            fields=arguments.name_list(fields, "fields", allow_empty=True),
            expected_samples=arguments.optional_count(num_samples, "num_samples", minimum=0),
            consumer_tasks=list(
                dict.fromkeys(
                    arguments.name_list(consumer_tasks, "consumer_tasks", allow_empty=True)
                )
            ),
            group_size=arguments.optional_count(grpo_group_size, "grpo_group_size", minimum=1),
            task_leases=leases,
        )
        async with self._lifecycle:
            if partition_id in self.keys.partitions:
                await self._delete(partition_id)
            self.keys.register(partition_id, declaration)

    @counts_errors
    async def delete_partition(self, partition_id: str) -> ClearResult:
        """Forget the partition and free its bytes; claims waiting on it fail (UnknownPartition)."""
        async with self._lifecycle:
            return await self._delete(partition_id)

    async def _delete(self, partition_id: str) -> ClearResult:
        part = self.keys.delete(partition_id)
        await self._wake(partition_id)
        self._changed.pop(partition_id, None)
        freed = await self._free_on_units(partition_id, dict.fromkeys(self.keys.live_units()))
        self.stats.inc("cleared_samples_total", part.num_samples)
        self.stats.inc("partitions_deleted_total")
        return ClearResult(cleared=part.num_samples, bytes_freed=freed)

    # ---- commit (the single visibility point of a write) --------------------------
    @counts_errors
    async def commit(self, request: CommitRequest) -> CommitResult:
        """Check, publish the staged bytes on every unit, then make the fields visible.

        A result with ``rerouted`` changed nothing: existing samples live on other
        units than the writer assumed.
        """
        plan = self.keys.check_commit(request)
        if not isinstance(plan, CommitPlan):
            return plan
        try:
            results = await asyncio.gather(
                *[self.units[u].publish.remote(request.write_id) for u in request.staged_units],
                return_exceptions=True,
            )
        except BaseException:
            self.keys.release(plan)
            raise
        failed = [u for u, r in zip(request.staged_units, results) if isinstance(r, BaseException)]
        if failed:
            self.keys.release(plan)
            for u in failed:
                await self.mark_unit_lost(u)
            await self._unpublish(request, [u for u in request.staged_units if u not in failed])
            raise SamplesLost(
                f"storage units {failed} failed while publishing",
                ids=[s for s, u in zip(request.sample_ids, request.units) if u in failed],
                partition_id=request.partition_id,
            )
        if self.after_publish is not None:
            await self.after_publish()
        try:
            result, cleared_meanwhile = self.keys.apply_commit(plan)
        except UnknownPartition:
            await self._unpublish(request, request.staged_units)
            raise
        await self._free_on_units(request.partition_id, cleared_meanwhile)
        self.stats.inc("commits_total")
        self.stats.inc("committed_samples_total", len(request.sample_ids))
        await self._wake(request.partition_id)
        return result

    async def _unpublish(self, request: CommitRequest, units: list[int]) -> None:
        """Free bytes published for a commit that will not become visible."""
        by_unit: dict[int, list[str]] = {}
        for s, u in zip(request.sample_ids, request.units):
            if u in units:
                by_unit.setdefault(u, []).append(s)
        await self._free_on_units(request.partition_id, by_unit)

    # ---- reads --------------------------------------------------------------------
    @counts_errors
    def locate(self, partition_id: str, sample_ids: list[str], fields: list[str]) -> Location:
        """Validate a read and say where each sample's bytes live."""
        return self.keys.locate(partition_id, sample_ids, fields)

    def lookup_units(self, partition_id: str, sample_ids: list[str]) -> list[int]:
        """Recorded unit per sample (-1 = not written yet), for inspection and tests."""
        return self.keys.lookup_units(partition_id, sample_ids)

    # ---- claims -------------------------------------------------------------------
    def _condition(self, partition_id: str) -> asyncio.Condition:
        cond = self._changed.get(partition_id)
        if cond is None:
            cond = self._changed[partition_id] = asyncio.Condition()
        return cond

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
            meta = await self._wait_for_claim(
                part, task_name, required, batch_size, dp_rank, timeout_s
            )
        return meta

    def _claim(self, part, task, required, batch_size, dp_rank, partial_ok) -> KVBatchMeta | None:
        meta = self.keys.claim(
            part, task, required, batch_size, partial_ok=partial_ok, dp_rank=dp_rank
        )
        if meta is not None:
            self.stats.inc("claims_total")
            self.stats.inc("claimed_samples_total", meta.size)
        return meta

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
        finally:
            part.waiting_claims -= 1
        have = self.keys.ready_count(part, task, required, batch_size)
        raise ClaimTimeout(
            f"only {have} of {batch_size} samples ready after {timeout_s}s (task {task!r})",
            fields=required,
            partition_id=part.partition_id,
        )

    @counts_errors
    async def ack(self, partition_id: str, task_name: str, sample_ids: list[str], lease_id) -> int:
        """Acknowledge leased samples (done for the task); returns how many were newly done."""
        done = self.keys.ack(partition_id, task_name, arguments.id_list(sample_ids), lease_id)
        self.stats.inc("acked_samples_total", done)
        return done

    @counts_errors
    async def reset_consumption(self, partition_id: str, task_name: str) -> None:
        self.keys.reset_consumption(partition_id, task_name)
        await self._wake(partition_id)

    @counts_errors
    def check_consumption_status(self, partition_id: str, task_names: list[str]) -> bool:
        """True iff every named task has consumed every sample of the partition."""
        return all(t.done for t in self._consumption(partition_id, task_names))

    @counts_errors
    def consumption_detail(self, partition_id: str, task_names: list[str]) -> list[TaskConsumption]:
        """Per task: consumed / total / expected, leases held and redeliveries."""
        return self._consumption(partition_id, task_names)

    def _consumption(self, partition_id: str, task_names: list[str]) -> list[TaskConsumption]:
        part = self.keys.partition(partition_id)
        return [self.keys.consumption(part, t) for t in arguments.name_list(task_names, "tasks")]

    # ---- clearing -----------------------------------------------------------------
    @counts_errors
    async def clear(self, partition_id: str, sample_ids: list[str] | None) -> ClearResult:
        """Forget samples and free their bytes; ``None`` deletes the whole partition."""
        if sample_ids is None:
            return await self.delete_partition(partition_id)
        ids = arguments.id_list(sample_ids, partition_id=partition_id)
        targets = self.keys.clear_samples(partition_id, ids)
        freed = await self._free_on_units(partition_id, targets)
        self.stats.inc("cleared_samples_total", len(ids))
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

    async def list_partitions(self) -> list[PartitionSummary]:
        return views.list_partitions(self.keys, await self._unit_snapshots())

    @counts_errors
    async def describe_partition(self, partition_id: str) -> PartitionDescription:
        self.keys.partition(partition_id)  # unknown -> typed error before asking the units
        return views.describe_partition(self.keys, partition_id, await self._unit_snapshots())

    @counts_errors
    def list_samples(
        self, partition_id: str, status: str | None = None, offset: int = 0, limit: int = 100
    ) -> SamplePage:
        return views.list_samples(self.keys, partition_id, status, offset, limit)

    @counts_errors
    def sample_status(self, partition_id: str, sample_id: str) -> SampleStatus:
        return views.sample_status(self.keys, partition_id, sample_id)

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
