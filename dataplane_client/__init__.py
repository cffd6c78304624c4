"""Client side of the data plane: data model, wire format, client.

``DataPlaneClient`` is NeMo-RL's abstract client; ``connect`` returns our Ray
implementation of it (:class:`~dataplane_client.client.RayDataPlaneClient`).

The names below load on first use (PEP 562), not when the package does: importing
any ``dataplane_client.<module>`` runs this file first, and an eager
``from dataplane_client.client import ...`` here would load Ray into every process
that only wants the wire vocabulary, e.g. the Ray-free key space
(tests/core/test_core_imports.py).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dataplane_client.batching.batched_data_dict import BatchedDataDict
    from dataplane_client.batching.materialize import materialize
    from dataplane_client.batching.preshard import shard_meta_for_dp
    from dataplane_client.client import RayDataPlaneClient, connect
    from dataplane_client.interface import DataPlaneClient
    from dataplane_client.wire import errors
    from dataplane_client.wire.config import DataPlaneConfig
    from dataplane_client.wire.messages import RolloutGrant, StalenessSpec, TagFilter
    from dataplane_client.wire.meta import KVBatchMeta

# Public name -> the module that defines it (or, for ``errors``, the package holding it).
_LAZY = {
    "BatchedDataDict": "dataplane_client.batching.batched_data_dict",
    "materialize": "dataplane_client.batching.materialize",
    "shard_meta_for_dp": "dataplane_client.batching.preshard",
    "errors": "dataplane_client.wire",
    "RayDataPlaneClient": "dataplane_client.client",
    "connect": "dataplane_client.client",
    "DataPlaneConfig": "dataplane_client.wire.config",
    "DataPlaneClient": "dataplane_client.interface",
    "KVBatchMeta": "dataplane_client.wire.meta",
    "RolloutGrant": "dataplane_client.wire.messages",
    "StalenessSpec": "dataplane_client.wire.messages",
    "TagFilter": "dataplane_client.wire.messages",
}

__all__ = [
    "BatchedDataDict",
    "DataPlaneClient",
    "DataPlaneConfig",
    "KVBatchMeta",
    "RayDataPlaneClient",
    "RolloutGrant",
    "StalenessSpec",
    "TagFilter",
    "connect",
    "errors",
    "materialize",
    "shard_meta_for_dp",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name, None)
    if value is None:  # a module of the package: the typed errors
        value = importlib.import_module(f"{module}.{name}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
