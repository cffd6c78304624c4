"""A storage unit's samples to one checkpoint file and back (no Ray).

The file is a stream of msgpack records: per partition one record of rows
(ids, commit order, lengths, tags), then one record per field with the bytes
of the rows that hold it, gathered a field at a time. The manifest keeps the
file's size and sha256, checked before anything is loaded.
"""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING

import msgpack
import numpy as np

from dataplane_client.errors import CapacityExceeded, CorruptPayload, InvalidBatch
from dataplane_server.core.recovery_messages import DumpedFile
from dataplane_server.core.unit_partition import Column, Partition

if TYPE_CHECKING:
    from dataplane_server.core.unit_store import UnitStore


def dump(store: UnitStore, directory: str, skip: dict[str, list[str]] | None) -> DumpedFile:
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
                have = np.nonzero(col.chunk[slots] >= 0)[0]
                picked = slots[have]
                starts = col.offset[picked]
                uniq, which = np.unique(col.chunk[picked], return_inverse=True)
                values = store.arena.gather(
                    uniq.tolist(), which, starts, starts + col.nbytes[picked]
                )
                put(
                    {
                        "kind": "field",
                        "partition": pid,
                        "field": fname,
                        "schema": list(col.schema[:2]) + [list(col.schema[2])],
                        "rows": have.tolist(),
                        "nbytes": col.nbytes[picked].tolist(),
                        "lengths": col.length[picked].tolist(),
                        "values": values.tobytes(),
                    }
                )
    return DumpedFile(store.index, name, size, digest.hexdigest())


def load(store: UnitStore, directory: str, dumped: DumpedFile) -> int:
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
            part = store.partitions[pid] = Partition()
            ids_of[pid] = rec["ids"]
            slots = part.slots_for(rec["ids"])
            part.grow_meta()
            part.seq[slots] = rec["seq"]
            part.seq_len[slots] = rec["seq_len"]
            part.tags.update((int(s), t) for s, t in zip(slots, rec["tags"]) if t)
            loaded += len(slots)
        else:
            _load_field(store, store.partitions[pid], ids_of[pid], rec)
    return loaded


def _load_field(store: UnitStore, part: Partition, ids: list[str], rec: dict) -> None:
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
    col = part.columns[rec["field"]] = Column(schema)
    col.ensure(part.next_slot)
    col.chunk[slots] = block
    col.offset[slots] = offset + np.cumsum(nbytes) - nbytes  # rows back to back
    col.nbytes[slots] = nbytes
    col.length[slots] = rec["lengths"]
    arena.hold(block, len(slots))
    arena.release([block])  # the allocation's own reference


def _records(data: bytes):
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=len(data) + 1)
    unpacker.feed(data)
    yield from unpacker
