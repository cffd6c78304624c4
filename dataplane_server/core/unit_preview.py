"""One stored sample's fields as plain builtins, for the admin endpoint and CLI (no Ray)."""

from __future__ import annotations

import msgpack
import numpy as np

from dataplane_client.encoded import JAGGED, OBJECT
from dataplane_server.core.arena import Arena
from dataplane_server.core.unit_partition import Partition


def preview(
    part: Partition, arena: Arena, slot: int, fields: list[str] | None, max_elems: int
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
        # Imported here: a preview (an operator's look at one sample) is the only unit
        # path that needs a tensor (bfloat16 has no numpy dtype), and the unit starts
        # without torch.
        import torch

        from dataplane_client.codec import DTYPES

        t = torch.from_numpy(raw.copy()).view(DTYPES[dtype])
        rows = int(col.length[slot]) if kind == JAGGED else None
        row_shape = ([rows] if rows is not None else []) + list(shape)
        out[name] = {
            "dtype": dtype,
            "layout": kind,
            "shape": row_shape,
            "values": t.reshape(-1)[:max_elems].float().tolist()
            if t.dtype.is_floating_point
            else t.reshape(-1)[:max_elems].tolist(),
        }
    return out
