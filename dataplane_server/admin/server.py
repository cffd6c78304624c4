"""The gRPC admin server: AdminService + standard health + reflection, behind auth.

- Health (``grpc.health.v1``) follows the controller (``health_watch``): SERVING
  while it answers, NOT_SERVING while it is down or restarting and once the
  service drains, for the overall server ("") and for AdminService; it never
  needs the token, so load balancers and k8s probes work unauthenticated.
- Reflection lists AdminService and Health, so ``grpcurl`` works without the proto.
- Auth: ``authorization: Bearer <admin_token>`` metadata (scheme name matched
  case-insensitively). With a token configured every AdminService RPC needs it,
  since all but service info return partition or sample data; service info and
  reflection stay open unless ``admin_token_for_reads``. Missing or wrong ->
  UNAUTHENTICATED. Without a token, reads are open and mutations are allowed
  only while the server listens on a loopback address (the default); on any
  other address they are refused with PERMISSION_DENIED until a token is set.
- TLS when ``admin_tls_cert`` / ``admin_tls_key`` are set.
- Requests above ``admin_max_request_bytes`` are refused by gRPC itself
  (RESOURCE_EXHAUSTED) before any handler sees them.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from dataplane_client.wire.config import DataPlaneConfig
from dataplane_client.wire.errors import ConfigError
from dataplane_server.admin.decode_guard import DecodeErrorsAsInvalidArgument
from dataplane_server.admin.health_watch import HealthWatch
from dataplane_server.admin.servicer import (
    MUTATING_METHODS,
    SERVICE_NAME,
    AdminServicer,
    method_path,
)
from dataplane_server.admin.sources import ActorSources
from dataplane_server.admin_pb import admin_pb2_grpc

logger = logging.getLogger(__name__)

_HEALTH_PREFIX = f"/{health.SERVICE_NAME}/"
OPEN_WITH_TOKEN = frozenset(
    {
        method_path("GetServiceInfo"),
        f"/{reflection.SERVICE_NAME}/ServerReflectionInfo",
    }
)
_WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def join_host_port(host: str, port: int) -> str:
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def advertised_host(host: str) -> str:
    """The host clients should dial: the node's IP when bound to every interface."""
    if host not in _WILDCARD_HOSTS:
        return host
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - no Ray here: fall back to the host name
        import socket

        return socket.gethostbyname(socket.gethostname())


def _deny(handler, code: grpc.StatusCode, message: str):
    """A handler of the same shape as ``handler`` that ends the call with ``code``.

    It does not deserialize the request: an unauthenticated caller's bytes are never parsed.
    """
    if handler is None:  # unknown method: let gRPC answer UNIMPLEMENTED
        return None

    def abort(_request, context):
        context.abort(code, message)

    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(abort)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(abort)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(abort)
    return grpc.stream_stream_rpc_method_handler(abort)


def presented_token(metadata) -> bytes | None:
    """The credentials of an ``authorization: Bearer <token>`` header, else None.

    The scheme name is case-insensitive and may be followed by several spaces
    (RFC 7235 section 2.1), so ``bearer x`` and ``BEARER  x`` both present ``x``.
    """
    for key, value in metadata or ():
        if key != "authorization":
            continue
        text = value.decode("latin-1") if isinstance(value, bytes) else value
        scheme, _, credentials = text.partition(" ")
        if scheme.lower() != "bearer":
            return None
        return credentials.lstrip(" ").encode()
    return None


class BearerTokenAuth(grpc.ServerInterceptor):
    """Decides per method whether a call needs ``authorization: Bearer <token>``.

    Health is always open (probes carry no secrets). With a token configured,
    every other method needs it except ``open_methods``. Without one, reads are
    open and mutations are allowed only when ``mutations_open`` (a loopback bind).
    """

    def __init__(self, token: str | None, *, open_methods: frozenset[str], mutations_open: bool):
        self._expected = token.encode() if token else None
        self._open_methods = open_methods
        self._mutations_open = mutations_open

    def _authorized(self, metadata) -> bool:
        got = presented_token(metadata)
        # compare_digest: the time taken does not reveal how much of the token matched.
        # (Only asked with a token configured: intercept_service answers the no-token case.)
        expected = self._expected
        return got is not None and expected is not None and hmac.compare_digest(got, expected)

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(_HEALTH_PREFIX):
            return continuation(handler_call_details)
        if self._expected is None:
            if method not in MUTATING_METHODS or self._mutations_open:
                return continuation(handler_call_details)
            return _deny(
                continuation(handler_call_details),
                grpc.StatusCode.PERMISSION_DENIED,
                f"{method} is disabled: the admin endpoint listens on a non-loopback address "
                "without admin_token; set admin_token (or DATAPLANE_ADMIN_TOKEN)",
            )
        if method in self._open_methods or self._authorized(
            handler_call_details.invocation_metadata
        ):
            return continuation(handler_call_details)
        return _deny(
            continuation(handler_call_details),
            grpc.StatusCode.UNAUTHENTICATED,
            f"{method} needs a valid bearer token ('authorization: Bearer <token>' metadata)",
        )


def open_methods(token_for_reads: bool) -> frozenset[str]:
    """Methods answered without the token when one is configured: service info and the
    reflection schema (neither holds sample data), unless every RPC must carry it."""
    return frozenset() if token_for_reads else OPEN_WITH_TOKEN


class AdminServer:
    """One gRPC server for one data-plane service. start() -> "host:port"."""

    def __init__(self, config: DataPlaneConfig, sources: ActorSources):
        self.config = config
        self.stopping = threading.Event()
        self.servicer = AdminServicer(
            sources, stopping=self.stopping, max_watches=max(1, config.admin_max_workers // 2)
        )
        self.health = health.HealthServicer()
        self.health_watch = HealthWatch(
            self.health, sources.controller_ready, services=("", SERVICE_NAME)
        )
        if config.admin_token_for_reads and not config.admin_token:
            raise ConfigError(
                "admin_token_for_reads is set but no admin_token is configured",
                fields=["admin_token_for_reads"],
            )
        self._auth = BearerTokenAuth(
            config.admin_token,
            open_methods=open_methods(config.admin_token_for_reads),
            mutations_open=is_loopback(config.admin_host),
        )
        self._server: grpc.Server | None = None
        self.address: str | None = None

    def start(self) -> str:
        cfg = self.config
        server = grpc.server(
            futures.ThreadPoolExecutor(
                max_workers=cfg.admin_max_workers, thread_name_prefix="dataplane-admin"
            ),
            # auth first: an unauthenticated caller learns nothing about its bytes
            interceptors=[self._auth, DecodeErrorsAsInvalidArgument()],
            options=[
                ("grpc.max_receive_message_length", cfg.admin_max_request_bytes),
                # A fixed port already taken must fail loudly, not be shared silently.
                ("grpc.so_reuseport", 0),
            ],
        )
        admin_pb2_grpc.add_AdminServiceServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        bind = join_host_port(cfg.admin_host, cfg.admin_port)
        try:
            if cfg.admin_tls_cert:
                # The config sets admin_tls_cert and admin_tls_key together or not at all.
                assert cfg.admin_tls_key is not None
                with open(cfg.admin_tls_key, "rb") as f:
                    key = f.read()
                with open(cfg.admin_tls_cert, "rb") as f:
                    cert = f.read()
                port = server.add_secure_port(bind, grpc.ssl_server_credentials([(key, cert)]))
            else:
                port = server.add_insecure_port(bind)
        except RuntimeError as exc:
            raise RuntimeError(f"admin endpoint cannot bind {bind}: {exc}") from exc
        if port == 0:
            raise RuntimeError(f"admin endpoint cannot bind {bind}")
        self.health_watch.start()  # the first answer already reflects the controller
        server.start()
        self._server = server
        self.address = join_host_port(advertised_host(cfg.admin_host), port)
        if cfg.admin_token is None and not is_loopback(cfg.admin_host):
            logger.warning(
                "admin endpoint on %s has no admin_token: reads (sample data included) are "
                "open, mutations refused",
                self.address,
            )
        return self.address

    def drain(self) -> None:
        """Report NOT_SERVING from now on; RPCs keep being answered until stop()."""
        self.health_watch.drain()

    def stop(self, grace_s: float | None = None) -> None:
        """End watches, refuse new RPCs, let in-flight ones finish within ``grace_s``."""
        if self._server is None:
            return
        self.stopping.set()
        self.health_watch.stop()
        self.health.enter_graceful_shutdown()
        grace = self.config.drain_timeout_s if grace_s is None else grace_s
        self._server.stop(grace).wait()
        self._server = None
