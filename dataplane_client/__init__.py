"""Client side of the data plane: data model, wire format, client.

``DataPlaneClient`` is NeMo-RL's abstract client; ``connect`` returns our Ray
implementation of it (:class:`~dataplane_client.client.RayDataPlaneClient`).
"""

from dataplane_client.client import RayDataPlaneClient, connect
from dataplane_client.config import DataPlaneConfig
from dataplane_client.interface import DataPlaneClient
from dataplane_client.meta import KVBatchMeta

__all__ = ["DataPlaneClient", "DataPlaneConfig", "KVBatchMeta", "RayDataPlaneClient", "connect"]
