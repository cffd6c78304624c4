"""Keeping a Ray node on 127.0.0.1 when the address says loopback.

Ray replaces a loopback node address with the machine's own
(``ray._private.services.resolve_ip_for_localhost``) unless its
``ENABLE_RAY_CLUSTER`` constant is off. That constant is read from
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` once, when ``ray`` is first imported, so
setting the variable afterwards changes nothing: a Ray started that way had the
machine's address as its node IP and its raylet and workers listened there, and a
process joining ``127.0.0.1:PORT`` looked for the cluster at the machine's address
instead. Both sides call :func:`keep_ray_on_loopback` before ``ray.init``: the side
that starts Ray (``local_ray``) always, the side that joins one (``connect`` and
``dataplane serve --address``) through :func:`join_address` when the address it
joins is loopback.
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


def join_address(address: str) -> str:
    """The address to pass to ``ray.init`` to join ``address``; call just before it.

    ``auto`` is resolved here, as Ray resolves it (``RAY_ADDRESS``, else the cluster
    the last ``ray start`` here recorded, else a GCS running on this machine), and
    raises ``ConnectionError`` when that finds none. Ray would otherwise resolve it
    inside ``ray.init``, too late to tell a loopback cluster. When the address is
    loopback this process's Ray is kept on loopback (:func:`keep_ray_on_loopback`):
    else ``ray.init`` looks for the cluster at the machine's own address, where a
    cluster on 127.0.0.1 does not answer, and retries without end.
    """
    if address == "auto":
        from ray._private.services import get_ray_address_from_environment

        found = get_ray_address_from_environment("auto", None)
        if not found:
            raise ConnectionError("'auto' found no running Ray cluster on this machine")
        address = found
    if is_loopback(address):
        keep_ray_on_loopback()
    return address
