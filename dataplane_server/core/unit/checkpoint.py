"""A storage unit's samples to one checkpoint file and back (no Ray).

The file is a stream of msgpack records: per partition one record of rows
(ids, commit order, lengths, tags), then one record per field with the bytes
of the rows that hold it, gathered a field at a time. The manifest keeps the
file's size and sha256, checked before anything is loaded.
"""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING, Protocol

import msgpack
import numpy as np

from dataplane_client.wire.errors import CapacityExceeded, CorruptPayload, InvalidBatch
from dataplane_server.core.recovery_messages import DumpedFile
from dataplane_server.core.unit.partition import Column, UnitPartition

if TYPE_CHECKING:
    from dataplane_server.core.unit.arena import Arena


class StoreParts(Protocol):
    """What a checkpoint reads and fills of a unit's store (``store.UnitStore``, which calls
    this module: named here by what it has, not imported)."""

    index: int
    partitions: dict[str, UnitPartition]
    arena: Arena
    capacity_bytes: int

    @property
    def used_bytes(self) -> int: ...


def dump(store: StoreParts, directory: str, skip: dict[str, list[str]] | None) -> DumpedFile:
    """Write every sample ``store`` holds (but ``skip``: partition -> ids) to one file."""
    name = f"unit-{store.index}.bin"
    digest, size = hashlib.sha256(), 0
    with open(os.path.join(directory, name), "wb") as f:

        def put(record: dict) -> None:
            nonlocal size
            try:
                data = msgpack.packb(record, use_bin_type=True)
            except TypeError as e:
                raise InvalidBatch(
                    f"partition {record['partition']!r} holds tags that cannot be saved ({e})"
                ) from None
            digest.update(data)
            size += len(data)
            f.write(data)

        for pid, part in store.partitions.items():
            rows = part.stored_rows(frozenset((skip or {}).get(pid, ())))
            put(
                {
                    "kind": "rows",
                    "partition": pid,
                    "ids": rows.sample_ids,
                    "seq": rows.seq,
                    "seq_len": rows.sequence_lengths,
                    "tags": rows.tags,
                }
            )
            slots = np.fromiter(
                (part.slot_of[s] for s in rows.sample_ids), dtype=np.int64, count=len(rows.seq)
            )
            for fname, col in part.columns.items():
                col.ensure(part.next_slot)
                have = np.nonzero(col.chunk[slots] >= 0)[0]
                picked, shared_as = _one_per_value(col, slots[have])
                starts = col.offset[picked]
                uniq, which = np.unique(col.chunk[picked], return_inverse=True)
                values = store.arena.gather(
                    uniq.tolist(), which, starts, starts + col.nbytes[picked]
                )
                record = {
                    "kind": "field",
                    "partition": pid,
                    "field": fname,
                    "schema": list(col.schema[:2]) + [list(col.schema[2])],
                    "rows": have.tolist(),
                    "nbytes": col.nbytes[picked].tolist(),
                    "lengths": col.length[picked].tolist(),
                    "values": values.tobytes(),
                }
                if shared_as is not None:  # a group field: each value once, rows name theirs
                    record["value_of_row"] = shared_as.tolist()
                put(record)
    return DumpedFile(store.index, name, size, digest.hexdigest())


def _one_per_value(col: Column, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """The slots whose bytes a field's record holds: every slot's, or for a group field
    (``Column.shared``) one slot per stored value, with each slot's value among them."""
    if not col.shared:
        return slots, None
    _, first, value_of_row = np.unique(
        np.stack([col.chunk[slots], col.offset[slots]]),
        axis=1,
        return_index=True,
        return_inverse=True,
    )
    return slots[first], value_of_row.reshape(-1)


def load(store: StoreParts, directory: str, dumped: DumpedFile) -> int:
    """Store the samples of a file ``dump`` wrote (checked against its digest first).

    ``store`` must hold none of its partitions. Returns the number of samples loaded.
    """
    path = os.path.join(directory, dumped.name)
    with open(path, "rb") as f:
        data = f.read()
    if len(data) != dumped.nbytes or hashlib.sha256(data).hexdigest() != dumped.sha256:
        raise CorruptPayload(f"checkpoint file {path} does not match its manifest")
    loaded = 0
    ids_of: dict[str, list[str]] = {}
    for rec in _records(data):
        pid = rec["partition"]
        if rec["kind"] == "rows":
            if pid in store.partitions:
                raise InvalidBatch(
                    f"unit {store.index} already holds partition {pid!r}: restore into a "
                    "fresh service"
                )
            part = store.partitions[pid] = UnitPartition()
            ids_of[pid] = rec["ids"]
            slots = part.slots_for(rec["ids"])
            part.grow_meta()
            part.seq[slots] = rec["seq"]
            part.seq_len[slots] = rec["seq_len"]
            part.tags.update((int(s), t) for s, t in zip(slots, rec["tags"]) if t)
            for slot in part.tags:
                part.index_group(slot)
            loaded += len(slots)
        else:
            _load_field(store, store.partitions[pid], ids_of[pid], rec)
    return loaded


def _load_field(store: StoreParts, part: UnitPartition, ids: list[str], rec: dict) -> None:
    kind, dtype, shape = rec["schema"]
    schema = (kind, dtype, tuple(shape))
    values = np.frombuffer(rec["values"], dtype=np.uint8)
    arena = store.arena
    if store.used_bytes + arena.extra_bytes([len(values)]) > store.capacity_bytes:
        raise CapacityExceeded(
            f"unit {store.index}: the checkpoint's {len(values)} bytes of field "
            f"{rec['field']!r} do not fit ({store.used_bytes} of {store.capacity_bytes} used)"
        )
    ((block, offset),) = arena.alloc([len(values)])
    arena.write(block, offset, values)
    slots = np.fromiter(
        (part.slot_of[ids[i]] for i in rec["rows"]), dtype=np.int64, count=len(rec["rows"])
    )
    nbytes = np.asarray(rec["nbytes"], dtype=np.int64)
    lengths = np.asarray(rec["lengths"], dtype=np.int64)
    offsets = offset + np.cumsum(nbytes) - nbytes  # values back to back
    value_of_row = rec.get("value_of_row")
    col = part.columns[rec["field"]] = Column(schema, shared=value_of_row is not None)
    if value_of_row is not None:  # a group field: the rows of a group share its one value
        which = np.asarray(value_of_row, dtype=np.int64)
        offsets, nbytes, lengths = offsets[which], nbytes[which], lengths[which]
    col.ensure(part.next_slot)
    col.chunk[slots] = block
    col.offset[slots] = offsets
    col.nbytes[slots] = nbytes
    col.length[slots] = lengths
    arena.hold(block, len(slots))
    arena.release([block])  # the allocation's own reference


def _records(data: bytes):
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=len(data) + 1)
    unpacker.feed(data)
    yield from unpacker
