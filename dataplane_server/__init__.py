"""The data-plane service: controller, storage units, admin endpoint, launch."""

from dataplane_server.service import ServiceHandle, ensure_local_ray, start

__all__ = ["ServiceHandle", "ensure_local_ray", "start"]
