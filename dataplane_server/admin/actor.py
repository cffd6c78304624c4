"""AdminActor: runs the gRPC admin endpoint and the metrics endpoint inside the cluster.

The service launcher creates one next to the controller:

    admin = AdminActor.remote(config)
    addresses = ray.get(admin.start.remote())  # {"admin_address", "metrics_address"}
    ...
    ray.get(admin.drain.remote())  # health -> NOT_SERVING
    ray.get(admin.stop.remote())   # in-flight RPCs finish (drain_timeout_s), then close

It finds the controller by name, like any client, so it can be restarted on its own.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import ray

from dataplane_client.wire.config import DataPlaneConfig

if TYPE_CHECKING:
    from dataplane_server.admin.metrics import MetricsServer
    from dataplane_server.admin.server import AdminServer


@ray.remote(num_cpus=0)
class AdminActor:
    def __init__(self, config: DataPlaneConfig):
        self.config = config
        self._admin: AdminServer | None = None
        self._metrics: MetricsServer | None = None

    def start(self) -> dict:
        from dataplane_server.admin.metrics import MetricsServer
        from dataplane_server.admin.server import AdminServer
        from dataplane_server.admin.sources import ActorSources

        cfg = self.config
        sources = ActorSources(cfg.name, cfg.namespace)
        admin_address = metrics_address = None
        if cfg.admin_enabled and self._admin is None:
            self._admin = AdminServer(cfg, sources)
            self._admin.start()
            # Clears and deletes go through a data-plane client, whose first making imports
            # torch (seconds on a loaded machine); made now, beside serving, the first such
            # RPC does not pay it inside its deadline. The controller and units never do.
            threading.Thread(target=sources.client, name="admin-client", daemon=True).start()
        if cfg.metrics_enabled and self._metrics is None:
            self._metrics = MetricsServer(
                sources,
                cfg.metrics_host,
                cfg.metrics_port,
                durability=(cfg.durability, cfg.state_dir or ""),
            )
            self._metrics.start()
        if self._admin is not None:
            admin_address = self._admin.address
        if self._metrics is not None:
            metrics_address = self._metrics.address
        return {"admin_address": admin_address, "metrics_address": metrics_address}

    def drain(self) -> None:
        if self._admin is not None:
            self._admin.drain()

    def stop(self) -> None:
        if self._admin is not None:
            self._admin.stop()
            self._admin = None
        if self._metrics is not None:
            self._metrics.stop()
            self._metrics = None
