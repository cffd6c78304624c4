"""Opt-in retention of emptied partitions: which ones to delete, and when.

A partition whose last sample was cleared is remembered with the time it
emptied; one written to again is forgotten. ``victims`` names those beyond the
newest ``keep_n`` or emptied ``keep_s`` seconds ago (both None: keep all).
"""

from __future__ import annotations

import time

from dataplane_server.core.keyspace import KeySpace


class EmptiedPartitions:
    def __init__(self, keep_n: int | None, keep_s: float | None):
        self.keep_n, self.keep_s = keep_n, keep_s
        self._since: dict[str, float] = {}  # partition -> when it emptied, oldest first

    @property
    def enabled(self) -> bool:
        return self.keep_n is not None or self.keep_s is not None

    def emptied(self, partition_id: str) -> None:
        self._since[partition_id] = time.monotonic()

    def forget(self, partition_id: str) -> None:
        self._since.pop(partition_id, None)

    def victims(self, keys: KeySpace) -> list[str]:
        """Partitions to delete now. Still remembered until deleted (``forget``), so a caller
        racing another one waits for that deletion instead of seeing nothing to do."""
        if not self.enabled:
            return []
        for pid in list(self._since):  # written to again since: not empty any more
            part = keys.partitions.get(pid)
            if part is None or part.num_samples:
                del self._since[pid]
        emptied = list(self._since.items())
        extra = max(len(emptied) - self.keep_n, 0) if self.keep_n is not None else 0
        out = [pid for pid, _ in emptied[:extra]]
        if self.keep_s is not None:
            now = time.monotonic()
            out += [pid for pid, since in emptied if now - since >= self.keep_s]
        return list(dict.fromkeys(out))
