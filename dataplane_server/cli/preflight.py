"""What ``dataplane serve`` checks before it starts anything (Ray, actors, endpoints).

Each failure is a ``CliError``: one line, exit 2 when the configuration is wrong
(a TLS file that cannot be read), 1 when the machine is not as it needs to be (a
port another process holds, a Ray address nothing answers on). Checked here
because the same failures met later came out as 40-60-line tracebacks, some after
Ray had started (and 24 s of retries for an unreachable address).
"""

from __future__ import annotations

import socket

from dataplane_server.cli.exits import EXIT_FAILED, EXIT_USAGE, CliError

# How long a TCP connect to the Ray address may take before it counts as unreachable.
REACH_TIMEOUT_S = 3.0


def check_files(config) -> None:
    """The admin endpoint's TLS files exist and can be read."""
    if not config.admin_enabled:
        return
    for key in ("admin_tls_cert", "admin_tls_key"):
        path = getattr(config, key)
        if path is None:
            continue
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise CliError(
                f"config error: {key}: cannot read {path!r}: {exc}", EXIT_USAGE
            ) from None


def _check_port_free(key: str, host: str, port: int) -> None:
    if port == 0:  # any free port: nothing to collide with
        return
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((host, port))
    except OSError as exc:
        raise CliError(f"{key} {port} on {host} cannot be used: {exc}", EXIT_FAILED) from None


def check_ports(config) -> None:
    """The admin and metrics ports the config names are free (0: any free port)."""
    if config.admin_enabled:
        _check_port_free("admin_port", config.admin_host, config.admin_port)
        if config.metrics_enabled:
            _check_port_free("metrics_port", config.metrics_host, config.metrics_port)


def check_ray_address(address: str) -> None:
    """Something answers on ``host:port`` (``auto`` and ``ray://`` are left to Ray)."""
    if address == "auto" or "://" in address or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        raise CliError(f"Ray address {address!r} is not HOST:PORT", EXIT_USAGE)
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=REACH_TIMEOUT_S):
            pass
    except OSError as exc:
        raise CliError(f"cannot reach a Ray cluster at {address!r}: {exc}", EXIT_FAILED) from None
