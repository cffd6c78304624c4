"""Typed errors of the data plane.

Every failure a user can hit is one subclass of :class:`DataPlaneError`. Each
carries the offending ``ids`` / ``fields`` (when there are any) both as
attributes and in its message, and pickles cleanly so an error raised inside a
Ray actor reaches the caller as the same class (the client unwraps Ray's task
error; see ``dataplane_client.client``).

NeMo-RL callers catch built-in exceptions, so each class is also the matching
built-in: not found / not produced / unknown task -> ``KeyError``; invalid
argument or batch -> ``ValueError``; wrong type -> ``TypeError``; a claim or
capacity wait that ran out -> ``TimeoutError``; a service that cannot be
reached -> ``ConnectionError``. Errors a caller may simply retry derive from
:class:`RetryableError`.
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

    def __str__(self) -> str:
        # KeyError would repr() its argument; every data-plane error reads the same.
        return str(self.args[0]) if self.args else self.message

    def __reduce__(self):
        return (
            _rebuild,
            (type(self), self.message, self.ids, self.fields, self.partition_id),
        )


def _rebuild(cls, message, ids, fields, partition_id):
    return cls(message, ids=ids or None, fields=fields or None, partition_id=partition_id)


class RetryableError(DataPlaneError):
    """Nothing was changed and the same call may succeed if simply retried."""


class UnknownPartition(DataPlaneError, KeyError):
    """The partition was never registered or has been deleted."""


class UnknownTask(DataPlaneError, KeyError):
    """A consumer task that was not registered for the partition."""


class FieldNotProduced(DataPlaneError, KeyError):
    """A read asked for a field some samples have not produced (yet)."""


class SamplesNotFound(DataPlaneError, KeyError):
    """Sample ids unknown to the partition (never written, or cleared)."""


class SamplesLost(DataPlaneError, KeyError):
    """The storage unit (or node) holding these samples is gone; the rest stays readable."""


class FieldAlreadyProduced(DataPlaneError, ValueError):
    """A write targets a (sample, field) that already holds bytes, without overwrite=True."""


class SchemaConflict(DataPlaneError, ValueError):
    """A field was written with a dtype / trailing shape / layout other than its first write."""


class GroupValueConflict(DataPlaneError, ValueError):
    """A member's value of a per-group field (``group_fields``) differs from its group's:
    the group's value is stored once, so members must agree bit for bit. Names the field,
    the group (in the message) and the members whose value differs; nothing is stored."""


class InvalidBatch(DataPlaneError, ValueError):
    """An argument or the batch itself is malformed: length mismatch, duplicate ids, bad value."""


class CorruptPayload(DataPlaneError, ValueError):
    """Encoded bytes are truncated, corrupted or describe an impossible layout."""


class PayloadTransferFailed(RetryableError, ConnectionError):
    """A transfer engine could not move a read's bytes from a unit on another node (the
    peer is unreachable or died mid-transfer, or refused the addresses): nothing was
    returned; the client reads those rows through Ray instead."""


class ConfigError(DataPlaneError, ValueError):
    """A configuration value is unknown, of the wrong type or out of range."""


class NonTensorField(DataPlaneError, TypeError):
    """A field value that is not a tensor, in a field not declared for objects or enums."""


class CapacityExceeded(DataPlaneError, TimeoutError):
    """A storage unit has no room for the write (and the bounded wait, if any, ran out)."""


class ClaimTimeout(DataPlaneError, TimeoutError):
    """A blocking claim_meta found too few ready samples within its timeout."""


class VersionRegression(InvalidBatch):
    """``set_policy_version`` with a version below the partition's current one: a policy
    version never goes backwards (the call changed nothing)."""


class RolloutFinished(InvalidBatch):
    """``append_tokens`` to a sample that is no partial rollout in progress: it was finished
    (``finish=True``) or put whole by ``put_samples``. Nothing changed."""


class AppendConflict(RetryableError, ValueError):
    """Another append to the same sample landed between this append's read of the sample
    and its write: nothing of this one was stored (the client reads again and retries)."""


class AdmissionTimeout(DataPlaneError, TimeoutError):
    """``admit_rollouts(wait=True)`` found no room within its timeout: the samples started
    but not yet trained stay at the partition's staleness bound."""


class LeaseExpired(DataPlaneError, TimeoutError):
    """An ack for leased samples that another claim holds now (the lease ran out first)."""


class Overloaded(RetryableError, TimeoutError):
    """A put was not admitted within its deadline: more were waiting than the service took
    in that time. Nothing of it was staged or stored; ``queue`` names the queue it waited
    in (e.g. ``"put admission"``), and the message says how many were ahead of it."""

    def __init__(self, message: str, *, queue: str = "", **kwargs):
        super().__init__(message, **kwargs)
        self.queue = queue

    def __reduce__(self):
        return (
            _rebuild_overloaded,
            (type(self), self.message, self.queue, self.ids, self.partition_id),
        )


class StageReclaimed(Overloaded):
    """A put's staged bytes were reclaimed before its commit reached them (their
    ``stage_ttl_s`` ran out while the commit queued): nothing of the write is visible,
    and the put may simply be retried."""


def _rebuild_overloaded(cls, message, queue, ids, partition_id):
    return cls(message, queue=queue, ids=ids or None, partition_id=partition_id)


class ServiceUnavailable(RetryableError, ConnectionError):
    """No data-plane service under that name, or it is restarting or shutting down."""


class RoutingUnstable(RetryableError, ConnectionError):
    """Samples kept moving between storage units while a write was in flight."""


class JournalWriteFailed(ServiceUnavailable):
    """The controller could not write its journal (e.g. a full disk); the call changed
    nothing, and may be retried once the journal's disk has room."""


class CheckpointError(DataPlaneError, OSError):
    """A checkpoint cannot be saved where asked: the path cannot be made, written or renamed
    into place (the message names the path and the operating system's reason)."""


class CodecsChanged(RetryableError, ValueError):
    """The partition was registered again with other enums or object fields since this
    client encoded the write; nothing was stored (the client re-encodes and retries)."""


class ReaderUnknown(RetryableError, KeyError):
    """A storage unit does not remember the process token a same-node read named by key
    (the unit restarted, or forgot the least recently seen of many readers): the client
    sends the token itself again. Never reaches a caller."""


class RouteChanged(RetryableError, KeyError):
    """A storage unit does not hold the generation of a sample a direct read asked for (the
    sample was overwritten, cleared, moved, or the unit is not the one that held it): the
    client reads through the controller's ``locate`` instead. Never reaches a caller."""
