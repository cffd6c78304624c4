"""Start a data-plane service in the current Ray cluster and hand back a handle.

``start()`` with no Ray running brings up the embedded default: a local Ray on
loopback (``local_ray.init_local_ray``: its node IP and its processes' ports on
127.0.0.1, Ray's GCS port excepted; see deploy/README.md, Security).
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from dataplane_client.client import DataPlaneClient, connect
from dataplane_client.wire.config import DataPlaneConfig
from dataplane_client.wire.errors import ConfigError
from dataplane_server.controller.actor import Controller
from dataplane_server.core.unit import durable_layout
from dataplane_server.launch.local_ray import init_local_ray
from dataplane_server.unit.actor import StorageUnit

# Fixed mmap threshold: large arenas come from mmap and go back to the OS when
# cleared (glibc's sliding threshold would otherwise keep freed arenas on the heap).
_UNIT_ENV = {"MALLOC_MMAP_THRESHOLD_": "1048576"}


def ensure_local_ray(num_cpus: int | None = None) -> None:
    """The embedded default: a local single-node Ray bound to 127.0.0.1."""
    init_local_ray(num_cpus)


def _unit_nodes(count: int) -> list[str | None]:
    """Spread units over alive nodes round-robin (None = let Ray pick); 0 = one per node.

    One unit per node is the default because a same-node reader then finds every
    row in one unit's shared memory and gets it without a copy; two units on one
    node turn every get into a gather of both.
    """
    nodes = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
    if count == 0:
        return list(nodes) or [None]
    return [nodes[i % len(nodes)] for i in range(count)] if nodes else [None] * count


@dataclass
class ServiceHandle:
    config: DataPlaneConfig
    controller: Any
    units: list
    admin: Any = None
    admin_address: str | None = None
    metrics_address: str | None = None
    # The controller's journal directory when ``start`` made it in a temp dir (removed at
    # shutdown); None when the config named one, which outlives the service on purpose.
    owned_state_dir: str | None = None
    _clients: list = field(default_factory=list)

    def client(self) -> DataPlaneClient:
        c = connect(self.config.name, self.config.namespace)
        self._clients.append(c)
        return c

    def drain(self) -> None:
        """Stop taking new work: health goes NOT_SERVING; in-flight calls finish."""
        ray.get(self.controller.set_draining.remote(True))
        if self.admin is not None:
            ray.get(self.admin.drain.remote())

    def shutdown(self) -> None:
        if self.admin is not None:
            try:
                ray.get(self.admin.stop.remote(), timeout=self.config.drain_timeout_s + 10)
            except Exception:  # noqa: BLE001 - best effort: the actor is killed next anyway
                pass
        for actor in [self.admin, self.controller, *self.units]:
            if actor is not None:
                ray.kill(actor, no_restart=True)
        self.admin = None
        self.units = []
        if self.owned_state_dir is not None:
            shutil.rmtree(self.owned_state_dir, ignore_errors=True)
            self.owned_state_dir = None


def unit_name(config: DataPlaneConfig, index: int) -> str:
    """The Ray actor name of a service's storage unit (the controller looks units up by it)."""
    return f"{config.name}-unit-{index}"


def start(config: DataPlaneConfig | dict | None = None) -> ServiceHandle:
    """Start controller, storage units (and the admin endpoint) in the current cluster."""
    if config is None or isinstance(config, dict):
        config = DataPlaneConfig.from_dict(config)
    durable_layout.check(config)  # a typed error before anything starts
    ensure_local_ray()
    units = []
    nodes = _unit_nodes(config.num_storage_units)
    if config.replicas > 1 and len(set(nodes)) < 2:  # both copies on one node survive nothing
        raise ConfigError(
            f"replicas: {config.replicas} needs storage units on at least two nodes; "
            f"{len(nodes)} unit(s) would sit on {len(set(nodes))} node(s) "
            "(add a node, or set replicas: 1)",
            fields=["replicas"],
        )
    for i, node in enumerate(nodes):
        strategy = NodeAffinitySchedulingStrategy(node, soft=False) if node else "DEFAULT"
        units.append(
            # @ray.remote made it an ActorClass; mypy ignores class decorators
            StorageUnit.options(  # type: ignore[attr-defined]
                name=unit_name(config, i),
                namespace=config.namespace,
                num_cpus=config.unit_num_cpus,
                scheduling_strategy=strategy,
                runtime_env={"env_vars": _UNIT_ENV},
                max_concurrency=1000,
                # A durable unit's restart costs nothing: Ray starts it again and it
                # re-attaches its files; a memory unit's restart would only hide a loss.
                max_restarts=-1 if durable_layout.is_durable(config) else 0,
                # ... and calls in flight when it died run again on its new process: each
                # verb is safe to retry there (a publish it logged is a no-op; a stage it
                # lost is refused typed, a read or clear is the same again).
                max_task_retries=-1 if durable_layout.is_durable(config) else 0,
            ).remote(i, config)
        )
    # The controller sits beside whoever started the service, so losing a worker node
    # never takes the key space with it. Ray restarts it after a crash with the same
    # arguments; it rebuilds from the units and its journal on this node's disk, and
    # calls in flight are retried (each verb is safe to retry: see RELIABILITY.md).
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    named_dir = durable_layout.controller_dir(config)
    state_dir = named_dir or tempfile.mkdtemp(prefix=f"dataplane-{config.name}-journal-")
    # @ray.remote made it an ActorClass; mypy ignores class decorators
    controller = Controller.options(  # type: ignore[attr-defined]
        name=config.name,
        namespace=config.namespace,
        num_cpus=config.controller_num_cpus,
        max_concurrency=10_000,
        scheduling_strategy=here,
        max_restarts=config.controller_max_restarts,
        max_task_retries=-1,
    ).remote(config, [unit_name(config, i) for i in range(len(units))], state_dir)
    ray.get(controller.attach_units.remote())
    handle = ServiceHandle(
        config=config,
        controller=controller,
        units=units,
        owned_state_dir=None if named_dir else state_dir,
    )
    if config.admin_enabled:
        _start_admin(handle)
    return handle


def _start_admin(handle: ServiceHandle) -> None:
    try:
        from dataplane_server.admin.actor import AdminActor
    except ImportError:  # the admin package is optional at import time only while it is being built
        return
    # @ray.remote made it an ActorClass; mypy ignores class decorators
    admin = AdminActor.options(  # type: ignore[attr-defined]
        num_cpus=0, namespace=handle.config.namespace, name=f"{handle.config.name}-admin"
    ).remote(handle.config)
    addresses = ray.get(admin.start.remote())
    handle.admin = admin
    handle.admin_address = addresses.get("admin_address")
    handle.metrics_address = addresses.get("metrics_address")
