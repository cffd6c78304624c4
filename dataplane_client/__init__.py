"""Client side of the data plane: data model, wire format, client."""

from dataplane_client.client import DataPlaneClient, connect
from dataplane_client.config import DataPlaneConfig
from dataplane_client.meta import KVBatchMeta

__all__ = ["DataPlaneClient", "DataPlaneConfig", "KVBatchMeta", "connect"]
