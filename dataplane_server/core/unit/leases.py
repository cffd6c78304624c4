"""Who besides a unit's rows may touch its blocks: readers' and writers' leases (no Ray).

- A **read lease** names the chunks a same-node reader was told to map. Its
  copy-on-write mappings would see later writes to pages they have not touched,
  so a leased chunk is never recycled; the lease ends when the reader releases
  it or its process dies.
- A **write lease** is a region set aside for one writer's next same-node put
  (``WriteLease`` on the wire): the writer copies into it before it says so. It
  ends when that put stages into it, at its deadline, when the unit needs the
  room, or when its writer dies; one a live writer may still be copying into
  taints its block (never recycled).

Owners are opaque, hashable tokens of the process holding a lease (the actor
shell passes Ray object refs); only the shell can tell whether one died.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

import numpy as np

from dataplane_server.core.stats import Stats
from dataplane_server.core.unit.arena import Arena


@dataclass
class LeasedRegion:
    """A region set aside for one writer's next same-node put."""

    block: int
    offset: int
    nbytes: int
    deadline: float  # time.monotonic() after which it is reclaimed
    owner: Hashable | None  # the writer's process: its death reclaims the lease


class Leases:
    def __init__(self, arena: Arena, release: Callable[[list[np.ndarray]], None], stats: Stats):
        self.arena = arena
        self._release = release  # the unit's: drops block references and wakes waiting writes
        self.stats = stats
        # Read leases: id -> (block ids a same-node reader was told to map, its owner).
        self.reads: dict[int, tuple[list[int], Hashable | None]] = {}
        self.writes: dict[int, LeasedRegion] = {}
        self.next_id = 0  # read and write leases share one numbering

    # ---- read leases ----------------------------------------------------------------
    def lend_reads(self, blocks: list[int], owner: Hashable | None) -> int:
        """Lease ``blocks`` to a reader under the id ``next_id`` (what its answer named)."""
        lease = self.next_id
        self.next_id += 1
        self.arena.lease(blocks)
        self.reads[lease] = (blocks, owner)
        return lease

    def release_reads(self, leases: Iterable[int]) -> None:
        """A reader's mappings of these leases' chunks are gone: they may be recycled."""
        for lease in leases:
            held = self.reads.pop(lease, None)
            if held is not None:
                self.arena.unlease(held[0])

    # ---- write leases ---------------------------------------------------------------
    def lend_region(
        self, block: int, offset: int, nbytes: int, deadline: float, owner: Hashable | None
    ) -> int:
        lease = self.next_id
        self.next_id += 1
        self.writes[lease] = LeasedRegion(block, offset, nbytes, deadline, owner)
        return lease

    def take_region(self, lease: int) -> LeasedRegion | None:
        """The region of a lease its writer now stages into (None: it is gone)."""
        return self.writes.pop(lease, None)

    def regions_of(self, owner: Hashable) -> list[int]:
        return [i for i, w in self.writes.items() if w.owner is not None and w.owner == owner]

    def reclaim_regions(self, leases: Iterable[int], writer_alive: bool) -> None:
        """Free leased regions; a writer that may still be copying into one taints its block."""
        for lease in list(leases):
            held = self.writes.pop(lease, None)
            if held is None:
                continue
            if writer_alive:
                self.arena.taint([held.block])
            self.stats.inc("write_leases_reclaimed_total")
            self._release([np.array([held.block])])

    def region_bytes(self) -> int:
        """Bytes of the regions set aside (capacity counts them)."""
        return sum(w.nbytes for w in self.writes.values())

    def region_chunk_bytes(self) -> int:
        """Memory of the chunks behind the regions (kept ready, like the warm reserve)."""
        return sum(self.arena.chunk_bytes(w.block) for w in self.writes.values())

    # ---- expiry and dead owners -----------------------------------------------------
    def reclaim_expired(self, now: float) -> None:
        self.reclaim_regions(
            [i for i, w in self.writes.items() if w.deadline <= now], writer_alive=True
        )

    def owners(self) -> set:
        """Every process that holds a lease (the shell checks which of them died)."""
        readers = {owner for _, owner in self.reads.values() if owner is not None}
        return readers | {w.owner for w in self.writes.values() if w.owner is not None}

    def owners_died(self, dead: set) -> None:
        """Their mappings died with them, and nobody copies into their regions any more."""
        self.reclaim_regions(
            [i for i, w in self.writes.items() if w.owner in dead], writer_alive=False
        )
        self.release_reads([i for i, (_, owner) in self.reads.items() if owner in dead])
