"""One field decoded from the parts the units returned for it (no Ray here).

A read asks several units for rows; each answers a part: its rows' bytes
(``EncodedField``, come through Ray or inline) or where they lie in its shared-memory
chunks (``SharedRows``). :func:`assemble` joins them in the order the caller asked
for; :func:`assemble_fields` with a ``device`` copies them straight into one buffer on
that device instead (``devices``). Shared by the Ray client's transport and the
in-process client.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from dataplane_client.codec import devices
from dataplane_client.codec.fields import decode_field, tensor_from_bytes
from dataplane_client.wire import shm
from dataplane_client.wire.encoded import (
    DENSE,
    OBJECT,
    EncodedField,
    gather_bytes,
    row_byte_offsets,
    run_bounds,
)
from dataplane_client.wire.messages import ChunkRef, SharedRows


def _sources(
    part: EncodedField | SharedRows,
) -> tuple[list, list, np.ndarray, np.ndarray, np.ndarray]:
    """(sources, leases, which, starts, ends) of a part's rows; a source is an array or a
    unit's chunk, a lease what mappings of that source hold."""
    if isinstance(part, SharedRows):
        leases = [part.lease] * len(part.chunks)
        which, starts, ends = (a.astype(np.int64) for a in (part.which, part.starts, part.ends))
        return list(part.chunks), leases, which, starts, ends  # narrowed on the wire
    offs = row_byte_offsets(part)
    return [part.values], [None], np.zeros(part.num_rows, dtype=np.int64), offs[:-1], offs[1:]


def assemble(
    parts: Sequence[EncodedField | SharedRows],
    order: np.ndarray,
    loans: dict[str, np.ndarray] | None = None,
) -> Any:
    """Decode one field from the units' parts; output row j is concatenated row ``order[j]``.

    Same-node rows that are contiguous in one chunk come back as a view (no copy) of
    this process's kept copy-on-write mapping of the chunk, lent to this get
    (``shm.view_maps``: in a steady state nothing is mapped or faulted in), or of a
    fresh one while another get's views hold it; anything else is gathered once into a
    fresh buffer out of kept read-only mappings (``shm.read_maps``). ``loans``: the
    mappings this get borrowed so far, by chunk name (its fields share them). A chunk
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
    inline = [p for p in parts if isinstance(p, EncodedField)]
    if first.kind == DENSE and first.row_unit_bytes and len(inline) == len(parts):
        # Dense rows that came in the answers (a small read's): one row-wise take.
        width = first.row_unit_bytes
        rows = np.concatenate([p.require_values().reshape(p.num_rows, width) for p in inline])
        out = dataclasses.replace(first, values=rows[order].reshape(-1), num_rows=len(order))
        return decode_field(out, writable=False)
    sources, leases, which, starts, ends = _rows_in_order(parts, order)
    lengths = _lengths_in_order(headers, order)
    # One run: every row is from one source and each starts where the one before ended.
    run_firsts, _ = run_bounds(starts, ends, which)
    if len(run_firsts) == 1 and isinstance(sources[int(which[0])], ChunkRef) and len(order):
        chunk, lease = sources[int(which[0])], leases[int(which[0])]
        start, end = int(starts[0]), int(ends[-1])
        if first.kind == OBJECT:  # decoded into Python values (a copy) while the lease is held
            values = shm.read_maps.region(chunk, start, end - start)
        else:
            values = _lent(chunk, start, end, lease, {} if loans is None else loans)
    else:
        buffers, starts, ends = _spans(
            sources, which, starts, ends, functools.partial(_kept_region, shm.read_maps)
        )
        values = gather_bytes(buffers, which, starts, ends)
    out = dataclasses.replace(first, values=values, lengths=lengths, num_rows=len(order))
    return decode_field(out, writable=False)


def assemble_fields(
    parts: Mapping[str, Sequence[EncodedField | SharedRows]],
    order: np.ndarray,
    device: torch.device | None = None,
) -> dict[str, Any]:
    """Each field of ``parts`` assembled (:func:`assemble`), or with ``device`` on that
    device (:func:`assemble_on`), the copies of every field awaited once."""
    if device is None:
        loans: dict[str, np.ndarray] = {}
        return {name: assemble(p, order, loans) for name, p in parts.items()}
    devices.pin_kept_mappings(device)
    sources: list = []  # every copy's source stays alive until the copies are done
    try:
        return {name: assemble_on(p, order, device, sources) for name, p in parts.items()}
    finally:  # a failed mapping too (the caller reads again): no copy outlives its source
        devices.synchronize(device)


def assemble_on(
    parts: Sequence[EncodedField | SharedRows], order: np.ndarray, device: torch.device, keep: list
) -> Any:
    """One field as :func:`assemble` decodes it, its tensor on ``device``: the rows are
    copied straight from where they are (a unit's chunk, through this process's kept
    mapping of it, pinned on a GPU; bytes that came in an answer) into one new buffer on
    ``device``, issued, not awaited (the caller waits: ``devices.synchronize``).
    ``keep`` receives the copies' sources, to hold until then. Object fields are Python
    values: decoded on the host, as by :func:`assemble`."""
    headers = [p.header if isinstance(p, SharedRows) else p for p in parts]
    if headers[0].kind == OBJECT:
        return assemble(parts, order)
    sources, _, which, starts, ends = _rows_in_order(parts, order)
    buffers, starts, ends = _spans(
        sources, which, starts, ends, functools.partial(_kept_region, shm.write_maps)
    )
    keep.extend([parts, buffers])
    flat = devices.gather_to_device(buffers, which, starts, ends, device)
    lengths = _lengths_in_order(headers, order)
    field = dataclasses.replace(headers[0], values=None, lengths=lengths, num_rows=len(order))
    return tensor_from_bytes(field, flat)


def _rows_in_order(
    parts: Sequence[EncodedField | SharedRows], order: np.ndarray
) -> tuple[list, list, np.ndarray, np.ndarray, np.ndarray]:
    """(sources, leases, which, starts, ends) of every part's rows, rows in output order."""
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
    return (
        sources,
        leases,
        np.concatenate(which)[order],
        np.concatenate(starts)[order],
        np.concatenate(ends)[order],
    )


def _lengths_in_order(headers: list[EncodedField], order: np.ndarray) -> np.ndarray | None:
    if headers[0].kind == DENSE:
        return None
    return np.concatenate([h.lengths for h in headers])[order]


def _spans(
    sources: list,
    which: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    mapper: Callable[[int, ChunkRef, int, int], np.ndarray],
) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """(buffers, starts, ends): each chunk source mapped (``mapper(i, chunk, lo, hi)``) over
    only the span its rows touch, their offsets made relative to that span."""
    buffers = []
    for i, src in enumerate(sources):
        if isinstance(src, ChunkRef):
            mine = which == i
            lo = int(starts[mine].min()) if mine.any() else 0
            hi = int(ends[mine].max()) if mine.any() else 0
            buffers.append(mapper(i, src, lo, hi))
            starts = np.where(mine, starts - lo, starts)
            ends = np.where(mine, ends - lo, ends)
        else:
            buffers.append(src)
    return buffers, starts, ends


def _lent(chunk: ChunkRef, start: int, end: int, lease: Any, loans: dict) -> np.ndarray:
    """Bytes [start, end) of ``chunk``, writable copy-on-write: a view of the kept mapping
    this get borrowed (``loans``, by chunk name; borrowed now if not yet), or of a fresh
    mapping when another get's views still hold the kept one. Either holds ``lease``
    until its last view goes."""
    whole = loans.get(chunk.name)
    if whole is None:
        whole = shm.view_maps.lend(chunk, end, lease)
        if whole is None:
            return shm.map_private(chunk, start, end, keep=lease)
        loans[chunk.name] = whole
    return whole[start:end]


def _kept_region(maps: shm.KeptMaps, _i: int, chunk: ChunkRef, lo: int, hi: int) -> np.ndarray:
    """Bytes [lo, hi) of this process's kept mapping of the chunk in ``maps``: read-only for
    a host gather, the writable (pinned) ones where it feeds a GPU. The read's lease is
    held by the caller's parts until the copies are done."""
    if hi <= lo:  # none of the read's rows lie in it: nothing to map
        return np.empty(0, dtype=np.uint8)
    return maps.region(chunk, lo, hi - lo)
