"""What a storage unit remembers of its recent publishes, so that one can be undone by
write id (no Ray).

A commit spanning several units can fail on one unit after another published it; the
controller then asks the others to ``unpublish`` it. Undoing by sample id would drop
every field of those samples, including fields earlier writes made (a write-back of
logprobs onto prompts would take the prompts with it). A unit instead remembers, per
write, which cells the write filled: (block, offset) per row of each field, and whether
the cell held bytes before. Space in a block is handed out once, so a cell still
pointing at that (block, offset) holds this write's bytes and nobody else's.

Only the newest writes are remembered (bounded in writes and in samples): an undo comes
right after its publish, within the commit that made it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

_WRITES_REMEMBERED = 4096
_SAMPLES_REMEMBERED = 1 << 20


@dataclass(frozen=True)
class Cells:
    """Where one field of a write went: its block (or, where a group field's cells
    point at a value stored before, one per row), per row the offset, and per row
    whether the cell was empty before (False: the write replaced earlier bytes)."""

    block: int | np.ndarray
    offsets: np.ndarray
    added: np.ndarray


@dataclass(frozen=True)
class PublishedWrite:
    partition_id: str
    sample_ids: list[str]
    fields: dict[str, Cells]


class PublishedWrites:
    """The newest publishes' cells, by write id."""

    def __init__(
        self, writes: int = _WRITES_REMEMBERED, samples: int = _SAMPLES_REMEMBERED
    ) -> None:
        self._writes, self._samples = writes, samples
        self._held = 0  # samples of the writes remembered
        self._by_id: OrderedDict[str, PublishedWrite] = OrderedDict()

    def add(self, write_id: str, write: PublishedWrite) -> None:
        self.pop(write_id)
        self._by_id[write_id] = write
        self._held += len(write.sample_ids)
        while len(self._by_id) > self._writes or (
            self._held > self._samples and len(self._by_id) > 1
        ):
            self._held -= len(self._by_id.popitem(last=False)[1].sample_ids)

    def pop(self, write_id: str) -> PublishedWrite | None:
        write = self._by_id.pop(write_id, None)
        if write is not None:
            self._held -= len(write.sample_ids)
        return write

    def __len__(self) -> int:
        return len(self._by_id)
