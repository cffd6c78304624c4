"""The AdminService RPCs: ask the actors, answer in protobuf.

Every RPC reads a typed message (``dataplane_client.wire.messages``) from the
controller, or plain builtins from a unit's preview, and turns it into a
protobuf message field by field; nothing a caller sends is unpickled. Data-plane
errors map onto gRPC status codes (unknown partition -> NOT_FOUND, bad
argument -> INVALID_ARGUMENT, actor gone -> UNAVAILABLE, ...), with the typed
error's message, which names the offending partition / ids / fields.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import threading
from typing import Any

import grpc
from google.protobuf import struct_pb2
from ray.exceptions import GetTimeoutError, RayActorError

from dataplane_client.wire import errors, messages
from dataplane_server.admin import checkpoints
from dataplane_server.admin.sources import DEFAULT_TIMEOUT_S, ActorSources, StatsPull, counter
from dataplane_server.admin_pb import admin_pb2, admin_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name


def method_path(rpc: str) -> str:
    """The gRPC path of an AdminService RPC, as interceptors see it."""
    return f"/{SERVICE_NAME}/{rpc}"


# Refused without a token off loopback; SaveCheckpoint writes files on the service's nodes.
MUTATING_METHODS = frozenset(
    method_path(rpc)
    for rpc in ("ClearPartition", "DeletePartition", "SaveCheckpoint", "RestoreCheckpoint")
)

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000
DEFAULT_PREVIEW_ELEMS = 8
MAX_PREVIEW_ELEMS = 256
DEFAULT_WATCH_INTERVAL_S = 1.0
MIN_WATCH_INTERVAL_S = 0.05
MAX_WATCH_INTERVAL_S = 3600.0
# A page token is the decimal offset of the next page; longer ones are forged.
MAX_PAGE_TOKEN_DIGITS = 12

LAYOUTS = {
    "dense": admin_pb2.LAYOUT_DENSE,
    "jagged": admin_pb2.LAYOUT_JAGGED,
    "object": admin_pb2.LAYOUT_OBJECT,
}
STATUS_FILTERS = {
    admin_pb2.SAMPLE_STATUS_UNSPECIFIED: None,
    admin_pb2.SAMPLE_STATUS_READY: "ready",
    admin_pb2.SAMPLE_STATUS_PENDING: "pending",
    admin_pb2.SAMPLE_STATUS_CONSUMED: "consumed",
    admin_pb2.SAMPLE_STATUS_LOST: "lost",
    admin_pb2.SAMPLE_STATUS_LEASED: "leased",
}
_NOT_FOUND = (errors.UnknownPartition, errors.SamplesNotFound, errors.FieldNotProduced)


class RpcAbort(Exception):
    """Raised inside an RPC body to end it with a status code and message."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status a failure maps to, with a message safe to send to any caller."""
    if isinstance(exc, RpcAbort | checkpoints.CheckpointAbort):
        return exc.code, exc.message
    if isinstance(exc, _NOT_FOUND):
        return grpc.StatusCode.NOT_FOUND, f"{type(exc).__name__}: {exc}"
    if isinstance(exc, errors.InvalidBatch):
        return grpc.StatusCode.INVALID_ARGUMENT, f"{type(exc).__name__}: {exc}"
    if isinstance(exc, errors.ServiceUnavailable):
        return grpc.StatusCode.UNAVAILABLE, f"{type(exc).__name__}: {exc}"
    if isinstance(exc, errors.DataPlaneError):
        return grpc.StatusCode.FAILED_PRECONDITION, f"{type(exc).__name__}: {exc}"
    if isinstance(exc, GetTimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, "the data-plane actors did not answer in time"
    if isinstance(exc, RayActorError):
        return (
            grpc.StatusCode.UNAVAILABLE,
            f"a data-plane actor is unavailable: {type(exc).__name__}",
        )
    if isinstance(exc, IndexError):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}"


def _unary(fn):
    """Run an RPC body; turn any failure into a gRPC status (logging the unexpected ones)."""

    @functools.wraps(fn)
    def wrapper(self, request, context):
        try:
            return fn(self, request, context)
        except Exception as exc:
            code, message = status_for(exc)
            if code == grpc.StatusCode.INTERNAL:
                logger.exception("admin RPC %s failed", fn.__name__)
            context.abort(code, message)

    return wrapper


def page_offset(token: str) -> int:
    """The offset a ``next_page_token`` stands for (0 for the first page)."""
    if not token:
        return 0
    # ASCII digits only: str.isdigit() also accepts other scripts' digits and superscripts.
    if len(token) > MAX_PAGE_TOKEN_DIGITS or not (token.isascii() and token.isdigit()):
        raise RpcAbort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"invalid page_token {token[:40]!r}: pass the next_page_token of the previous page",
        )
    return int(token)


def _require(value: str, what: str) -> str:
    if not value:
        raise RpcAbort(grpc.StatusCode.INVALID_ARGUMENT, f"{what} is required")
    return value


def _json_safe(value: Any) -> Any:
    """Tags and preview values as JSON-able builtins (anything else becomes its str)."""
    return json.loads(json.dumps(value, default=str))


def _struct(mapping: dict | None) -> struct_pb2.Struct:
    out = struct_pb2.Struct()
    if mapping:
        out.update({str(k): v for k, v in _json_safe(mapping).items()})
    return out


def _proto(cls, message: Any, **overrides: Any):
    """Protobuf ``cls`` from a message's attributes of the same names (None = unset)."""
    names = cls.DESCRIPTOR.fields_by_name
    values = {
        f.name: getattr(message, f.name)
        for f in dataclasses.fields(message)
        if f.name in names and f.name not in overrides
    }
    values.update(overrides)
    return cls(**{k: v for k, v in values.items() if v is not None})


def sample_message(sample: messages.SampleStatus) -> admin_pb2.SampleInfo:
    return _proto(
        admin_pb2.SampleInfo,
        sample,
        tags=_struct(sample.tags),
        status=admin_pb2.SampleStatus.Value(f"SAMPLE_STATUS_{sample.status.upper()}"),
    )


def preview_message(name: str, raw: dict) -> admin_pb2.FieldPreview:
    shape = [int(x) for x in raw.get("shape") or ()]
    values = _json_safe(list(raw.get("values") or ()))
    held = math.prod(shape) if shape else len(values)
    out = admin_pb2.FieldPreview(
        name=name,
        dtype=str(raw.get("dtype", "")),
        layout=LAYOUTS.get(str(raw.get("layout", "")), admin_pb2.LAYOUT_UNSPECIFIED),
        shape=shape,
        truncated=held > len(values),
    )
    out.values.extend(values)
    return out


def stats_message(pull: StatsPull) -> admin_pb2.StatsSnapshot:
    """One WatchStats message from a round of actor snapshots."""
    partitions = pull.partitions()
    errors_by_type: dict[str, int] = {}
    for stats in [pull.controller.stats] + [u.stats for u in pull.units if u is not None]:
        for kind, n in (stats.get("errors") or {}).items():
            errors_by_type[kind] = errors_by_type.get(kind, 0) + int(n)
    units = []
    for position, snap in enumerate(pull.units):
        if snap is None:
            units.append(admin_pb2.UnitStats(index=position, alive=False))
            continue
        stats = snap.stats
        units.append(
            admin_pb2.UnitStats(
                index=snap.index,
                node_id=snap.node_id,
                alive=True,
                bytes=snap.bytes,
                samples=snap.samples,
                capacity_bytes=snap.capacity_bytes,
                put_bytes_total=int(counter(stats, "put_bytes_total")),
                get_bytes_total=int(counter(stats, "get_bytes_total")),
                put_requests_total=int(counter(stats, "put_requests_total")),
                get_requests_total=int(counter(stats, "get_requests_total")),
            )
        )
    return admin_pb2.StatsSnapshot(
        timestamp=pull.timestamp,
        claims_waiting=pull.controller.claims_waiting,
        puts_waiting=pull.controller.puts_waiting,
        puts_rejected_total=int(counter(pull.controller.stats, "puts_rejected_total")),
        num_samples=sum(p.num_samples for p in partitions),
        bytes=sum(p.bytes for p in partitions),
        put_bytes_total=sum(u.put_bytes_total for u in units),
        get_bytes_total=sum(u.get_bytes_total for u in units),
        put_requests_total=sum(u.put_requests_total for u in units),
        get_requests_total=sum(u.get_requests_total for u in units),
        errors=errors_by_type,
        partitions=[
            admin_pb2.PartitionStats(
                partition_id=p.partition_id, num_samples=p.num_samples, bytes=p.bytes
            )
            for p in partitions
        ],
        units=units,
    )


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    """AdminService over one data-plane service's actors."""

    def __init__(
        self,
        sources: ActorSources,
        *,
        stopping: threading.Event | None = None,
        max_watches: int = 4,
        rpc_timeout_s: float = DEFAULT_TIMEOUT_S,
    ):
        self.sources = sources
        self.rpc_timeout_s = rpc_timeout_s
        # Set when the server stops: open WatchStats streams end instead of holding shutdown.
        self.stopping = stopping or threading.Event()
        # Each open watch holds a server thread; cap them so watches cannot starve other RPCs.
        self._watch_slots = threading.BoundedSemaphore(max(1, max_watches))

    def _timeout(self, context: grpc.ServicerContext) -> float:
        remaining = context.time_remaining()
        if remaining is None:
            return self.rpc_timeout_s
        return max(0.0, min(self.rpc_timeout_s, remaining))

    @_unary
    def GetServiceInfo(self, request, context):
        info = self.sources.call("service_info", timeout_s=self._timeout(context))
        return _proto(
            admin_pb2.ServiceInfo,
            info,
            units=[
                _proto(
                    admin_pb2.UnitInfo,
                    u,
                    payload_paths=[_proto(admin_pb2.PayloadChoice, p) for p in u.payload_paths],
                )
                for u in info.units
            ],
            last_checkpoint=None
            if info.last_checkpoint is None
            else _proto(admin_pb2.CheckpointInfo, info.last_checkpoint),
        )

    @_unary
    def ListPartitions(self, request, context):
        rows = self.sources.call("list_partitions", timeout_s=self._timeout(context))
        return admin_pb2.ListPartitionsResponse(
            partitions=[_proto(admin_pb2.PartitionSummary, p) for p in rows]
        )

    @_unary
    def DescribePartition(self, request, context):
        pid = _require(request.partition_id, "partition_id")
        d = self.sources.call("describe_partition", pid, timeout_s=self._timeout(context))
        return _proto(
            admin_pb2.PartitionDescription,
            d,
            fields=[
                _proto(
                    admin_pb2.FieldInfo,
                    f,
                    layout=LAYOUTS.get(f.layout, admin_pb2.LAYOUT_UNSPECIFIED),
                )
                for f in d.fields
            ],
            consumption=[_proto(admin_pb2.TaskConsumption, c) for c in d.consumption],
            bytes_per_unit=[
                admin_pb2.UnitBytes(unit=i, bytes=b) for i, b in enumerate(d.bytes_per_unit)
            ],
            staleness=None if d.staleness is None else _proto(admin_pb2.Staleness, d.staleness),
        )

    @_unary
    def ListSamples(self, request, context):
        pid = _require(request.partition_id, "partition_id")
        if request.status not in STATUS_FILTERS:
            raise RpcAbort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown status {request.status}")
        if request.page_size < 0:
            raise RpcAbort(grpc.StatusCode.INVALID_ARGUMENT, "page_size must be >= 0")
        limit = min(request.page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        offset = page_offset(request.page_token)
        page = self.sources.call(
            "list_samples",
            pid,
            STATUS_FILTERS[request.status],
            offset,
            limit,
            timeout_s=self._timeout(context),
        )
        return admin_pb2.ListSamplesResponse(
            samples=[sample_message(s) for s in page.samples],
            total=page.total,
            next_page_token=str(page.next_offset) if page.next_offset is not None else "",
        )

    @_unary
    def GetSample(self, request, context):
        pid = _require(request.partition_id, "partition_id")
        sid = _require(request.sample_id, "sample_id")
        if request.max_elems < 0:
            raise RpcAbort(grpc.StatusCode.INVALID_ARGUMENT, "max_elems must be >= 0")
        max_elems = min(request.max_elems or DEFAULT_PREVIEW_ELEMS, MAX_PREVIEW_ELEMS)
        timeout = self._timeout(context)
        sample = self.sources.call("sample_status", pid, sid, timeout_s=timeout)
        out = admin_pb2.GetSampleResponse(partition_id=pid, sample=sample_message(sample))
        if sample.lost:
            return out  # its bytes are gone with its unit: nothing to preview
        fields = list(request.fields) or None
        missing = [f for f in fields or () if f not in sample.fields]
        if missing:  # the unit would skip them: say so rather than show less than asked
            raise errors.FieldNotProduced(
                "not produced for this sample", ids=[sid], fields=missing, partition_id=pid
            )
        raw = self.sources.call_unit(
            sample.unit, "preview", pid, sid, fields, max_elems, timeout_s=timeout
        )
        for name in fields or list(raw):
            if name in raw:
                out.previews.append(preview_message(name, raw[name]))
        return out

    @_unary
    def ClearPartition(self, request, context):
        pid = _require(request.partition_id, "partition_id")
        # No ids: the whole partition, which (as clear_samples(None, p)) deletes it.
        ids = list(request.sample_ids) or None
        done = self.sources.client().clear_samples(ids, pid)
        what = f"{len(ids)} samples of" if ids else "every sample of (deleted)"
        logger.warning("admin: cleared %s partition %r: %s", what, pid, done)
        return admin_pb2.ClearPartitionResponse(
            partition_id=pid, cleared_samples=done.cleared, bytes_freed=done.bytes_freed
        )

    @_unary
    def DeletePartition(self, request, context):
        pid = _require(request.partition_id, "partition_id")
        done = self.sources.client().delete_partition(pid)
        logger.warning("admin: deleted partition %r: %s", pid, done)
        return admin_pb2.DeletePartitionResponse(
            partition_id=pid, deleted_samples=done.cleared, bytes_freed=done.bytes_freed
        )

    @_unary
    def SaveCheckpoint(self, request, context):
        done = checkpoints.save(self.sources, request, context)
        logger.warning("admin: saved a checkpoint to %s", done.directory)
        return done

    @_unary
    def RestoreCheckpoint(self, request, context):
        done = checkpoints.restore(self.sources, request, context)
        logger.warning("admin: restored %d samples from %s", done.restored_samples, done.directory)
        return done

    def WatchStats(self, request, context):
        if not 0 <= request.interval_s <= MAX_WATCH_INTERVAL_S:  # NaN fails this too
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"interval_s must be within [0, {MAX_WATCH_INTERVAL_S:g}], got {request.interval_s}",
            )
        if request.count < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "count must be >= 0")
        interval = max(request.interval_s or DEFAULT_WATCH_INTERVAL_S, MIN_WATCH_INTERVAL_S)
        if not self._watch_slots.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many open WatchStats streams")
        try:
            sent = 0
            while context.is_active() and not self.stopping.is_set():
                failure = None
                try:
                    pull = self.sources.stats(timeout_s=self.rpc_timeout_s)
                except Exception as exc:  # noqa: BLE001 - status_for maps every error to a code
                    failure = status_for(exc)
                if failure is not None:
                    context.abort(*failure)
                yield stats_message(pull)
                sent += 1
                if request.count and sent >= request.count:
                    return
                self.stopping.wait(interval)
            if self.stopping.is_set():
                # An error, not a clean end: a watcher must not read "the stream is complete".
                context.abort(grpc.StatusCode.UNAVAILABLE, "the admin endpoint is shutting down")
        finally:
            self._watch_slots.release()
