"""The controller's read-only verbs for the admin endpoint, metrics and benchmarks.

A mixin of ``Controller``: each verb reads the key space (through
``core.views``) and the units' metrics snapshots, and changes nothing, so the
controller file keeps only the verbs that decide something.
"""

from __future__ import annotations

import dataclasses

from dataplane_client.wire.config import DataPlaneConfig
from dataplane_client.wire.messages import (
    CheckpointSummary,
    ControllerSnapshot,
    PartitionDescription,
    PartitionStats,
    PartitionSummary,
    SamplePage,
    SampleStatus,
    ServiceInfo,
    UnitInfo,
    UnitSnapshot,
)
from dataplane_client.wire.version import __version__
from dataplane_server.controller.verbs import served
from dataplane_server.controller.writer_loads import WriterLoads
from dataplane_server.core import unit_calls, views
from dataplane_server.core.keyspace import KeySpace
from dataplane_server.core.stats import Stats


class Inspection:
    # Kept by the controller; named here for readers and type checkers.
    config: DataPlaneConfig
    keys: KeySpace
    units: list
    unit_info: list[UnitInfo]
    stats: Stats
    started_at: float
    draining: bool
    writer_loads: WriterLoads
    last_checkpoint: CheckpointSummary | None

    async def _unit_snapshots(self) -> list[UnitSnapshot | None]:
        return await unit_calls.snapshots(self.units, self.keys.unit_alive)

    @served
    async def service_info(self) -> ServiceInfo:
        return views.service_info(
            self.keys,
            self.unit_info,
            await self._unit_snapshots(),
            name=self.config.name,
            namespace=self.config.namespace,
            version=__version__,
            started_at=self.started_at,
            draining=self.draining,
            default_capacity=self.config.unit_capacity_bytes,
            durability=self.config.durability,
            state_dir=self.config.state_dir or "",
            last_checkpoint=self.last_checkpoint,
        )

    @served
    async def list_partitions(self) -> list[PartitionSummary]:
        return views.list_partitions(self.keys, await self._unit_snapshots())

    @served
    async def describe_partition(self, partition_id: str) -> PartitionDescription:
        self.keys.partition(partition_id)  # unknown -> typed error before asking the units
        described = views.describe_partition(self.keys, partition_id, await self._unit_snapshots())
        last = self.last_checkpoint
        return dataclasses.replace(
            described,
            durability=self.config.durability,
            checkpointed_samples=None if last is None else last.partitions.get(partition_id, 0),
            last_checkpoint_at=None if last is None else last.taken_at,
        )

    @served
    def list_samples(
        self, partition_id: str, status: str | None = None, offset: int = 0, limit: int = 100
    ) -> SamplePage:
        return views.list_samples(self.keys, partition_id, status, offset, limit)

    @served
    def sample_status(self, partition_id: str, sample_id: str) -> SampleStatus:
        return views.sample_status(self.keys, partition_id, sample_id)

    @served
    def metrics_snapshot(self) -> ControllerSnapshot:
        self.stats.counters["redeliveries_total"] = self.keys.redeliveries_total
        self.stats.counters.update(self.writer_loads.totals())
        waiting, in_flight = self.writer_loads.queue()
        return ControllerSnapshot(
            puts_waiting=waiting,
            puts_in_flight=in_flight,
            last_checkpoint=self.last_checkpoint,
            stats=self.stats.snapshot(),
            claims_waiting=sum(p.waiting_claims for p in self.keys.partitions.values()),
            partitions=[
                PartitionStats(
                    partition_id=pid,
                    num_samples=p.num_samples,
                    staleness=views.staleness_info(self.keys, p),
                )
                for pid, p in self.keys.partitions.items()
            ],
        )

    @served
    def memory_footprint(self) -> dict[str, dict[str, int]]:
        """Rough bytes of metadata per partition (benchmarks: bytes per sample)."""
        return {
            pid: {"samples": p.num_samples, "bytes": p.metadata_bytes()}
            for pid, p in self.keys.partitions.items()
        }
