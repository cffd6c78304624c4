"""One stored sample's fields as plain builtins, for the admin endpoint and CLI (no Ray)."""

from __future__ import annotations

import msgpack
import numpy as np

from dataplane_client.wire.encoded import DTYPE_SIZES, JAGGED, OBJECT
from dataplane_server.core.unit.arena import Arena
from dataplane_server.core.unit.partition import UnitPartition

# Every wire dtype name but bfloat16 is also numpy's name for it (first_elements widens
# a bfloat16 itself).
_NUMPY_DTYPES = {name: np.dtype(name) for name in DTYPE_SIZES if name != "bfloat16"}


def first_elements(raw: np.ndarray, dtype: str, count: int) -> list:
    """The first ``count`` elements of a stored row's bytes (floats as float32 values).

    numpy, not torch: the unit never imports torch (a first import would stall its loop
    for seconds). A bfloat16 is the high half of a float32, so it widens exactly.
    """
    if dtype == "bfloat16":
        head = raw[: 2 * count].view(np.uint16)
        return (head.astype(np.uint32) << 16).view(np.float32).tolist()
    numpy_dtype = _NUMPY_DTYPES[dtype]
    head = raw[: numpy_dtype.itemsize * count].view(numpy_dtype)
    return (head.astype(np.float32) if numpy_dtype.kind == "f" else head).tolist()


def preview(
    part: UnitPartition, arena: Arena, slot: int, fields: list[str] | None, max_elems: int
) -> dict:
    """Per field the sample has bytes for: dtype, layout, shape and its first ``max_elems``
    values (``fields`` None: every field of the partition, sorted)."""
    out = {}
    for name in fields or sorted(part.columns):
        col = part.columns.get(name)
        if col is None or slot >= len(col.chunk) or col.chunk[slot] == -1:
            continue
        kind, dtype, shape = col.schema
        start = np.array([col.offset[slot]])
        raw = arena.gather(
            [int(col.chunk[slot])], np.zeros(1, np.int64), start, start + col.nbytes[slot]
        )
        if kind == OBJECT:
            v = msgpack.unpackb(raw.tobytes(), raw=False)
            shown = v if isinstance(v, (int, float, str, bool)) else repr(v)
            out[name] = {
                "dtype": "object",
                "layout": kind,
                "shape": [],
                "values": [shown][:max_elems],
            }
            continue
        rows = int(col.length[slot]) if kind == JAGGED else None
        row_shape = ([rows] if rows is not None else []) + list(shape)
        out[name] = {
            "dtype": dtype,
            "layout": kind,
            "shape": row_shape,
            "values": first_elements(raw, dtype, max_elems),
        }
    return out
