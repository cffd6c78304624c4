"""SaveCheckpoint / RestoreCheckpoint: the controller's checkpoint and restore over gRPC.

The directory is a path on the service's nodes, not on the caller's machine, so
it must be absolute (a relative one would land in a Ray worker's directory).
Status codes, chosen for what the caller should do next:

- ``InvalidBatch`` (target exists, service not empty, too few live units) ->
  FAILED_PRECONDITION: the request is well formed, the system is not in the
  state it needs; retrying the same call fails until someone changes that state.
- ``CorruptPayload`` (no manifest, a file that cannot be read, a checksum or
  size mismatch) -> DATA_LOSS: the checkpoint's bytes are not what was saved;
  no retry helps, pick another.
- ``CheckpointError`` (the directory cannot be made, written or renamed into
  place: a dangling symbolic link, a path under a regular file or in /proc,
  permission denied, disk full) -> FAILED_PRECONDITION, with its message naming
  the path and the operating system's reason; so would any other ``OSError``.
"""

from __future__ import annotations

import os

import grpc

from dataplane_client.wire import arguments, errors
from dataplane_server.admin.sources import ActorSources
from dataplane_server.admin_pb import admin_pb2

# A caller without a deadline waits as long as a save or restore takes (it moves every
# byte). grpc reports "no deadline" as None or, depending on how the call arrived (grpcurl
# without -max-time), as a remaining time of about 2**63 ns: a timeout that large overflows
# ray.get, so anything beyond this is read as no deadline.
NO_DEADLINE_BEYOND_S = 365 * 24 * 3600.0


class CheckpointAbort(Exception):
    """A checkpoint failure with the gRPC status it maps to."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def timeout_for(context: grpc.ServicerContext) -> float | None:
    """The caller's deadline as a ``ray.get`` timeout; None (wait) when it set none."""
    remaining = context.time_remaining()
    if remaining is None or remaining > NO_DEADLINE_BEYOND_S:
        return None
    return max(0.0, remaining)


def directory_of(request) -> str:
    return _absolute(request.directory, "directory")


def _absolute(path: str, name: str) -> str:
    if not path or not os.path.isabs(path):
        raise CheckpointAbort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{name} must be an absolute path on the service's nodes, got {path!r}",
        )
    try:
        return arguments.directory(path)  # e.g. a NUL byte, which no file name holds
    except errors.InvalidBatch as e:
        raise CheckpointAbort(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None


def _mapped(exc: BaseException) -> CheckpointAbort | None:
    if isinstance(exc, errors.CorruptPayload):
        return CheckpointAbort(grpc.StatusCode.DATA_LOSS, f"CorruptPayload: {exc}")
    if isinstance(exc, errors.InvalidBatch):
        return CheckpointAbort(grpc.StatusCode.FAILED_PRECONDITION, f"InvalidBatch: {exc}")
    if isinstance(exc, errors.CheckpointError):
        return CheckpointAbort(grpc.StatusCode.FAILED_PRECONDITION, f"CheckpointError: {exc}")
    if isinstance(exc, OSError) and not isinstance(exc, ConnectionError | TimeoutError):
        return CheckpointAbort(grpc.StatusCode.FAILED_PRECONDITION, f"{type(exc).__name__}: {exc}")
    return None


def _call(sources: ActorSources, method: str, timeout_s: float | None, *args):
    try:
        return sources.call(method, *args, timeout_s=timeout_s)
    except Exception as exc:
        mapped = _mapped(exc)
        if mapped is None:
            raise
        raise mapped from None


def save(sources: ActorSources, request, context) -> admin_pb2.SaveCheckpointResponse:
    parent = _absolute(request.parent, "parent") if request.parent else None
    path = _call(sources, "checkpoint", timeout_for(context), directory_of(request), parent)
    return admin_pb2.SaveCheckpointResponse(directory=path)


def restore(sources: ActorSources, request, context) -> admin_pb2.RestoreCheckpointResponse:
    directory = directory_of(request)
    count = _call(sources, "restore", timeout_for(context), directory)
    return admin_pb2.RestoreCheckpointResponse(directory=directory, restored_samples=int(count))
