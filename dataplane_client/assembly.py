"""One field decoded from the parts the units returned for it (no Ray here).

A read asks several units for rows; each answers a part: its rows' bytes
(``EncodedField``, come through Ray or inline) or where they lie in its shared-memory
chunks (``SharedRows``). :func:`assemble` joins them in the order the caller asked
for. Shared by the Ray client's transport and the in-process client.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from dataplane_client import shm
from dataplane_client.codec import (
    DENSE,
    OBJECT,
    EncodedField,
    decode_field,
    gather_bytes,
    row_byte_offsets,
    run_bounds,
)
from dataplane_client.messages import ChunkRef, SharedRows


def _sources(
    part: EncodedField | SharedRows,
) -> tuple[list, list, np.ndarray, np.ndarray, np.ndarray]:
    """(sources, leases, which, starts, ends) of a part's rows; a source is an array or a
    unit's chunk, a lease what mappings of that source hold."""
    if isinstance(part, SharedRows):
        leases = [part.lease] * len(part.chunks)
        return list(part.chunks), leases, part.which.astype(np.int64), part.starts, part.ends
    offs = row_byte_offsets(part)
    return [part.values], [None], np.zeros(part.num_rows, dtype=np.int64), offs[:-1], offs[1:]


def assemble(parts: Sequence[EncodedField | SharedRows], order: np.ndarray) -> Any:
    """Decode one field from the units' parts; output row j is concatenated row ``order[j]``.

    Same-node rows that are contiguous in one chunk come back as a copy-on-write
    mapping (no copy); anything else is gathered once into a fresh buffer. A chunk
    freed since the unit named it raises an ``OSError`` (``shm.ChunkChanged`` when
    its descriptor now holds another chunk): the caller reads through Ray instead.
    """
    headers = [p.header if isinstance(p, SharedRows) else p for p in parts]
    first = headers[0]
    identity = bool((order == np.arange(len(order))).all())
    if len(parts) == 1 and identity and isinstance(parts[0], EncodedField):
        # No copy: tensors view this read's own copy in the local object store
        # (read-only to numpy; the client module's docstring says so).
        return decode_field(parts[0], writable=False)
    sources: list = []
    leases: list = []
    which, starts, ends = [], [], []
    for part in parts:
        src, held, w, s, e = _sources(part)
        which.append(w + len(sources))
        starts.append(s)
        ends.append(e)
        sources.extend(src)
        leases.extend(held)
    which = np.concatenate(which)[order]
    starts = np.concatenate(starts)[order]
    ends = np.concatenate(ends)[order]
    lengths = None
    if first.kind != DENSE:
        lengths = np.concatenate([h.lengths for h in headers])[order]
    # One run: every row is from one source and each starts where the one before ended.
    run_firsts, _ = run_bounds(starts, ends, which)
    if len(run_firsts) == 1 and isinstance(sources[int(which[0])], ChunkRef) and len(order):
        first_src = int(which[0])
        # Object rows are read whole (decoded into Python values, a copy): map them
        # read-only with every page faulted in at once, not one fault per page.
        mapper = shm.map_for_read if first.kind == OBJECT else shm.map_private
        values = mapper(sources[first_src], int(starts[0]), int(ends[-1]), keep=leases[first_src])
    else:
        buffers = []
        for i, src in enumerate(sources):
            if isinstance(src, ChunkRef):  # map only the span this read touches
                mine = which == i
                lo = int(starts[mine].min()) if mine.any() else 0
                hi = int(ends[mine].max()) if mine.any() else 0
                buffers.append(shm.map_for_read(src, lo, hi, keep=leases[i]))
                starts = np.where(mine, starts - lo, starts)
                ends = np.where(mine, ends - lo, ends)
            else:
                buffers.append(src)
        values = gather_bytes(buffers, which, starts, ends)
    out = dataclasses.replace(first, values=values, lengths=lengths, num_rows=len(order))
    return decode_field(out, writable=False)
