"""Client side of the data plane: data model, wire format, client.

``DataPlaneClient`` is NeMo-RL's abstract client; ``connect`` returns our Ray
implementation of it (:class:`~dataplane_client.client.RayDataPlaneClient`).

The names below load on first use (PEP 562), not when the package does: importing
any ``dataplane_client.<module>`` runs this file first, and an eager
``from dataplane_client.client import ...`` here would load Ray into every process
that only wants the wire vocabulary, e.g. the Ray-free key space
(tests/test_core_imports.py).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dataplane_client.client import RayDataPlaneClient, connect
    from dataplane_client.config import DataPlaneConfig
    from dataplane_client.interface import DataPlaneClient
    from dataplane_client.messages import RolloutGrant, StalenessSpec, TagFilter
    from dataplane_client.meta import KVBatchMeta

# Public name -> the module that defines it.
_LAZY = {
    "RayDataPlaneClient": "dataplane_client.client",
    "connect": "dataplane_client.client",
    "DataPlaneConfig": "dataplane_client.config",
    "DataPlaneClient": "dataplane_client.interface",
    "KVBatchMeta": "dataplane_client.meta",
    "RolloutGrant": "dataplane_client.messages",
    "StalenessSpec": "dataplane_client.messages",
    "TagFilter": "dataplane_client.messages",
}

__all__ = [
    "DataPlaneClient",
    "DataPlaneConfig",
    "KVBatchMeta",
    "RayDataPlaneClient",
    "RolloutGrant",
    "StalenessSpec",
    "TagFilter",
    "connect",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
