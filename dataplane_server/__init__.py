"""The data-plane service: controller, storage units, admin endpoint, launch.

Everything here is imported on first use, so the admin CLI (which only speaks
gRPC) starts without importing torch or Ray.
"""

# name -> the module that defines it
_EXPORTS = {
    "ServiceHandle": "launch.service",
    "ensure_local_ray": "launch.service",
    "start": "launch.service",
    "build_data_plane_client": "launch.factory",
    "shutdown_started": "launch.factory",
    "InProcessDataPlaneClient": "core.inprocess",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dataplane_server' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"dataplane_server.{module}"), name)
