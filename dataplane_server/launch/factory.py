"""build_data_plane_client: a client from a NeMo-RL-style data-plane config mapping.

A NeMo-RL user switches backends by changing ``impl`` and nothing else::

    data_plane:
      enabled: true
      impl: transfer_queue      # or "ray" (the same: our Ray service), or "in_process"
      num_storage_units: 0      # 0 = one unit per alive node (the default)
      storage_capacity: 16GiB   # total over the units, split evenly
      name: dataplane           # the service's name and Ray namespace
      namespace: dataplane
      address: null             # a Ray address to join when Ray is not running here
      service: {}               # any other DataPlaneConfig setting, e.g. admin_enabled

The driver (``bootstrap=True``) connects to the named service, starting it when
it is not running; workers (``bootstrap=False``) only connect.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from dataplane_client.client import connect
from dataplane_client.interface import DataPlaneService
from dataplane_client.wire.config import DataPlaneConfig, parse_byte_size
from dataplane_client.wire.errors import ConfigError, ServiceUnavailable
from dataplane_server.core.inprocess import InProcessDataPlaneClient

RAY_IMPLS = ("transfer_queue", "ray")
IN_PROCESS = "in_process"
KEYS = frozenset(
    {
        "enabled",
        "impl",
        "num_storage_units",
        "storage_capacity",
        "name",
        "namespace",
        "address",
        "service",
    }
)

# name -> the service a driver of this process started.
_started: dict[str, Any] = {}
# name -> the process's in-process store, so a driver and its same-process workers share it.
_in_process: dict[str, InProcessDataPlaneClient] = {}
_in_process_lock = threading.Lock()


def _checked(cfg: Any) -> dict[str, Any]:
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"data-plane config must be a mapping, got {type(cfg).__name__}")
    unknown = sorted(set(cfg) - KEYS)
    if unknown:
        raise ConfigError(f"unknown data-plane config keys {unknown}; known: {sorted(KEYS)}")
    if cfg.get("enabled") is not True:
        raise ConfigError(
            f"data_plane.enabled is {cfg.get('enabled')!r}: set it to true to build a client"
        )
    impl = cfg.get("impl")
    if impl not in (*RAY_IMPLS, IN_PROCESS):
        raise ConfigError(
            f"data_plane.impl {impl!r} is not one of {[*RAY_IMPLS, IN_PROCESS]}",
        )
    return dict(cfg)


def service_config(cfg: Mapping[str, Any]) -> DataPlaneConfig:
    """The DataPlaneConfig a NeMo-RL-style mapping describes."""
    raw = dict(cfg.get("service") or {})
    for key in ("name", "namespace", "num_storage_units"):
        if cfg.get(key) is not None:
            raw[key] = cfg[key]
    if cfg.get("storage_capacity") is not None:
        units = raw.get("num_storage_units", DataPlaneConfig().num_storage_units)
        units = units or _alive_nodes()  # 0: one unit per alive node
        try:
            total = parse_byte_size(cfg["storage_capacity"])
        except ValueError as e:
            raise ConfigError(f"data_plane.storage_capacity: {e}") from None
        raw["unit_capacity_bytes"] = max(int(total) // int(units), 1)
    return DataPlaneConfig.from_dict(raw)


def _alive_nodes() -> int:
    """How many units ``num_storage_units: 0`` starts: one per alive node (1 while this
    process has no Ray yet: the embedded default is a single local node)."""
    import ray

    if not ray.is_initialized():
        return 1
    return max(1, sum(1 for n in ray.nodes() if n.get("Alive")))


def build_data_plane_client(cfg: Mapping[str, Any], bootstrap: bool = True) -> DataPlaneService:
    """Our client for a NeMo-RL ``data_plane`` config (see the module docstring for the keys).

    ``enabled`` not true, an unknown ``impl`` or an unknown key -> ValueError
    (ConfigError) naming it. ``bootstrap=True`` (the driver) starts the service
    when none of that name runs; ``bootstrap=False`` (a worker) only connects,
    and ServiceUnavailable says when there is nothing to connect to.
    """
    cfg = _checked(cfg)
    config = service_config(cfg)
    if cfg["impl"] == IN_PROCESS:
        if config.replicas > 1:  # one process holds the only copy: a second one guards nothing
            raise ConfigError(
                "replicas: 2 needs the Ray service (impl: transfer_queue); the in-process "
                "client keeps one copy of each sample",
                fields=["replicas"],
            )
        return _in_process_client(config.name, bootstrap)
    try:
        return connect(config.name, config.namespace, address=cfg.get("address"))
    except ServiceUnavailable:
        if not bootstrap:
            raise
    from dataplane_server.launch.service import start

    # Held here: Ray ends an actor once no handle to it is left, so the service lives
    # while this process does (or until shutdown_started).
    handle = _started[config.name] = start(config)
    client = handle.client()
    assert isinstance(client, DataPlaneService)  # a RayDataPlaneClient (typed as the base)
    return client


def shutdown_started(name: str) -> bool:
    """Shut down the service this process's driver started under ``name`` (False: none)."""
    handle = _started.pop(name, None)
    if handle is not None:
        handle.shutdown()
    return handle is not None


def _in_process_client(name: str, bootstrap: bool) -> InProcessDataPlaneClient:
    with _in_process_lock:
        current = _in_process.get(name)
        if current is not None and not current.closed:
            return current
        if not bootstrap:
            raise ServiceUnavailable(
                f"no in-process data plane named {name!r} in this process: the driver "
                "builds it first (bootstrap=True)"
            )
        _in_process[name] = InProcessDataPlaneClient()
        return _in_process[name]
