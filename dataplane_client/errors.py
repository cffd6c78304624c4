"""Typed errors of the data plane.

Every failure a user can hit is one subclass of :class:`DataPlaneError`. Each
carries the offending ``ids`` / ``fields`` (when there are any) both as
attributes and in its message, and pickles cleanly so an error raised inside a
Ray actor reaches the caller as the same class (the client unwraps Ray's task
error; see ``dataplane_client.client``).
"""

from __future__ import annotations

from collections.abc import Iterable

_MAX_LISTED = 20


def _preview(items: Iterable[object]) -> str:
    items = list(items)
    shown = ", ".join(repr(x) for x in items[:_MAX_LISTED])
    more = f", ... (+{len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else ""
    return f"[{shown}{more}]"


class DataPlaneError(Exception):
    """Base class of every data-plane error."""

    def __init__(
        self,
        message: str,
        *,
        ids: Iterable[object] | None = None,
        fields: Iterable[str] | None = None,
        partition_id: str | None = None,
    ):
        self.message = message
        self.ids = list(ids) if ids is not None else []
        self.fields = list(fields) if fields is not None else []
        self.partition_id = partition_id
        parts = [message]
        if partition_id is not None:
            parts.append(f"partition={partition_id!r}")
        if self.ids:
            parts.append(f"ids={_preview(self.ids)}")
        if self.fields:
            parts.append(f"fields={_preview(self.fields)}")
        super().__init__("; ".join(parts))

    def __reduce__(self):
        return (
            _rebuild,
            (type(self), self.message, self.ids, self.fields, self.partition_id),
        )


def _rebuild(cls, message, ids, fields, partition_id):
    return cls(message, ids=ids or None, fields=fields or None, partition_id=partition_id)


class UnknownPartition(DataPlaneError):
    """The partition was never registered or has been dropped."""


class PartitionExists(DataPlaneError):
    """register_partition was called twice with an incompatible schema."""


class FieldNotProduced(DataPlaneError):
    """A read asked for a field some samples have not produced (yet)."""


class SamplesNotFound(DataPlaneError):
    """Sample ids unknown to the partition (never written, or cleared)."""


class FieldAlreadyProduced(DataPlaneError):
    """A write targets a (sample, field) that already holds bytes, without overwrite=True."""


class SchemaConflict(DataPlaneError):
    """A field was written with a dtype / trailing shape / layout other than its first write."""


class InvalidBatch(DataPlaneError):
    """The batch itself is malformed: length mismatch, duplicate ids, unsupported value."""


class CapacityExceeded(DataPlaneError):
    """A storage unit has no room for the write (and the bounded wait, if any, ran out)."""


class ClaimTimeout(DataPlaneError):
    """A blocking claim_meta found too few ready samples within its timeout."""


class SamplesLost(DataPlaneError):
    """The storage unit (or node) holding these samples is gone; the rest stays readable."""


class CorruptPayload(DataPlaneError):
    """Encoded bytes are truncated or corrupted."""


class ServiceUnavailable(DataPlaneError):
    """No data-plane service under that name, or it is shutting down."""


ALL_ERRORS: tuple[type[DataPlaneError], ...] = (
    UnknownPartition,
    PartitionExists,
    FieldNotProduced,
    SamplesNotFound,
    FieldAlreadyProduced,
    SchemaConflict,
    InvalidBatch,
    CapacityExceeded,
    ClaimTimeout,
    SamplesLost,
    CorruptPayload,
    ServiceUnavailable,
)
