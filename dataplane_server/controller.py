"""Controller: the one async Ray actor that owns the key space.

It never holds bulk bytes. Per partition it keeps columnar metadata (numpy
arrays grown geometrically, one entry per row): which fields are produced,
sequence length, which storage unit holds the row, per-task consumed bits,
tags. Writers commit here after their bytes are staged on the units; readers
validate here (one small call) before reading from the units; claimers wait on
an asyncio condition, so a blocking claim never stalls anyone else.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray

from dataplane_client.errors import (
    ClaimTimeout,
    FieldAlreadyProduced,
    FieldNotProduced,
    InvalidBatch,
    PartitionExists,
    SamplesLost,
    SamplesNotFound,
    SchemaConflict,
    UnknownPartition,
)
from dataplane_client.meta import KVBatchMeta
from dataplane_server.columns import counts_errors, grown
from dataplane_server.stats import Stats

VERSION = "0.1.0"


@dataclass
class Partition:
    partition_id: str
    declared_fields: list[str]
    expected_samples: int | None
    consumer_tasks: list[str]
    group_size: int | None
    created_at: float = field(default_factory=time.time)
    schema: dict[str, tuple] = field(default_factory=dict)  # field -> (kind, dtype, shape)
    row_of: dict[str, int] = field(default_factory=dict)
    ids: list = field(default_factory=list)  # row -> sample_id (None once cleared)
    n_rows: int = 0
    live: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    seq_len: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    unit: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int16))
    produced: dict[str, np.ndarray] = field(default_factory=dict)
    consumed: dict[str, np.ndarray] = field(default_factory=dict)
    tags: list = field(default_factory=list)  # row -> dict | None
    group_rows: dict[Any, list[int]] = field(default_factory=dict)  # group_id -> rows
    group_of: list = field(default_factory=list)  # row -> group_id | None
    waiting_claims: int = 0
    cond: asyncio.Condition = field(default_factory=asyncio.Condition)

    def column(self, table: dict[str, np.ndarray], name: str) -> np.ndarray:
        arr = table.get(name)
        if arr is None or len(arr) < len(self.live):
            arr = table[name] = grown(
                arr if arr is not None else np.zeros(0, dtype=bool), len(self.live), False
            )
        return arr

    def add_rows(self, sample_ids: list[str], units: np.ndarray) -> np.ndarray:
        start, n = self.n_rows, len(sample_ids)
        end = start + n
        self.live = grown(self.live, end, False)
        self.seq_len = grown(self.seq_len, end, -1)
        self.unit = grown(self.unit, end, -1)
        rows = np.arange(start, end, dtype=np.int64)
        self.row_of.update(zip(sample_ids, range(start, end)))
        self.ids.extend(sample_ids)
        self.tags.extend([None] * n)
        self.group_of.extend([None] * n)
        self.live[start:end] = True
        self.unit[start:end] = units
        self.n_rows = end
        return rows

    @property
    def num_samples(self) -> int:
        return len(self.row_of)


class _Reservations:
    """(partition, row, field) cells a commit is publishing right now."""

    def __init__(self) -> None:
        self.cells: set[tuple[str, int, str]] = set()

    def conflicts(self, pid: str, rows, fields) -> list[int]:
        return [r for r in rows for f in fields if (pid, r, f) in self.cells]


@ray.remote
class Controller:
    def __init__(self, config: dict):
        self.config = config
        self.partitions: dict[str, Partition] = {}
        self.units: list = []
        self.unit_info: list[dict] = []
        self.unit_alive: list[bool] = []
        self.started_at = time.time()
        self.draining = False
        self.stats = Stats()
        self.reservations = _Reservations()

    # ---- wiring -------------------------------------------------------------------
    async def attach_units(self, handles: list) -> list[dict]:
        self.units = list(handles)
        self.unit_info = await asyncio.gather(*[u.ping.remote() for u in self.units])
        self.unit_alive = [True] * len(self.units)
        return self.unit_info

    def unit_handles(self) -> list:
        return self.units

    def routing(self) -> dict:
        return {
            "units": self.units,
            "alive": list(self.unit_alive),
            "nodes": [info["node_id"] for info in self.unit_info],
            "shm": [bool(info.get("shm")) for info in self.unit_info],
        }

    async def mark_unit_lost(self, index: int) -> bool:
        """Called when a client saw a unit die; verify before believing it."""
        if not self.unit_alive[index]:
            return False
        try:
            await asyncio.wait_for(self.units[index].ping.remote(), timeout=5)
            return False
        except Exception:
            self.unit_alive[index] = False
            self.stats.inc("units_lost_total")
            for part in self.partitions.values():
                async with part.cond:
                    part.cond.notify_all()
            return True

    def set_draining(self, flag: bool) -> None:
        self.draining = bool(flag)

    # ---- partitions ---------------------------------------------------------------
    def register_partition(
        self,
        partition_id: str,
        fields: list[str],
        num_samples: int | None,
        consumer_tasks: list[str],
        group_size: int | None,
    ) -> None:
        if not isinstance(partition_id, str) or not partition_id:
            raise InvalidBatch(f"partition_id must be a non-empty str, got {partition_id!r}")
        if group_size is not None and group_size < 1:
            raise InvalidBatch(
                f"group_size must be >= 1, got {group_size}", partition_id=partition_id
            )
        if num_samples is not None and num_samples < 0:
            raise InvalidBatch(
                f"num_samples must be >= 0, got {num_samples}", partition_id=partition_id
            )
        existing = self.partitions.get(partition_id)
        if existing is not None:
            same = (
                existing.declared_fields == list(fields)
                and existing.group_size == group_size
                and existing.expected_samples == num_samples
            )
            if not same:
                raise PartitionExists(
                    "partition already registered with a different declaration",
                    partition_id=partition_id,
                )
            for t in consumer_tasks:
                if t not in existing.consumer_tasks:
                    existing.consumer_tasks.append(t)
            return
        self.partitions[partition_id] = Partition(
            partition_id, list(fields), num_samples, list(consumer_tasks), group_size
        )

    def _part(self, partition_id: str) -> Partition:
        part = self.partitions.get(partition_id)
        if part is None:
            raise UnknownPartition("no such partition", partition_id=partition_id)
        return part

    # ---- commit (the single visibility point of a write) --------------------------
    @counts_errors
    async def commit(
        self,
        partition_id: str,
        write_id: str,
        sample_ids: list[str],
        units: list[int],
        schemas: dict[str, tuple],
        seq_lens: list[int] | None,
        tags: list | None,
        overwrite: bool,
        staged_units: list[int],
    ) -> dict:
        """Validate, publish the staged bytes on every unit, then mark fields produced.

        Returns ``{"rerouted": {sample_id: unit}}`` without changing anything when
        some existing samples live on other units than the writer assumed.
        """
        part = self._part(partition_id)
        names = list(schemas)
        for name, schema in schemas.items():
            known = part.schema.get(name)
            if known is not None and tuple(known) != tuple(schema):
                raise SchemaConflict(
                    f"field is {tuple(known)}, this write has {tuple(schema)}",
                    fields=[name],
                    partition_id=partition_id,
                )
        rows = np.fromiter(
            (part.row_of.get(s, -1) for s in sample_ids), dtype=np.int64, count=len(sample_ids)
        )
        units_arr = np.asarray(units, dtype=np.int16)
        old = rows >= 0
        if old.any():
            wrong = old.copy()
            wrong[old] = part.unit[rows[old]] != units_arr[old]
            if wrong.any():
                return {
                    "rerouted": {
                        sample_ids[i]: int(part.unit[rows[i]]) for i in np.nonzero(wrong)[0]
                    }
                }
            dead = [
                sample_ids[i] for i in np.nonzero(old)[0] if not self.unit_alive[part.unit[rows[i]]]
            ]
            if dead:
                raise SamplesLost("their storage unit is gone", ids=dead, partition_id=partition_id)
            if not overwrite:
                for name in names:
                    col = part.produced.get(name)
                    if col is None:
                        continue
                    hit = np.zeros(len(rows), dtype=bool)
                    hit[old] = col[rows[old]]
                    if hit.any():
                        raise FieldAlreadyProduced(
                            "field already produced (pass overwrite=True to replace it)",
                            ids=[sample_ids[i] for i in np.nonzero(hit)[0]],
                            fields=[name],
                            partition_id=partition_id,
                        )
        busy = self.reservations.conflicts(partition_id, rows[old].tolist(), names)
        if busy:
            raise FieldAlreadyProduced(
                "another writer is committing these cells right now",
                ids=[part.ids[r] for r in busy],
                fields=names,
                partition_id=partition_id,
            )
        dead_units = [u for u in staged_units if not self.unit_alive[u]]
        if dead_units:
            raise SamplesLost(
                f"storage units {dead_units} are gone",
                ids=[s for s, u in zip(sample_ids, units) if u in dead_units],
                partition_id=partition_id,
            )
        if part.group_size is not None:
            ungrouped = [
                s
                for i, s in enumerate(sample_ids)
                if not old[i] and "group_id" not in ((tags[i] if tags else None) or {})
            ]
            if ungrouped:
                raise InvalidBatch(
                    "partition has group_size: every new sample needs a group_id tag",
                    ids=ungrouped,
                    partition_id=partition_id,
                )

        # Everything is checked: reserve the cells, publish the bytes, then make them visible.
        new_idx = np.nonzero(~old)[0]
        if len(new_idx):
            rows[new_idx] = part.add_rows([sample_ids[i] for i in new_idx], units_arr[new_idx])
        cells = {(partition_id, int(r), f) for r in rows.tolist() for f in names}
        self.reservations.cells |= cells
        try:
            results = await asyncio.gather(
                *[self.units[u].publish.remote(write_id) for u in staged_units],
                return_exceptions=True,
            )
        finally:
            self.reservations.cells -= cells
        failed = [u for u, r in zip(staged_units, results) if isinstance(r, BaseException)]
        if failed:
            for u in failed:
                await self.mark_unit_lost(u)
            lost = [s for s, u in zip(sample_ids, units) if u in failed]
            self._forget_rows(part, rows[new_idx] if len(new_idx) else np.zeros(0, dtype=np.int64))
            raise SamplesLost(
                f"storage units {failed} failed while publishing",
                ids=lost,
                partition_id=partition_id,
            )
        for name, schema in schemas.items():
            part.schema.setdefault(name, tuple(schema))
            part.column(part.produced, name)[rows] = True
        if seq_lens is not None:
            sl = np.asarray(seq_lens, dtype=np.int32)
            unset = part.seq_len[rows] < 0
            part.seq_len[rows[unset]] = sl[unset]
        if tags is not None:
            for r, t in zip(rows.tolist(), tags):
                if t:
                    merged = {**(part.tags[r] or {}), **t}
                    part.tags[r] = merged
                    gid = merged.get("group_id")
                    if gid is not None and part.group_of[r] is None:
                        part.group_of[r] = gid
                        part.group_rows.setdefault(gid, []).append(r)
        self.stats.inc("commits_total")
        self.stats.inc("committed_samples_total", len(sample_ids))
        async with part.cond:
            part.cond.notify_all()
        return {"rerouted": {}, "sequence_lengths": part.seq_len[rows].tolist()}

    def _forget_rows(self, part: Partition, rows: np.ndarray) -> None:
        for r in rows.tolist():
            sid = part.ids[r]
            if sid is not None:
                part.row_of.pop(sid, None)
                part.ids[r] = None
            part.live[r] = False

    # ---- read validation ----------------------------------------------------------
    @counts_errors
    def locate(self, partition_id: str, sample_ids: list[str], fields: list[str] | None) -> dict:
        """Validate a read and say where each sample's bytes live.

        Raises the typed error of the first problem found: unknown samples,
        lost samples (unit gone), unproduced fields.
        """
        part = self._part(partition_id)
        rows = np.fromiter(
            (part.row_of.get(s, -1) for s in sample_ids), dtype=np.int64, count=len(sample_ids)
        )
        if (rows < 0).any():
            raise SamplesNotFound(
                "unknown or cleared samples",
                ids=[s for s, r in zip(sample_ids, rows) if r < 0],
                partition_id=partition_id,
            )
        units = part.unit[rows]
        alive = np.asarray(self.unit_alive, dtype=bool)
        lost = ~alive[units]
        if lost.any():
            raise SamplesLost(
                "their storage unit is gone",
                ids=[s for s, x in zip(sample_ids, lost) if x],
                partition_id=partition_id,
            )
        if fields is None:
            fields = [f for f in part.schema if part.produced[f][rows].all()]
        for name in fields:
            col = part.produced.get(name)
            ok = col[rows] if col is not None else np.zeros(len(rows), dtype=bool)
            if not ok.all():
                raise FieldNotProduced(
                    "field not produced for these samples",
                    ids=[s for s, x in zip(sample_ids, ok) if not x],
                    fields=[name],
                    partition_id=partition_id,
                )
        return {
            "units": units.tolist(),
            "fields": list(fields),
            "schemas": {f: part.schema[f] for f in fields},
        }

    def lookup_units(self, partition_id: str, sample_ids: list[str]) -> list[int]:
        """Recorded unit per sample (-1 = not written yet), for inspection and tests."""
        part = self._part(partition_id)
        return [
            int(part.unit[r]) if (r := part.row_of.get(s)) is not None else -1 for s in sample_ids
        ]

    # ---- claims -------------------------------------------------------------------
    def _ready_rows(self, part: Partition, task: str, required: list[str]) -> np.ndarray:
        n = part.n_rows
        ok = part.live[:n].copy()
        for name in required:
            col = part.produced.get(name)
            if col is None:
                return np.zeros(0, dtype=np.int64)
            ok &= col[:n]
        ok &= ~part.column(part.consumed, task)[:n]
        alive = np.asarray(self.unit_alive, dtype=bool)
        ok &= alive[part.unit[:n]]
        return np.nonzero(ok)[0]

    def _pick(self, part: Partition, ready: np.ndarray, batch_size: int) -> np.ndarray:
        if part.group_size is None:
            return ready[:batch_size]
        ready_set = set(ready.tolist())
        chosen: list[int] = []
        seen: set = set()
        for r in ready.tolist():
            gid = part.group_of[r]
            if gid is None or gid in seen:
                continue
            seen.add(gid)
            members = [m for m in part.group_rows[gid] if part.live[m]]
            if len(members) == part.group_size and all(m in ready_set for m in members):
                if len(chosen) + len(members) > batch_size:
                    break
                chosen.extend(sorted(members))
        return np.asarray(chosen, dtype=np.int64)

    def _remaining_possible(self, part: Partition, task: str) -> int | None:
        """Samples the task may still get, when the partition's size is known."""
        if part.expected_samples is None:
            return None
        consumed = int(part.column(part.consumed, task)[: part.n_rows].sum())
        return part.expected_samples - consumed

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

        Claimed samples are marked consumed for the task at once (at-most-once
        delivery per task). Blocking claims wait for a full batch (or for what
        is left of a partition of known size) and raise ClaimTimeout otherwise.
        """
        part = self._part(partition_id)
        if batch_size < 1:
            raise InvalidBatch(
                f"batch_size must be >= 1, got {batch_size}", partition_id=partition_id
            )
        if part.group_size and batch_size % part.group_size:
            raise InvalidBatch(
                f"batch_size {batch_size} is not a multiple of group_size "
                f"{part.group_size}; groups are never split",
                partition_id=partition_id,
            )
        if task_name not in part.consumer_tasks:
            part.consumer_tasks.append(task_name)
        required = list(required_fields)

        def attempt() -> np.ndarray | None:
            picked = self._pick(part, self._ready_rows(part, task_name, required), batch_size)
            if len(picked) >= batch_size:
                return picked
            left = self._remaining_possible(part, task_name)
            if left is not None and len(picked) >= min(batch_size, left) and len(picked) > 0:
                return picked  # the tail of a partition of known size
            return picked if (not blocking and len(picked)) else None

        rows = attempt()
        if rows is None and blocking:
            deadline = time.monotonic() + timeout_s
            part.waiting_claims += 1
            try:
                async with part.cond:
                    while rows is None:
                        remaining = deadline - time.monotonic()
                        if remaining <= 0 or self.partitions.get(partition_id) is not part:
                            break
                        try:
                            await asyncio.wait_for(part.cond.wait(), timeout=remaining)
                        except asyncio.TimeoutError:
                            pass
                        rows = attempt()
            finally:
                part.waiting_claims -= 1
            if rows is None:
                have = len(
                    self._pick(part, self._ready_rows(part, task_name, required), batch_size)
                )
                raise ClaimTimeout(
                    f"only {have} of {batch_size} samples ready after {timeout_s}s "
                    f"(task {task_name!r})",
                    fields=required,
                    partition_id=partition_id,
                )
        if rows is None:
            return None
        part.column(part.consumed, task_name)[rows] = True
        self.stats.inc("claims_total")
        self.stats.inc("claimed_samples_total", len(rows))
        tags = [part.tags[r] or {} for r in rows.tolist()]
        return KVBatchMeta(
            partition_id=partition_id,
            task_name=task_name,
            sample_ids=[part.ids[r] for r in rows.tolist()],
            fields=[f for f in part.schema if part.produced[f][rows].all()],
            sequence_lengths=part.seq_len[rows].tolist(),
            extra_info={"dp_rank": dp_rank} if dp_rank is not None else {},
            tags=tags if any(tags) else None,
        )

    def check_consumption_status(self, partition_id: str, task_names: list[str]) -> dict:
        part = self._part(partition_id)
        n = part.n_rows
        live = part.live[:n]
        total = int(live.sum())
        out = {}
        for t in task_names:
            consumed = int((part.column(part.consumed, t)[:n] & live).sum())
            out[t] = {
                "consumed": consumed,
                "total": total,
                "expected": part.expected_samples,
                "done": consumed
                == (part.expected_samples if part.expected_samples is not None else total),
            }
        return out

    # ---- clearing -----------------------------------------------------------------
    async def clear(self, partition_id: str, sample_ids: list[str] | None) -> dict:
        """Forget samples in the metadata, then free their bytes on every unit."""
        part = self._part(partition_id)
        if sample_ids is None:
            self.partitions[partition_id] = Partition(
                partition_id,
                part.declared_fields,
                part.expected_samples,
                part.consumer_tasks,
                part.group_size,
            )
            targets = [(u, None) for u, ok in enumerate(self.unit_alive) if ok]
            cleared = part.num_samples
            async with part.cond:
                part.cond.notify_all()  # claims waiting on the old state re-check and time out cleanly
        else:
            rows = [part.row_of.get(s) for s in sample_ids]
            unknown = [s for s, r in zip(sample_ids, rows) if r is None]
            if unknown:
                raise SamplesNotFound(
                    "cannot clear unknown samples", ids=unknown, partition_id=partition_id
                )
            by_unit: dict[int, list[str]] = {}
            for s, r in zip(sample_ids, rows):
                by_unit.setdefault(int(part.unit[r]), []).append(s)
                if part.group_of[r] is not None:
                    members = part.group_rows.get(part.group_of[r], [])
                    if r in members:
                        members.remove(r)
            self._forget_rows(part, np.asarray(rows, dtype=np.int64))
            targets = [(u, ids) for u, ids in by_unit.items() if self.unit_alive[u]]
            cleared = len(sample_ids)
        freed = await asyncio.gather(
            *[self.units[u].clear.remote(partition_id, ids) for u, ids in targets],
            return_exceptions=True,
        )
        self.stats.inc("cleared_samples_total", cleared)
        return {"cleared": cleared, "bytes_freed": sum(f for f in freed if isinstance(f, int))}

    # ---- inspection (admin endpoint) ---------------------------------------------
    def _sample_dict(self, part: Partition, row: int) -> dict:
        return {
            "sample_id": part.ids[row],
            "fields": [f for f, col in part.produced.items() if col[row]],
            "sequence_length": int(part.seq_len[row]),
            "unit": int(part.unit[row]),
            "consumed_by": [t for t, col in part.consumed.items() if len(col) > row and col[row]],
            "tags": part.tags[row] or {},
            "lost": not self.unit_alive[part.unit[row]],
        }

    async def _unit_snapshots(self) -> list[dict | None]:
        async def one(i, u):
            if not self.unit_alive[i]:
                return None
            try:
                return await asyncio.wait_for(u.metrics_snapshot.remote(), timeout=5)
            except Exception:
                return None

        return await asyncio.gather(*[one(i, u) for i, u in enumerate(self.units)])

    async def service_info(self) -> dict:
        snaps = await self._unit_snapshots()
        units = []
        for i, info in enumerate(self.unit_info):
            s = snaps[i] or {}
            units.append(
                {
                    "index": i,
                    "node_id": info["node_id"],
                    "node_ip": info["node_ip"],
                    "alive": self.unit_alive[i],
                    "bytes": s.get("bytes", 0),
                    "samples": s.get("samples", 0),
                    "capacity_bytes": s.get(
                        "capacity_bytes", self.config.get("unit_capacity_bytes", 0)
                    ),
                }
            )
        return {
            "name": self.config.get("name"),
            "namespace": self.config.get("namespace"),
            "version": VERSION,
            "started_at": self.started_at,
            "uptime_s": time.time() - self.started_at,
            "draining": self.draining,
            "num_partitions": len(self.partitions),
            "num_samples": sum(p.num_samples for p in self.partitions.values()),
            "bytes": sum(u["bytes"] for u in units),
            "capacity_bytes": sum(u["capacity_bytes"] for u in units),
            "units": units,
        }

    async def list_partitions(self) -> list[dict]:
        snaps = await self._unit_snapshots()
        return [
            {
                "partition_id": pid,
                "num_samples": p.num_samples,
                "bytes": sum((s or {}).get("partition_bytes", {}).get(pid, 0) for s in snaps),
                "fields": list(p.schema) or list(p.declared_fields),
                "consumer_tasks": list(p.consumer_tasks),
                "created_at": p.created_at,
            }
            for pid, p in self.partitions.items()
        ]

    async def describe_partition(self, partition_id: str) -> dict:
        part = self._part(partition_id)
        snaps = await self._unit_snapshots()
        n = part.n_rows
        live = part.live[:n]
        names = list(part.schema) + [f for f in part.declared_fields if f not in part.schema]
        fields = []
        for f in names:
            kind, dtype, shape = part.schema.get(f, ("", "", ()))
            col = part.produced.get(f)
            fields.append(
                {
                    "name": f,
                    "dtype": dtype or "",
                    "layout": kind or "",
                    "trailing_shape": list(shape),
                    "produced": int((col[:n] & live).sum()) if col is not None else 0,
                }
            )
        return {
            "partition_id": partition_id,
            "num_samples": part.num_samples,
            "expected_samples": part.expected_samples,
            "group_size": part.group_size,
            "created_at": part.created_at,
            "fields": fields,
            "consumption": [
                {"task": t, "consumed": int((part.column(part.consumed, t)[:n] & live).sum())}
                for t in part.consumer_tasks
            ],
            "pending_claims": part.waiting_claims,
            "bytes_per_unit": [
                {"unit": i, "bytes": (s or {}).get("partition_bytes", {}).get(partition_id, 0)}
                for i, s in enumerate(snaps)
            ],
        }

    def list_samples(
        self, partition_id: str, status: str | None = None, offset: int = 0, limit: int = 100
    ) -> dict:
        part = self._part(partition_id)
        if status not in (None, "", "ready", "pending", "consumed", "lost"):
            raise InvalidBatch(
                f"unknown status filter {status!r}; use ready, pending, consumed or lost"
            )
        n = part.n_rows
        mask = part.live[:n].copy()
        alive = np.asarray(self.unit_alive, dtype=bool)[part.unit[:n]]
        declared = part.declared_fields or list(part.schema)
        all_produced = np.ones(n, dtype=bool)
        for f in declared:
            col = part.produced.get(f)
            all_produced &= col[:n] if col is not None else False
        any_consumed = np.zeros(n, dtype=bool)
        for col in part.consumed.values():
            any_consumed |= col[:n]
        if status == "lost":
            mask &= ~alive
        elif status == "consumed":
            mask &= any_consumed
        elif status == "ready":
            mask &= alive & all_produced & ~any_consumed
        elif status == "pending":
            mask &= alive & ~all_produced
        rows = np.nonzero(mask)[0]
        offset, limit = max(0, int(offset)), max(1, min(int(limit), 10_000))
        page = rows[offset : offset + limit]
        nxt = offset + limit if offset + limit < len(rows) else None
        return {
            "samples": [self._sample_dict(part, int(r)) for r in page],
            "total": int(len(rows)),
            "next_offset": nxt,
        }

    def sample_status(self, partition_id: str, sample_id: str) -> dict:
        part = self._part(partition_id)
        row = part.row_of.get(sample_id)
        if row is None:
            raise SamplesNotFound("unknown sample", ids=[sample_id], partition_id=partition_id)
        return self._sample_dict(part, row)

    def metrics_snapshot(self) -> dict:
        return {
            "stats": self.stats.snapshot(),
            "claims_waiting": sum(p.waiting_claims for p in self.partitions.values()),
            "partitions": [
                {"partition_id": pid, "num_samples": p.num_samples}
                for pid, p in self.partitions.items()
            ],
        }

    def memory_footprint(self) -> dict:
        """Rough bytes of metadata per partition (benchmarks: bytes per sample)."""
        import sys

        out = {}
        for pid, p in self.partitions.items():
            arrays = p.live.nbytes + p.seq_len.nbytes + p.unit.nbytes
            arrays += sum(a.nbytes for a in p.produced.values()) + sum(
                a.nbytes for a in p.consumed.values()
            )
            dict_bytes = sys.getsizeof(p.row_of) + sum(sys.getsizeof(s) for s in p.row_of)
            lists = sys.getsizeof(p.ids) + sys.getsizeof(p.tags) + sys.getsizeof(p.group_of)
            out[pid] = {"samples": p.num_samples, "bytes": arrays + dict_bytes + lists}
        return out
