"""The one way this project starts its embedded Ray: a new local instance on loopback.

Used by ``start()``, ``dataplane serve``, the demo, the benchmarks and the tests,
so they all bind to 127.0.0.1 and never attach to another Ray on the machine.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import ray

from dataplane_client.transport.loopback import keep_ray_on_loopback


def init_local_ray(
    num_cpus: int | None = None,
    *,
    namespace: str | None = None,
    object_store_memory: int | None = None,
    log_to_driver: bool = False,
    num_gpus: int | None = None,
) -> None:
    """Start a fresh single-node Ray bound to 127.0.0.1 (no-op if Ray is already up here).

    ``num_cpus`` is explicit because every actor holds logical CPUs even when idle;
    the default leaves room for the controller, units and a few workers. ``num_gpus``:
    None lets Ray detect them (``make gpu-check`` says how many, so a GPU worker is never
    left waiting for a GPU Ray did not see).
    """
    if ray.is_initialized():
        return
    keep_ray_on_loopback()
    ray.init(
        address="local",  # always a new instance, never whatever `ray start` ran last here
        num_cpus=num_cpus or max(8, os.cpu_count() or 1),
        namespace=namespace,
        object_store_memory=object_store_memory,
        num_gpus=num_gpus,
        include_dashboard=False,
        log_to_driver=log_to_driver,
        _node_ip_address="127.0.0.1",
    )


def start_local_cluster(nodes: Sequence[Mapping[str, Any]], attempts: int = 3) -> tuple[Any, list]:
    """Several Ray nodes on this machine (``ray.cluster_utils.Cluster``), on loopback.

    ``nodes`` are ``add_node`` arguments, the first the head's. Ray gives a starting
    node 30 s to register, which a loaded machine can miss: the whole cluster is then
    torn down and started again, at most ``attempts`` times. Returns the cluster and
    its nodes in the order given. For tests and benchmarks of multi-node behaviour.
    """
    from ray.cluster_utils import Cluster

    keep_ray_on_loopback()
    for attempt in range(attempts):
        cluster = Cluster()
        try:
            return cluster, [cluster.add_node(**dict(node)) for node in nodes]
        except Exception as e:
            print(
                f"cluster start failed ({e}); attempt {attempt + 1} of {attempts}", file=sys.stderr
            )
            cluster.shutdown()
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")
