"""One partition's rows inside a storage unit: slots, columns, commit metadata (no Ray).

- ``slot_of``: sample_id -> slot (a unit-local row number), freed slots reused;
- per field one :class:`Column`: for every slot, which block holds its bytes, at
  what offset, how many bytes (and, jagged, its first-dim length);
- per slot what a restarted controller rebuilds its key space from: commit
  order, sequence length, tags.

The bytes themselves live in the unit's arena; a column only points into it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from dataplane_server.core.columns import grown
from dataplane_server.core.recovery_messages import SampleMeta, StoredRows


def _empty() -> np.ndarray:
    return np.zeros(0, dtype=np.int64)


@dataclass
class Column:
    schema: tuple
    chunk: np.ndarray = field(default_factory=_empty)  # block id per slot, -1 = no bytes
    offset: np.ndarray = field(default_factory=_empty)
    nbytes: np.ndarray = field(default_factory=_empty)
    length: np.ndarray = field(default_factory=_empty)
    shared: bool = False  # a group field: cells of one group point at one region

    def ensure(self, n: int) -> None:
        self.chunk = grown(self.chunk, n, -1)
        self.offset = grown(self.offset, n, 0)
        self.nbytes = grown(self.nbytes, n, 0)
        self.length = grown(self.length, n, 0)


@dataclass
class UnitPartition:
    """One partition's samples on a unit: slots, their columns of bytes and what a restarted
    controller rebuilds from (the key space's `keyspace.Partition` is its metadata)."""

    slot_of: dict = field(default_factory=dict)
    free_slots: list = field(default_factory=list)
    next_slot: int = 0
    columns: dict = field(default_factory=dict)
    # Per slot, for a controller that rebuilds from the units: commit order, length, tags.
    seq: np.ndarray = field(default_factory=_empty)
    seq_len: np.ndarray = field(default_factory=_empty)
    tags: dict = field(default_factory=dict)  # slot -> tags
    # Per slot: the commit (its seq) that last published bytes into it, -1 = unknown. A
    # direct read names the generation it means; a mismatch sends it to the controller.
    gen: np.ndarray = field(default_factory=_empty)
    group_slots: dict = field(default_factory=dict)  # group_id -> its members' slots here

    def slots_for(self, sample_ids: list[str]) -> np.ndarray:
        """The slot of each id, new ids given freed slots first (last freed first), then
        fresh ones. Vectorised: Python touches a sample only in C-level dict calls."""
        slots = np.fromiter(
            map(self.slot_of.get, sample_ids, itertools.repeat(-1)),
            dtype=np.int64,
            count=len(sample_ids),
        )
        new = np.flatnonzero(slots < 0)
        if not len(new):
            return slots
        # First appearance order, as the one-by-one rule gives slots; an id twice in one
        # write gets one slot.
        new_ids = list(dict.fromkeys(sample_ids[i] for i in new.tolist()))
        reused = min(len(new_ids), len(self.free_slots))
        taken = self.free_slots[len(self.free_slots) - reused :][::-1]
        del self.free_slots[len(self.free_slots) - reused :]
        fresh = len(new_ids) - reused
        given = np.concatenate(
            [
                np.asarray(taken, dtype=np.int64),
                np.arange(self.next_slot, self.next_slot + fresh, dtype=np.int64),
            ]
        )
        self.next_slot += fresh
        self.slot_of.update(zip(new_ids, given.tolist()))
        if len(new_ids) == len(new):
            slots[new] = given
        else:
            slots[new] = [self.slot_of[sample_ids[i]] for i in new.tolist()]
        return slots

    def column(self, name: str, schema: tuple) -> Column:
        """The field's column, made on its first write, sized for every slot."""
        col = self.columns.get(name)
        if col is None:
            col = self.columns[name] = Column(schema)
        col.ensure(self.next_slot)
        return col

    def grow_meta(self) -> None:
        self.seq = grown(self.seq, self.next_slot, -1)
        self.seq_len = grown(self.seq_len, self.next_slot, -1)
        self.gen = grown(self.gen, self.next_slot, -1)

    def remember(self, slots: np.ndarray, sample_ids: list[str], meta: SampleMeta) -> None:
        """Record what the key space knows of new slots (first commit wins, tags merge)."""
        self.grow_meta()
        self.seq[slots[self.seq[slots] < 0]] = meta.seq
        if meta.sequence_lengths:
            lengths = np.fromiter(
                map(meta.sequence_lengths.get, sample_ids, itertools.repeat(-1)),
                dtype=np.int64,
                count=len(sample_ids),
            )
            unset = (lengths >= 0) & (self.seq_len[slots] < 0)
            self.seq_len[slots[unset]] = lengths[unset]
        if meta.tags:
            for slot, sid in zip(slots.tolist(), sample_ids):
                tag = meta.tags.get(sid)
                if tag:
                    self.tags[slot] = {**self.tags.get(slot, {}), **tag}
                    self.index_group(slot)

    def index_group(self, slot: int) -> None:
        """Count the slot among its group's members (group fields find stored values so)."""
        group = self.tags[slot].get("group_id")
        if group is not None:
            self.group_slots.setdefault(group, set()).add(slot)

    def stamp(self, slots: np.ndarray, generation: int) -> None:
        """These slots' bytes were just published by the commit ``generation``."""
        self.grow_meta()
        self.gen[slots] = generation

    def holds(self, sample_ids: list[str], generations: list[int]) -> bool:
        """Every sample is here, at the generation given (what a direct read checks)."""
        slots = np.fromiter(
            map(self.slot_of.get, sample_ids, itertools.repeat(-1)),
            dtype=np.int64,
            count=len(sample_ids),
        )
        if (slots < 0).any():
            return False
        self.grow_meta()
        return bool((self.gen[slots] == np.asarray(generations, dtype=np.int64)).all())

    def forget_slots(self, slots: np.ndarray) -> None:
        self.grow_meta()
        self.seq[slots] = -1
        self.gen[slots] = -1
        self.seq_len[slots] = -1
        for slot in slots.tolist():
            group = (self.tags.pop(slot, None) or {}).get("group_id")
            members = self.group_slots.get(group)
            if members is not None:
                members.discard(slot)
                if not members:
                    del self.group_slots[group]

    def drop(self, sample_ids: list[str] | None) -> tuple[int, list[np.ndarray]]:
        """Forget samples (None: every slot, for a partition being deleted). Returns the
        bytes of data dropped and the block ids they held (one reference per row)."""
        if sample_ids is None:
            slots = np.arange(self.next_slot)
        else:
            slots = np.array(
                [self.slot_of.pop(s) for s in sample_ids if s in self.slot_of], dtype=np.int64
            )
            self.free_slots.extend(slots.tolist())
            self.forget_slots(slots)
        dropped, held = 0, []
        for col in self.columns.values():
            col.ensure(self.next_slot)
            blocks = col.chunk[slots]
            if col.shared:  # a group's value is dropped with its last member only
                before = col_bytes = distinct_bytes(col, np.arange(self.next_slot))
            else:
                col_bytes = int(col.nbytes[slots][blocks >= 0].sum())
            held.append(blocks.copy())
            col.chunk[slots] = -1
            if col.shared:
                col_bytes = before - distinct_bytes(col, np.arange(self.next_slot))
            dropped += col_bytes
        return dropped, held

    def empty_cells(
        self, name: str, sample_ids: list[str], block: int | np.ndarray, offsets: np.ndarray
    ) -> tuple[int, np.ndarray]:
        """Empty the cells of field ``name`` of these samples that still point at the
        bytes at ``(block, offsets[i])`` (a region is handed out once, so only the write
        that placed them there matches; ``block`` may be one per sample, where a group
        field's cells point at a value stored before). Returns the bytes dropped and the
        block id per emptied cell (one reference each)."""
        col = self.columns.get(name)
        if col is None:
            return 0, _empty()
        col.ensure(self.next_slot)
        slots = np.fromiter(
            map(self.slot_of.get, sample_ids, itertools.repeat(-1)),
            dtype=np.int64,
            count=len(sample_ids),
        )
        known = slots >= 0
        blocks = np.broadcast_to(np.asarray(block, dtype=np.int64), slots.shape)
        hit = slots[known][
            (col.chunk[slots[known]] == blocks[known])
            & (col.offset[slots[known]] == offsets[known])
        ]
        before = distinct_bytes(col, np.arange(self.next_slot)) if col.shared else 0
        dropped = int(col.nbytes[hit].sum())
        emptied = col.chunk[hit].copy()
        col.chunk[hit] = -1
        if col.shared:
            dropped = before - distinct_bytes(col, np.arange(self.next_slot))
        return dropped, emptied

    def forget_if_empty(self, sample_ids: list[str], names: list[str]) -> None:
        """Forget those of these samples that hold no bytes in any field, and those of the
        named columns that hold none for any sample (a column's schema goes with it)."""
        ids = [s for s in dict.fromkeys(sample_ids) if s in self.slot_of]
        slots = np.fromiter(map(self.slot_of.__getitem__, ids), dtype=np.int64, count=len(ids))
        held = np.zeros(len(slots), dtype=bool)
        for col in self.columns.values():
            col.ensure(self.next_slot)
            held |= col.chunk[slots] >= 0
        for sid in itertools.compress(ids, (~held).tolist()):
            del self.slot_of[sid]
        empty = slots[~held]
        self.free_slots.extend(empty.tolist())
        self.forget_slots(empty)
        for name in names:
            col = self.columns.get(name)
            if col is not None and not (col.chunk[: self.next_slot] >= 0).any():
                del self.columns[name]

    def live_bytes(self) -> int:
        """The rows' own bytes of data (not the blocks around them)."""
        every = np.arange(self.next_slot)
        return sum(distinct_bytes(col, every) for col in self.columns.values())

    def stored_rows(self, skip: frozenset[str] = frozenset()) -> StoredRows:
        """Every sample but ``skip``: ids, commit metadata, schemas, produced bits."""
        if skip:
            ids = [s for s in self.slot_of if s not in skip]
            slots = np.fromiter((self.slot_of[s] for s in ids), dtype=np.int64, count=len(ids))
        else:  # a restart's view of every row: no Python step per sample
            ids = list(self.slot_of)
            slots = np.fromiter(self.slot_of.values(), dtype=np.int64, count=len(ids))
        self.grow_meta()
        produced = {}
        for name, col in self.columns.items():
            col.ensure(self.next_slot)
            produced[name] = (col.chunk[slots] >= 0).tolist()
        return StoredRows(
            sample_ids=ids,
            seq=self.seq[slots].tolist(),
            sequence_lengths=self.seq_len[slots].tolist(),
            tags=[self.tags.get(s) for s in slots.tolist()] if self.tags else [None] * len(ids),
            fields={name: col.schema for name, col in self.columns.items()},
            produced=produced,
        )


def distinct_bytes(col: Column, slots: np.ndarray) -> int:
    """Bytes the cells of ``slots`` hold, a region several cells point at counted once."""
    slots = slots[slots < len(col.chunk)]  # a column not grown yet holds nothing there
    live = slots[col.chunk[slots] >= 0]
    if not col.shared:
        return int(col.nbytes[live].sum())
    if not len(live):
        return 0
    _, first = np.unique(np.stack([col.chunk[live], col.offset[live]]), axis=1, return_index=True)
    return int(col.nbytes[live][first].sum())
