"""InProcessDataPlaneClient: the whole data plane in one process, without Ray.

The same key space as the Ray service (:mod:`dataplane_server.core.keyspace`:
partitions, commit check and apply, claims, leases, consumption) over an
in-memory byte store, behind the same abstract
:class:`~dataplane_client.interface.DataPlaneService` (NeMo-RL's
``DataPlaneClient`` and our typed extras). For users' unit tests and ours: code
written against either ABC runs unchanged on either client, with the same
semantics and the same typed errors: each verb is declared once, in the interface
(signature, docstring, argument checks), and this class writes only its body
(``_name``, the checked arguments in). The extras: ``*_async`` twins (the body run in a
worker thread), ``ack``,
``reset_consumption``, ``delete_partition``, ``consumption_detail``,
``describe_partition``, ``service_info`` (one "unit": this process's memory),
object fields and ``overwrite``. Not here (Ray only):
``checkpoint`` and ``restore``.

Thread-safe: one lock around the key space and the store; a blocking claim
waits on a condition that every commit, clear and registration notifies, so a
claim in one thread is served by a put in another. What it does after each wake
and when it gives up is the controller's too (``core/claim_wait.py``).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from dataplane_client.codec import appends, prepare
from dataplane_client.codec.assembly import assemble_fields
from dataplane_client.codec.tensordict_io import to_tensordict
from dataplane_client.interface import DataPlaneService, service_verbs
from dataplane_client.wire import group_fields
from dataplane_client.wire.encoded import EncodedField, row_byte_offsets
from dataplane_client.wire.errors import ServiceUnavailable
from dataplane_client.wire.messages import (
    Capabilities,
    ClaimRequest,
    ClearResult,
    CommitRequest,
    FieldCodecs,
    PartitionDescription,
    PartitionSpec,
    RolloutGrant,
    ServiceInfo,
    TaskConsumption,
    UnitInfo,
    UnitSnapshot,
)
from dataplane_client.wire.meta import KVBatchMeta
from dataplane_client.wire.version import __version__
from dataplane_server.core import async_rl, claim_wait, partial_rollouts, steps, views
from dataplane_server.core.keyspace import CommitPlan, KeySpace, declare

_UNIT = 0  # the one in-memory "storage unit" every sample lives on


def _memory_bytes() -> int:
    """This machine's physical memory: the in-process unit's capacity (it refuses no put
    for room; the figure is what ``service_info`` readers, e.g. back-off, compare with)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError):
        return 1 << 40


def _rows_of(enc: EncodedField) -> list[EncodedField]:
    """One single-row field per row, each owning a copy of its bytes (the caller's
    tensors may change after the put; what was stored must not)."""
    offs = row_byte_offsets(enc).tolist()
    return [
        EncodedField(
            kind=enc.kind,
            dtype=enc.dtype,
            shape=enc.shape,
            values=enc.require_values()[offs[i] : offs[i + 1]].copy(),
            lengths=None if enc.lengths is None else enc.lengths[i : i + 1].copy(),
            num_rows=1,
        )
        for i in range(enc.num_rows)
    ]


class InProcessDataPlaneClient(DataPlaneService):
    """A data plane held in this process's memory (one client = one store)."""

    def __init__(self) -> None:
        self._keys: KeySpace | None = KeySpace()
        self._keys.unit_alive = [True]
        # partition -> sample -> field -> that row's bytes
        self._store: dict[str, dict[str, dict[str, EncodedField]]] = {}
        self._changed = threading.Condition()
        self._started_at = time.time()

    @property
    def closed(self) -> bool:
        return self._keys is None

    def _open(self) -> KeySpace:
        if self._keys is None:
            raise ServiceUnavailable("this in-process client was closed")
        return self._keys

    def _notify(self) -> None:
        self._changed.notify_all()

    # ---- how a verb runs: its body, here or in a worker thread --------------------------
    def _check_open(self) -> None:
        self._open()

    def _run_verb(self, body: Callable[[], Any]) -> Any:
        return body()

    async def _run_verb_async(self, body: Callable[[], Any]) -> Any:
        return await asyncio.to_thread(body)  # a blocking claim never stalls the loop

    # ---- partitions ---------------------------------------------------------------
    def _register_partition(self, spec: PartitionSpec) -> None:
        decl = declare(spec)
        with self._changed:
            self._open().register(spec.partition_id, decl)
            self._store[spec.partition_id] = {}
            self._notify()  # claims waiting on the replaced partition fail

    def _delete_partition(self, partition_id: str) -> ClearResult:
        with self._changed:
            part = self._open().delete(partition_id)
            freed = self._nbytes(self._store.pop(partition_id, {}).values())
            self._notify()
            return ClearResult(cleared=part.num_samples, bytes_freed=freed)

    @staticmethod
    def _codecs_of(keys: KeySpace, partition_id: str) -> FieldCodecs:
        """As the partition was declared (none for an unknown one: its commit check says so)."""
        part = keys.partitions.get(partition_id)
        return FieldCodecs() if part is None else part.declaration.codecs

    @staticmethod
    def _nbytes(samples: Any) -> int:
        """Bytes of these samples' rows; a group's value (one row object its members
        share) counted once."""
        rows = {id(enc): enc for fields in samples for enc in fields.values()}
        return sum(int(enc.values.nbytes) for enc in rows.values())

    def _freed(self, partition_id: str, removed: list) -> int:
        """Bytes of removed samples' rows that no sample left in the partition holds (a
        group's value goes with its last member)."""
        freed = self._nbytes(removed)
        part = self._open().partitions.get(partition_id)
        if part is None or not part.declaration.group_fields:
            return freed
        left = self._store[partition_id].values()
        kept = {id(enc): enc for fields in left for enc in fields.values()}
        held = {id(enc): enc for fields in removed for enc in fields.values() if id(enc) in kept}
        return freed - sum(int(enc.values.nbytes) for enc in held.values())

    def _stored_group_rows(
        self, keys: KeySpace, partition_id: str, w: prepare.Write
    ) -> dict[tuple, EncodedField]:
        """(field, group) -> the value a group of this put already stores (a member outside
        the put holds it); GroupValueConflict where the put's value differs from it."""
        if not w.shared:
            return {}
        assert w.groups is not None
        part = keys.partition(partition_id)
        store, own = self._store[partition_id], set(w.sample_ids)
        out: dict[tuple, EncodedField] = {}
        for name, index in w.shared.items():
            rows = _rows_of(w.encoded[name])
            for i, group in enumerate(w.groups):
                if (name, group) in out or group not in part.group_index:
                    continue
                code = part.group_index[group]
                n = part.n_rows
                members = np.flatnonzero(part.live[:n] & (part.group_code[:n] == code))
                held = next(
                    (
                        store[sid][name]
                        for sid in (part.ids[r] for r in members.tolist())
                        if sid not in own and sid in store and name in store[sid]
                    ),
                    None,
                )
                if held is None:
                    continue
                if not np.array_equal(held.require_values(), rows[index[i]].require_values()):
                    raise group_fields.stored_value_differs(name, group, part.partition_id)
                out[(name, group)] = held
        return out

    # ---- put ----------------------------------------------------------------------
    def _put_samples(self, put: prepare.PutArguments) -> KVBatchMeta:
        partition_id = put.partition_id
        with self._changed:
            keys = self._open()
            w = prepare.write(put, self._codecs_of(keys, partition_id))
            stored = self._stored_group_rows(keys, partition_id, w)  # before any reservation
            plan = keys.check_commit(
                CommitRequest(
                    partition_id=partition_id,
                    write_id=uuid.uuid4().hex,
                    sample_ids=w.sample_ids,
                    units=[_UNIT] * len(w.sample_ids),
                    schemas=w.schemas,
                    sequence_lengths=w.sequence_lengths,
                    tags=w.tags,
                    overwrite=w.overwrite,
                    staged_units=[_UNIT],
                )
            )
            # One unit and one lock: nothing is ever re-routed, so this is always a plan.
            assert isinstance(plan, CommitPlan)
            store = self._store[partition_id]
            for name, enc in w.encoded.items():
                rows = _rows_of(enc)
                index = w.shared.get(name)
                if index is None:
                    for sid, row in zip(w.sample_ids, rows):
                        store.setdefault(sid, {})[name] = row
                    continue
                assert w.groups is not None  # a group field: members share one row object
                for sid, group, i in zip(w.sample_ids, w.groups, index.tolist()):
                    store.setdefault(sid, {})[name] = stored.get((name, group), rows[i])
            result, _ = keys.apply_commit(plan)
            self._notify()
        return KVBatchMeta(
            partition_id=partition_id,
            task_name=None,
            sample_ids=w.sample_ids,
            fields=list(w.encoded),
            sequence_lengths=result.sequence_lengths,
            tags=w.tags,
        )

    def _append_tokens(self, args: appends.AppendArguments) -> KVBatchMeta:
        """Read, join and put under one lock: no other append can land in between."""
        with self._changed:
            held = partial_rollouts.held(self._open().partition(args.partition_id), args.sample_ids)
            ids = appends.stored_ids(args, held)
            stored = (
                self._get_samples(ids, args.partition_id, list(args.rows), None) if ids else None
            )
            return self._put_samples(appends.appended_put(args, held, stored))

    # ---- get ----------------------------------------------------------------------
    def _get_data(
        self, meta: KVBatchMeta, sample_ids: list[str], fields: list[str], device: Any
    ) -> Any:
        return self._get_samples(sample_ids, meta.partition_id, fields, device)

    def _get_samples(self, ids: list[str], partition_id: str, names: list[str], target: Any) -> Any:
        with self._changed:
            keys = self._open()
            keys.locate(partition_id, ids, names)
            # The rows themselves, not the per-sample dicts: an overwrite replaces a dict's
            # entries one field at a time, so only rows taken under the lock are all from
            # one write. Stored rows are never changed in place, so decoding them after
            # the lock is released is safe.
            samples = [self._store[partition_id][s] for s in ids]
            rows = {name: [s[name] for s in samples] for name in names}
            codecs = self._codecs_of(keys, partition_id)
        order = np.arange(len(ids))
        decoded = assemble_fields({name: rows[name] for name in names}, order, target)
        return to_tensordict(decoded, len(ids), enums=codecs.enums, device=target)

    # ---- claims and consumption ---------------------------------------------------
    def _claim_meta(self, request: ClaimRequest) -> KVBatchMeta:
        with self._changed:
            keys = self._open()
            part, task, policy = keys.claim_setup(request)
            self._remove(keys, async_rl.stale_removal(keys, part))

            def claim(partial_ok: bool) -> KVBatchMeta | None:
                # Groups past their deadline go first, unless this claim takes them partial.
                self._remove(keys, async_rl.expired_removal(keys, part, policy))
                return keys.claim(
                    part,
                    task,
                    request.required_fields,
                    request.batch_size,
                    partial_ok=partial_ok,
                    dp_rank=request.dp_rank,
                    policy=policy,
                )

            meta = claim(not request.blocking)
            if meta is None and request.blocking:
                steps = claim_wait.waiting(keys, part, request, policy, lambda: claim(False))
                meta = claim_wait.drive(steps, self._wait_for_change)
            if meta is None:
                return request.nothing_due()
            self._notify()  # trained samples make room for waiting rollout admissions
            return meta

    def _wait_for_change(self, seconds: float) -> None:
        """A waiting claim's sleep (holding the condition): until notified or ``seconds``
        passed; ServiceUnavailable when the client was closed meanwhile."""
        self._changed.wait(seconds)
        if self._keys is None:
            raise ServiceUnavailable("this in-process client was closed during the claim")

    def _ack(self, partition_id: str, task: str, ids: list[str], lease_id: int) -> int:
        with self._changed:
            done = self._open().ack(partition_id, task, ids, lease_id)
            self._notify()
            return done

    def _reset_consumption(self, partition_id: str, task_name: str) -> None:
        with self._changed:
            self._open().reset_consumption(partition_id, task_name)
            self._notify()

    def _commit_step(self, partition_id: str, task_name: str, step: int) -> None:
        with self._changed:
            keys = self._open()
            part, new = keys.check_commit_step(partition_id, task_name, step)
            if new:
                steps.commit(part, task_name, step)

    def _rewind_to_step(self, partition_id: str, task_name: str, step: int | None) -> int:
        with self._changed:
            keys = self._open()
            part, rows = keys.rows_to_rewind(partition_id, task_name, step)
            handed_back = keys.rewind(part, task_name, rows, step)
            self._notify()  # handed-back samples may be what a waiting claim needs
            return handed_back

    def _consumption_detail(self, partition_id: str, names: list[str]) -> list[TaskConsumption]:
        with self._changed:
            keys = self._open()
            part = keys.partition(partition_id)
            return [keys.consumption(part, t) for t in names]

    def _check_consumption_status(self, partition_id: str, names: list[str]) -> bool:
        return all(t.done for t in self._consumption_detail(partition_id, names))

    # ---- inspection ---------------------------------------------------------------
    def _snapshot(self) -> UnitSnapshot:
        """The one in-memory unit's figures (call under the lock)."""
        per_partition = {pid: self._nbytes(s.values()) for pid, s in self._store.items()}
        return UnitSnapshot(
            index=_UNIT,
            node_id="",
            node_ip="",
            bytes=sum(per_partition.values()),
            samples=sum(len(s) for s in self._store.values()),
            capacity_bytes=_memory_bytes(),
            warm_reserve_bytes=0,
            partition_bytes=per_partition,
        )

    def _describe_partition(self, partition_id: str) -> PartitionDescription:
        with self._changed:
            keys = self._open()
            keys.partition(partition_id)  # unknown -> UnknownPartition
            return views.describe_partition(keys, partition_id, [self._snapshot()])

    def _service_info(self) -> ServiceInfo:
        """One unit, this process's memory: alive, the bytes and samples it holds, and as
        ``capacity_bytes`` the machine's physical memory (nothing here refuses a put for
        room; the figure is for readers such as the rollout actors' back-off)."""
        with self._changed:
            keys = self._open()
            info = UnitInfo(index=_UNIT, node_id="", node_ip="", pid=os.getpid(), shm=False)
            return views.service_info(
                keys,
                [info],
                [self._snapshot()],
                name="in-process",
                namespace="",
                version=__version__,
                started_at=self._started_at,
                draining=False,
                default_capacity=_memory_bytes(),
            )

    # ---- clear --------------------------------------------------------------------
    def _clear_samples(self, ids: list[str] | None, partition_id: str) -> ClearResult:
        if ids is None:
            return self._delete_partition(partition_id)
        with self._changed:
            self._open().clear_samples(partition_id, ids)
            store = self._store[partition_id]
            freed = self._freed(partition_id, [store.pop(s) for s in ids if s in store])
            self._notify()
        return ClearResult(cleared=len(ids), bytes_freed=freed)

    # ---- async RL: versions, admission, introspection ------------------------------
    def _remove(self, keys: KeySpace, removal: async_rl.Removal | None) -> int:
        """Forget a removal's samples and their bytes (call under the lock)."""
        if removal is None:
            return 0
        store = self._store[removal.part.partition_id]
        for ids in async_rl.apply_removal(keys, removal).values():
            for sid in ids:
                store.pop(sid, None)
        self._notify()
        return len(removal.rows)

    def _set_policy_version(self, partition_id: str, version: int) -> int:
        with self._changed:
            keys = self._open()
            part, versions = keys.versioned(partition_id)
            versions.set_version(versions.check_version(version))
            self._remove(keys, async_rl.stale_removal(keys, part))
            self._notify()
            return versions.version

    def _policy_version(self, partition_id: str) -> int:
        with self._changed:
            return self._open().versioned(partition_id)[1].version

    def _admit_rollouts(
        self, partition_id: str, n: int, wait: bool, timeout_s: float, lease_s: float
    ) -> RolloutGrant | None:
        with self._changed:
            ask = async_rl.AdmissionAsk(self._open(), partition_id, n, wait, timeout_s, lease_s)
            while True:
                self._open()  # closed while waiting: ServiceUnavailable
                ask.check_partition()
                self._remove(ask.keys, async_rl.stale_removal(ask.keys, ask.part))
                grant = ask.offer()
                if grant is not None:
                    ask.record(grant)
                    return grant
                if not ask.wait:
                    return None
                self._changed.wait(ask.wait_s())

    def _release_rollouts(self, grant: RolloutGrant) -> bool:
        with self._changed:
            _, versions = self._open().versioned(grant.partition_id)
            released = versions.release(grant.grant_id)
            self._notify()
            return released

    def _evict_samples(self, ids: list[str], partition_id: str) -> int:
        with self._changed:
            keys = self._open()
            return self._remove(keys, async_rl.evict_ids(keys, partition_id, ids))

    def _clear_versions(self, partition_id: str, lowest: int, highest: int) -> ClearResult:
        with self._changed:
            keys = self._open()
            part, rows = async_rl.versions_range(keys, partition_id, lowest, highest)
            store = self._store[partition_id]
            gone = [store.pop(sid) for ids in keys.clear_rows(part, rows).values() for sid in ids]
            self._notify()
            return ClearResult(cleared=len(rows), bytes_freed=self._freed(partition_id, gone))

    def _peek_meta(self, request: ClaimRequest) -> KVBatchMeta:
        with self._changed:
            return async_rl.peek(self._open(), request)

    def _ready_depth(
        self, partition_id: str, task_names: list[str], required_fields: list[str]
    ) -> dict[str, int]:
        with self._changed:
            return async_rl.ready_depth(self._open(), partition_id, task_names, required_fields)

    def _capabilities(self) -> Capabilities:
        return async_rl.capabilities("in-process", service_verbs(type(self)))

    def _ping(self) -> bool:
        return True

    def close(self) -> None:
        """Drop everything held; idempotent."""
        with self._changed:
            self._keys = None
            self._store.clear()
            self._notify()  # waiting claims see the client closed
