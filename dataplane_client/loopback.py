"""Keeping a Ray node on 127.0.0.1 when the address says loopback.

Ray replaces a loopback node address with the machine's own
(``ray._private.services.resolve_ip_for_localhost``) unless its
``ENABLE_RAY_CLUSTER`` constant is off. That constant is read from
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` once, when ``ray`` is first imported, so
setting the variable afterwards changes nothing: a Ray started that way had the
machine's address as its node IP and its raylet and workers listened there, and a
process joining ``127.0.0.1:PORT`` looked for the cluster at the machine's address
instead. Both sides call :func:`keep_ray_on_loopback` before ``ray.init``.
"""

from __future__ import annotations

import os

LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


def is_loopback(address: str) -> bool:
    """Whether a Ray address (``host:port``, or a bare host) names this machine's loopback."""
    host = address.rsplit(":", 1)[0] if address.count(":") == 1 else address
    if address.startswith("[") and "]:" in address:
        host = address.split("]:", 1)[0] + "]"
    return host in LOOPBACK_HOSTS


def keep_ray_on_loopback() -> None:
    """Make this process's Ray keep 127.0.0.1 as the node address (call before ray.init)."""
    os.environ[LOOPBACK_ENV] = "0"  # for the processes Ray starts: they read it on import
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False  # this process already imported it
