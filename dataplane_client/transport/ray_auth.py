"""Whether a Ray cluster refuses this process for want of token authentication, asked of
its GCS before ``ray.init``.

Ray's own join retries a refused GCS connection once a second, 20 times, logging each
refusal to stderr, before it raises: 25 s and 20 lines for a mistake one call names.
"""

from __future__ import annotations

import os

TOKEN_MODE = "token"


def token_mode() -> bool:
    """Whether this process asks Ray for token authentication (read when Ray is imported)."""
    return os.environ.get("RAY_AUTH_MODE", "").lower() == TOKEN_MODE


def refused_without_token(address: str, timeout_s: float = 3.0) -> str | None:
    """The GCS's words when it refuses a call without a token from a process not in token
    mode, else None: token mode is on (Ray sends the token itself), the address is not
    HOST:PORT, or the GCS answered, or did not (``ray.init`` then says what is wrong)."""
    host, sep, port = address.rpartition(":")
    if token_mode() or "://" in address or not sep or not host or not port.isdigit():
        return None
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    channel = grpc.insecure_channel(address)
    try:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        request = gcs_service_pb2.GetClusterIdRequest()  # type: ignore[attr-defined]
        stub.GetClusterId(request, timeout=timeout_s)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
            return exc.details() or "unauthenticated"
        return None
    finally:
        channel.close()
    return None
