"""DataPlaneClient: what rollout actors, drivers and workers import.

Every verb is written once, as a *flow*: a generator that yields lists of Ray
ObjectRefs and receives their results (an exception in place of a result that
failed). ``_run_sync`` drives a flow with ``ray.get``; ``_run_async`` with
``await``, so the ``*_async`` twins never block an event loop.

Data path of a put: encode (zero-copy views of the caller's tensors) -> split
rows by storage unit -> stage bytes on the units in parallel -> one commit to
the controller, which publishes them (visibility point). A get: one validation
call to the controller (it also says where rows live) -> parallel reads from
the units -> rows reassembled in request order with one copy per field.
"""

from __future__ import annotations

import asyncio
import uuid
import zlib
from collections.abc import Generator, Mapping, Sequence
from typing import Any

import numpy as np
import ray
from ray.exceptions import RayActorError, RayTaskError

from dataplane_client.codec import (
    JAGGED,
    EncodedField,
    encode_fields,
)
from dataplane_client.errors import DataPlaneError, InvalidBatch, SamplesLost, ServiceUnavailable
from dataplane_client.meta import KVBatchMeta, duplicated
from dataplane_client.transport import SharedMemoryUnavailable, Transport, assemble

Flow = Generator[list, list, Any]
_MAX_REROUTES = 3
_ROUTE_CACHE_LIMIT = 4_000_000


def _unwrap(exc: BaseException) -> BaseException:
    """A typed error raised inside an actor, as its own class (not Ray's wrapper)."""
    if isinstance(exc, RayTaskError):
        cause = getattr(exc, "cause", None)
        if isinstance(cause, DataPlaneError):
            return cause
    return exc


def _resolve_sync(refs: list) -> list:
    out = []
    for ref in refs:
        try:
            out.append(ray.get(ref))
        except Exception as e:  # noqa: BLE001 - handed to the flow, which re-raises typed errors
            out.append(_unwrap(e))
    return out


async def _resolve_async(refs: list) -> list:
    results = await asyncio.gather(*refs, return_exceptions=True)
    return [_unwrap(r) if isinstance(r, BaseException) else r for r in results]


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


def _one(results: list) -> Any:
    """The single result of a one-ref step, raising it if it failed."""
    (r,) = results
    if isinstance(r, BaseException):
        raise r
    return r


def _sequence_lengths(
    encoded: Mapping[str, EncodedField], fields: Mapping[str, Any]
) -> list[int] | None:
    """A sample's sequence length: ``input_lengths`` if given, else its first jagged field."""
    lengths = fields.get("input_lengths")
    if (
        lengths is not None
        and hasattr(lengths, "ndim")
        and lengths.ndim == 1
        and not lengths.is_nested
    ):
        return [int(x) for x in lengths.tolist()]
    for enc in encoded.values():
        if enc.kind == JAGGED:
            return enc.lengths.tolist()
    return None


class DataPlaneClient:
    """Client of one data-plane service (controller + storage units)."""

    def __init__(self, controller: Any, name: str = "dataplane", namespace: str = "dataplane"):
        self.name, self.namespace = name, namespace
        self._controller = controller
        routing = ray.get(controller.routing.remote())
        self._transport = Transport(
            routing["units"],
            routing["nodes"],
            routing["shm"],
            ray.get_runtime_context().get_node_id(),
        )
        self._alive = list(routing["alive"])
        self._routes: dict[
            tuple[str, str], int
        ] = {}  # (partition, sample) -> unit, learnt from puts/gets

    # ---- helpers ------------------------------------------------------------------
    def _remember(self, partition_id: str, sample_ids: Sequence[str], units: Sequence[int]) -> None:
        if len(self._routes) > _ROUTE_CACHE_LIMIT:
            self._routes.clear()
        self._routes.update(zip(((partition_id, s) for s in sample_ids), (int(u) for u in units)))

    def _assign_new(self, sample_ids: Sequence[str], idx: np.ndarray) -> np.ndarray:
        """Units for samples never written: contiguous chunks over the live units.

        Contiguous runs keep the per-unit split of the caller's buffers a
        zero-copy slice; the first id picks the starting unit so many small
        writers spread evenly. The controller records the choice at commit.
        """
        alive = [u for u, ok in enumerate(self._alive) if ok]
        if not alive:
            raise SamplesLost("no storage unit is alive", ids=[sample_ids[i] for i in idx])
        start = zlib.crc32(sample_ids[int(idx[0])].encode()) % len(alive) if len(idx) else 0
        chunk = np.arange(len(idx)) * len(alive) // max(len(idx), 1)
        return np.asarray(alive, dtype=np.int64)[(chunk + start) % len(alive)]

    def _unit_died(self, unit: int) -> Flow:
        """Tell the controller a unit failed; refresh our view of who is alive."""
        yield [self._controller.mark_unit_lost.remote(unit)]
        routing = _one((yield [self._controller.routing.remote()]))
        self._alive = list(routing["alive"])

    # ---- partitions ---------------------------------------------------------------
    def _register_flow(self, partition_id, fields, num_samples, consumer_tasks, group_size) -> Flow:
        _one(
            (
                yield [
                    self._controller.register_partition.remote(
                        partition_id, list(fields), num_samples, list(consumer_tasks), group_size
                    )
                ]
            )
        )

    def register_partition(
        self,
        partition_id: str,
        *,
        fields: Sequence[str] = (),
        num_samples: int | None = None,
        consumer_tasks: Sequence[str] = (),
        group_size: int | None = None,
    ) -> None:
        """Declare a partition (idempotent for the same declaration)."""
        return _run_sync(
            self._register_flow(partition_id, fields, num_samples, consumer_tasks, group_size)
        )

    async def register_partition_async(
        self,
        partition_id: str,
        *,
        fields: Sequence[str] = (),
        num_samples: int | None = None,
        consumer_tasks: Sequence[str] = (),
        group_size: int | None = None,
    ) -> None:
        return await _run_async(
            self._register_flow(partition_id, fields, num_samples, consumer_tasks, group_size)
        )

    # ---- put ----------------------------------------------------------------------
    def _put_flow(self, sample_ids, partition_id, fields, tags, overwrite) -> Flow:
        sample_ids = list(sample_ids)
        n = len(sample_ids)
        if n == 0:
            raise InvalidBatch(
                "put_samples needs at least one sample id", partition_id=partition_id
            )
        bad = [s for s in sample_ids if not isinstance(s, str) or not s]
        if bad:
            raise InvalidBatch(
                "sample ids must be non-empty str", ids=bad, partition_id=partition_id
            )
        dups = duplicated(sample_ids)
        if dups:
            raise InvalidBatch(
                "duplicate sample ids in one put", ids=dups, partition_id=partition_id
            )
        if tags is not None:
            tags = [dict(t) if t else {} for t in tags]
            if len(tags) != n:
                raise InvalidBatch(
                    f"{len(tags)} tags for {n} sample ids", partition_id=partition_id
                )
        encoded = encode_fields(fields, num_rows=n)
        seq_lens = _sequence_lengths(encoded, fields)
        schemas = {name: enc.schema for name, enc in encoded.items()}

        units = np.array(
            [self._routes.get((partition_id, s), -1) for s in sample_ids], dtype=np.int64
        )
        for _attempt in range(_MAX_REROUTES + 1):
            new = np.nonzero(units < 0)[0]
            if len(new):
                units[new] = self._assign_new(sample_ids, new)
            write_id = uuid.uuid4().hex
            plan = {int(u): np.nonzero(units == u)[0] for u in np.unique(units)}
            staged = list(plan)
            results = yield from self._transport.stage_flow(
                partition_id, write_id, sample_ids, encoded, plan
            )
            errors = [(u, r) for u, r in zip(staged, results) if isinstance(r, BaseException)]
            if errors:
                yield [
                    self._transport.discard(u, write_id)
                    for u, r in zip(staged, results)
                    if not isinstance(r, BaseException)
                ]
                if all(isinstance(e, SharedMemoryUnavailable) for _, e in errors):
                    continue  # those units are now reached through Ray
                died = [u for u, e in errors if isinstance(e, RayActorError)]
                if not died:
                    raise errors[0][1]
                for u in died:
                    yield from self._unit_died(u)
                # Samples that were new go elsewhere; ones already living there are lost.
                known = {s for s in sample_ids if (partition_id, s) in self._routes}
                lost = [s for s, u in zip(sample_ids, units) if u in died and s in known]
                if lost:
                    raise SamplesLost(
                        "their storage unit died", ids=lost, partition_id=partition_id
                    )
                units[np.isin(units, died)] = -1
                continue
            try:
                result = _one(
                    (
                        yield [
                            self._controller.commit.remote(
                                partition_id,
                                write_id,
                                sample_ids,
                                units.tolist(),
                                schemas,
                                seq_lens,
                                tags,
                                bool(overwrite),
                                staged,
                            )
                        ]
                    )
                )
            except BaseException:
                yield [self._transport.discard(u, write_id) for u in staged]
                raise
            if result["rerouted"]:
                yield [self._transport.discard(u, write_id) for u in staged]
                position = {s: i for i, s in enumerate(sample_ids)}
                for s, u in result["rerouted"].items():
                    units[position[s]] = u
                continue
            self._remember(partition_id, sample_ids, units)
            return KVBatchMeta(
                partition_id=partition_id,
                sample_ids=sample_ids,
                fields=list(encoded),
                sequence_lengths=result["sequence_lengths"],
                tags=tags,
            )
        raise InvalidBatch(
            "samples kept moving between units while writing; retry",
            ids=sample_ids[:10],
            partition_id=partition_id,
        )

    def put_samples(
        self,
        sample_ids: Sequence[str],
        partition_id: str,
        fields: Mapping[str, Any],
        tags: Sequence[dict] | None = None,
        overwrite: bool = False,
    ) -> KVBatchMeta:
        """Write fields of samples (new samples, or new fields of existing ones)."""
        return _run_sync(self._put_flow(sample_ids, partition_id, fields, tags, overwrite))

    async def put_samples_async(
        self,
        sample_ids: Sequence[str],
        partition_id: str,
        fields: Mapping[str, Any],
        tags: Sequence[dict] | None = None,
        overwrite: bool = False,
    ) -> KVBatchMeta:
        return await _run_async(self._put_flow(sample_ids, partition_id, fields, tags, overwrite))

    # ---- get ----------------------------------------------------------------------
    def _get_flow(self, sample_ids, partition_id, select_fields) -> Flow:
        sample_ids = list(sample_ids)
        if not sample_ids:
            raise InvalidBatch("get needs at least one sample id", partition_id=partition_id)
        fields = None if select_fields is None else list(select_fields)
        where = _one((yield [self._controller.locate.remote(partition_id, sample_ids, fields)]))
        fields, units = where["fields"], np.asarray(where["units"], dtype=np.int64)
        self._remember(partition_id, sample_ids, units)
        if not fields:
            return {}
        plan = {int(u): np.nonzero(units == u)[0] for u in np.unique(units)}
        by_unit = {u: [sample_ids[i] for i in rows] for u, rows in plan.items()}
        results = yield from self._transport.read_flow(partition_id, by_unit, fields)
        for (u, rows), r in zip(plan.items(), results):
            if isinstance(r, RayActorError):
                yield from self._unit_died(u)
                raise SamplesLost(
                    "their storage unit died",
                    ids=[sample_ids[i] for i in rows],
                    partition_id=partition_id,
                )
            if isinstance(r, BaseException):
                raise r
        # Row j of the output is row order[j] of the units' results concatenated.
        position = np.concatenate(list(plan.values()))
        order = np.empty(len(sample_ids), dtype=np.int64)
        order[position] = np.arange(len(sample_ids))
        try:
            return {name: assemble([r[name] for r in results], order) for name in fields}
        except OSError:
            # A chunk was freed between our validation and our mapping (a concurrent
            # clear or overwrite): read through Ray, which re-validates on the unit.
            results = yield from self._transport.read_flow(
                partition_id, by_unit, fields, via_ray=True
            )
            for r in results:
                if isinstance(r, BaseException):
                    raise r from None
            return {name: assemble([r[name] for r in results], order) for name in fields}

    def get_samples(
        self,
        sample_ids: Sequence[str],
        partition_id: str,
        select_fields: Sequence[str] | None = None,
    ) -> dict[str, Any]:
        """Read fields of samples, in the order of ``sample_ids``."""
        return _run_sync(self._get_flow(sample_ids, partition_id, select_fields))

    async def get_samples_async(
        self,
        sample_ids: Sequence[str],
        partition_id: str,
        select_fields: Sequence[str] | None = None,
    ) -> dict[str, Any]:
        return await _run_async(self._get_flow(sample_ids, partition_id, select_fields))

    def get_data(
        self, meta: KVBatchMeta, select_fields: Sequence[str] | None = None
    ) -> dict[str, Any]:
        """Read the samples a meta names (``select_fields``, else the meta's fields)."""
        return self.get_samples(meta.sample_ids, meta.partition_id, select_fields or meta.fields)

    async def get_data_async(
        self, meta: KVBatchMeta, select_fields: Sequence[str] | None = None
    ) -> dict[str, Any]:
        return await self.get_samples_async(
            meta.sample_ids, meta.partition_id, select_fields or meta.fields
        )

    # ---- claims and status --------------------------------------------------------
    def _claim_flow(
        self, partition_id, task_name, required_fields, batch_size, dp_rank, blocking, timeout_s
    ) -> Flow:
        return _one(
            (
                yield [
                    self._controller.claim_meta.remote(
                        partition_id,
                        task_name,
                        list(required_fields),
                        int(batch_size),
                        dp_rank,
                        bool(blocking),
                        float(timeout_s),
                    )
                ]
            )
        )

    def claim_meta(
        self,
        partition_id: str,
        task_name: str,
        required_fields: Sequence[str],
        batch_size: int,
        dp_rank: int | None = None,
        blocking: bool = True,
        timeout_s: float = 60,
    ) -> KVBatchMeta | None:
        """Claim up to ``batch_size`` ready samples the task has not consumed yet."""
        return _run_sync(
            self._claim_flow(
                partition_id, task_name, required_fields, batch_size, dp_rank, blocking, timeout_s
            )
        )

    async def claim_meta_async(
        self,
        partition_id: str,
        task_name: str,
        required_fields: Sequence[str],
        batch_size: int,
        dp_rank: int | None = None,
        blocking: bool = True,
        timeout_s: float = 60,
    ) -> KVBatchMeta | None:
        return await _run_async(
            self._claim_flow(
                partition_id, task_name, required_fields, batch_size, dp_rank, blocking, timeout_s
            )
        )

    def _call_flow(self, method: str, *args) -> Flow:
        return _one((yield [getattr(self._controller, method).remote(*args)]))

    def check_consumption_status(self, partition_id: str, task_names: Sequence[str]) -> dict:
        """Per task: consumed / total / expected samples and whether it is done."""
        return _run_sync(
            self._call_flow("check_consumption_status", partition_id, list(task_names))
        )

    async def check_consumption_status_async(
        self, partition_id: str, task_names: Sequence[str]
    ) -> dict:
        return await _run_async(
            self._call_flow("check_consumption_status", partition_id, list(task_names))
        )

    def describe_partition(self, partition_id: str) -> dict:
        return _run_sync(self._call_flow("describe_partition", partition_id))

    async def describe_partition_async(self, partition_id: str) -> dict:
        return await _run_async(self._call_flow("describe_partition", partition_id))

    def service_info(self) -> dict:
        """Units, bytes held and capacity (rollout actors back off on this)."""
        return _run_sync(self._call_flow("service_info"))

    async def service_info_async(self) -> dict:
        return await _run_async(self._call_flow("service_info"))

    # ---- clear --------------------------------------------------------------------
    def _clear_flow(self, sample_ids, partition_id) -> Flow:
        ids = None if sample_ids is None else list(sample_ids)
        result = _one((yield [self._controller.clear.remote(partition_id, ids)]))
        if ids is None:
            self._routes = {k: v for k, v in self._routes.items() if k[0] != partition_id}
        else:
            for s in ids:
                self._routes.pop((partition_id, s), None)
        return result

    def clear_samples(self, sample_ids: Sequence[str] | None, partition_id: str) -> dict:
        """Forget samples and free their bytes (``None`` = the whole partition)."""
        return _run_sync(self._clear_flow(sample_ids, partition_id))

    async def clear_samples_async(
        self, sample_ids: Sequence[str] | None, partition_id: str
    ) -> dict:
        return await _run_async(self._clear_flow(sample_ids, partition_id))

    def close(self) -> None:
        self._routes.clear()
        self._controller = None
        self._transport = None


def connect(name: str = "dataplane", namespace: str = "dataplane") -> DataPlaneClient:
    """Attach to a running service from any process of the Ray cluster."""
    if not ray.is_initialized():
        raise ServiceUnavailable(
            "Ray is not initialised in this process; call ray.init(address=...) first"
        )
    try:
        controller = ray.get_actor(name, namespace=namespace)
    except ValueError:
        raise ServiceUnavailable(
            f"no data-plane service named {name!r} in namespace {namespace!r}"
        ) from None
    return DataPlaneClient(controller, name=name, namespace=namespace)
