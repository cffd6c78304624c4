"""The admin endpoint as the client commands reach it: options, channel, errors.

Only grpc and the generated messages are imported: no Ray, no torch, so a
client command starts fast.
"""

from __future__ import annotations

import argparse
import os
import socket
import ssl

import grpc

from dataplane_server.admin_pb import admin_pb2_grpc
from dataplane_server.cli.argtypes import positive_seconds
from dataplane_server.cli.exits import (
    EXIT_AUTH,
    EXIT_FAILED,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    CliError,
)

ADDRESS_ENV = "DATAPLANE_ADMIN_ADDRESS"
TOKEN_ENV = "DATAPLANE_ADMIN_TOKEN"
DEFAULT_TIMEOUT_S = 5.0


def endpoint_options() -> argparse.ArgumentParser:
    """The options every client command shares (a parent parser)."""
    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("admin endpoint")
    g.add_argument("--address", help=f"HOST:PORT of the admin endpoint (env {ADDRESS_ENV})")
    g.add_argument("--token", help=f"bearer token (env {TOKEN_ENV})")
    g.add_argument("--tls-ca", metavar="FILE", help="PEM CA bundle: connect with TLS")
    g.add_argument("--tls-server-name", help="name to verify in the server certificate")
    g.add_argument(
        "--timeout",
        type=positive_seconds,
        default=None,  # None: the command's own default_timeout, else DEFAULT_TIMEOUT_S
        help="seconds per request (default 5; checkpoint save/restore: 600)",
    )
    g.add_argument("--json", action="store_true", help="print JSON for scripts")
    return common


def partition_command(sub, endpoint_options, name: str, help: str, run) -> argparse.ArgumentParser:
    """The parser of a client command about one partition (its first argument), run by
    ``run(endpoint, args)``; the command adds its own arguments to what this returns."""
    p = sub.add_parser(name, parents=[endpoint_options], help=help)
    p.add_argument("partition")
    p.set_defaults(endpoint_cmd=run)
    return p


class AdminEndpoint:
    """A channel + stub to one admin endpoint, with the token and a short deadline."""

    def __init__(self, args: argparse.Namespace):
        address = args.address or os.environ.get(ADDRESS_ENV)
        if not address:
            raise CliError(
                f"no admin address: pass --address HOST:PORT or set {ADDRESS_ENV}", EXIT_USAGE
            )
        self.address: str = checked_address(address)
        # A command that moves a lot sets default_timeout (set_defaults on its own parser:
        # changing --timeout's default there would change it for every command sharing it).
        self.timeout = (
            args.timeout
            if args.timeout is not None
            else getattr(args, "default_timeout", DEFAULT_TIMEOUT_S)
        )
        self.tls = bool(args.tls_ca)
        token = args.token or os.environ.get(TOKEN_ENV)
        self.metadata = [("authorization", f"Bearer {token}")] if token else []
        if self.tls:
            creds = grpc.ssl_channel_credentials(root_certificates=_read_ca(args.tls_ca))
            options = []
            if args.tls_server_name:
                options.append(("grpc.ssl_target_name_override", args.tls_server_name))
            self.channel = grpc.secure_channel(self.address, creds, options=options)
        else:
            self.channel = grpc.insecure_channel(self.address)
        self.stub = admin_pb2_grpc.AdminServiceStub(self.channel)

    def call(self, method: str, request):
        return getattr(self.stub, method)(request, timeout=self.timeout, metadata=self.metadata)

    def stream(self, method: str, request):
        return getattr(self.stub, method)(request, metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()

    def error(self, exc: grpc.RpcError) -> CliError:
        """What a failed call means for the person at the terminal."""
        code, details = exc.code(), exc.details() or ""
        if code == grpc.StatusCode.UNAVAILABLE:
            return CliError(self._unavailable(details), EXIT_UNREACHABLE)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return CliError(
                f"no answer from the admin endpoint at {self.address} within {self.timeout:g}s",
                EXIT_UNREACHABLE,
            )
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return CliError(
                f"the admin endpoint at {self.address} refused the token (missing or wrong): "
                f"pass --token or set {TOKEN_ENV}",
                EXIT_AUTH,
            )
        if code == grpc.StatusCode.PERMISSION_DENIED:
            return CliError(f"permission denied: {details}", EXIT_AUTH)
        return CliError(f"{code.name}: {details}", EXIT_FAILED)

    def _unavailable(self, details: str) -> str:
        # gRPC reports a TLS mismatch only as a closed socket or a failed handshake;
        # a direct TLS handshake with the same address says which side is wrong.
        tls = speaks_tls(self.address, min(self.timeout, 3.0))
        if tls and not self.tls:
            return (
                f"the admin endpoint at {self.address} speaks TLS and this is a plaintext "
                "connection: pass --tls-ca FILE (the CA bundle that signed its certificate)"
            )
        if tls is False and self.tls:
            return (
                f"the admin endpoint at {self.address} does not speak TLS: drop --tls-ca "
                "(or enable admin_tls_cert / admin_tls_key on the service)"
            )
        if tls and self.tls:
            return (
                f"TLS with the admin endpoint at {self.address} failed: its certificate is "
                "not signed by the --tls-ca bundle or does not name this host "
                f"(see --tls-server-name): {details}"
            )
        return f"cannot reach the admin endpoint at {self.address}: {details}"


def checked_address(address: str) -> str:
    """HOST:PORT with a port gRPC can dial, or a usage error naming what was given
    (gRPC would wrap 99999 to another port, and read a bare name as a DNS lookup)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host.strip("[]"):
        raise CliError(f"admin address {address!r} is not HOST:PORT", EXIT_USAGE)
    if not (port.isdigit() and 0 < int(port) < 65536):
        raise CliError(
            f"admin address {address!r}: the port must be a number from 1 to 65535, got {port!r}",
            EXIT_USAGE,
        )
    return address


def _read_ca(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        # A usage error: the command line names a file that is not there.
        raise CliError(f"cannot read --tls-ca {path}: {exc.strerror}", EXIT_USAGE) from None


def speaks_tls(address: str, timeout_s: float) -> bool | None:
    """Whether a TLS handshake with HOST:PORT succeeds (certificate not checked);
    None when nothing accepts a TCP connection there."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return None
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
    except OSError:
        return None
    context = ssl.create_default_context()
    # Only the protocol is probed here: trust is gRPC's job, with the user's CA.
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with context.wrap_socket(sock, server_hostname=host.strip("[]") or None):
            return True
    except (ssl.SSLError, OSError):
        return False
    finally:
        sock.close()
