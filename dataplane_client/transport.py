"""The bulk-data seam: how encoded bytes travel between a client and a unit.

Everything above this module speaks ``EncodedField``; everything below is Ray
actor calls whose numpy buffers Ray moves out-of-band (zero-copy reads from the
same node's object store). A faster same-node path (shared memory) replaces
this class without touching callers.
"""

from __future__ import annotations

from typing import Any

from dataplane_client.codec import EncodedField


class RayTransport:
    """Bytes through Ray actor calls on the storage-unit handles."""

    def __init__(self, unit_handles: list[Any]):
        self.units = list(unit_handles)

    def stage(self, unit: int, partition_id: str, write_id: str, sample_ids: list[str],
              encoded: dict[str, EncodedField]):
        """Start copying a write's bytes into a unit; returns an awaitable ObjectRef."""
        return self.units[unit].stage.remote(partition_id, write_id, sample_ids, encoded)

    def read(self, unit: int, partition_id: str, sample_ids: list[str], fields: list[str]):
        """Start a read of some samples' fields; the ObjectRef resolves to encoded fields."""
        return self.units[unit].read.remote(partition_id, sample_ids, fields)

    def discard(self, unit: int, write_id: str):
        return self.units[unit].discard.remote(write_id)
