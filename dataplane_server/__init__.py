"""The data-plane service: controller, storage units, admin endpoint, launch.

``start`` and friends are imported on first use, so the admin CLI (which only
speaks gRPC) starts without importing torch or Ray.
"""

__all__ = ["ServiceHandle", "ensure_local_ray", "start"]


def __getattr__(name: str):
    if name in __all__:
        from dataplane_server import service

        return getattr(service, name)
    raise AttributeError(f"module 'dataplane_server' has no attribute {name!r}")
