"""The one way this project starts its embedded Ray: a new local instance on loopback.

Used by ``start()``, ``dataplane serve``, the demo, the benchmarks and the tests,
so they all bind to 127.0.0.1 and never attach to another Ray on the machine.
"""

from __future__ import annotations

import os

import ray

# Ray binds to the machine's external address unless this is 0 when it starts.
_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def init_local_ray(
    num_cpus: int | None = None,
    *,
    namespace: str | None = None,
    object_store_memory: int | None = None,
    log_to_driver: bool = False,
) -> None:
    """Start a fresh single-node Ray bound to 127.0.0.1 (no-op if Ray is already up here).

    ``num_cpus`` is explicit because every actor holds logical CPUs even when idle;
    the default leaves room for the controller, units and a few workers.
    """
    if ray.is_initialized():
        return
    os.environ[_LOOPBACK_ENV] = "0"
    ray.init(
        address="local",  # always a new instance, never whatever `ray start` ran last here
        num_cpus=num_cpus or max(8, os.cpu_count() or 1),
        namespace=namespace,
        object_store_memory=object_store_memory,
        include_dashboard=False,
        log_to_driver=log_to_driver,
        _node_ip_address="127.0.0.1",
    )
