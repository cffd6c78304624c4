"""One field of N samples in wire form (:class:`EncodedField`), and row selection on it.

The half of the wire format that never touches a tensor: headers, their checks, and
byte copies of rows. The storage units and the controller use only this half, so their
processes start (and restart) without importing torch, 2-3 s of CPU each here; the
conversions between tensors and this form are :mod:`dataplane_client.codec.fields`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dataplane_client.wire import object_columns, parallel_copy
from dataplane_client.wire.errors import CorruptPayload

if TYPE_CHECKING:
    import torch

DENSE, JAGGED, OBJECT = "dense", "jagged", "object"
KINDS = (DENSE, JAGGED, OBJECT)

# Every dtype a training loop stores, by wire name, and its bytes per element (the
# codec maps the names to torch dtypes; a test holds the two tables to one key set).
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float64": 8,
    "bfloat16": 2,
    "float16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}

# Hard bounds no real batch reaches; a header past them is corrupt (or hostile),
# and checking them first keeps every later size computation small and exact.
MAX_ROWS = 2**31
MAX_ROW_UNIT_BYTES = 2**40
_INT64_MAX = 2**63 - 1


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


@dataclass
class EncodedField:
    """One field of N samples in wire form."""

    kind: str
    dtype: str | None = None  # DTYPE_SIZES key; None for object fields (their bytes are msgpack)
    shape: tuple[int, ...] = ()  # trailing shape of one row (after the jagged dim for jagged)
    values: np.ndarray | None = None  # uint8, dense/jagged
    lengths: np.ndarray | None = None  # int64[N]: jagged rows' first dim / object rows' bytes
    num_rows: int = 0
    # A string column not yet written anywhere: its bytes are produced where they land
    # (take_rows(out=...)), or on the first require_values().
    strings: object_columns.StringRows | None = None
    # A CUDA tensor's bytes (flat uint8, on its device) not yet copied anywhere: copied
    # straight to where they land (devices.copy_rows_to_host), or on the first
    # require_values() (a plain .cpu()).
    device_values: torch.Tensor | None = None

    def require_values(self) -> np.ndarray:
        """``values``; CorruptPayload if absent (only a header-only field lacks its bytes)."""
        if self.values is None and self.strings is not None:
            self.values = np.empty(int(self.require_lengths().sum()), dtype=np.uint8)
            self.strings.write(np.arange(self.num_rows), self.values)
            self.strings = None
        if self.values is None and self.device_values is not None:
            self.values = self.device_values.cpu().numpy()
            self.device_values = None
        if self.values is None:
            raise CorruptPayload(f"this {self.kind} field is a header without its bytes")
        return self.values

    def require_lengths(self) -> np.ndarray:
        """``lengths`` of a jagged or object field; CorruptPayload if absent."""
        if self.lengths is None:
            raise CorruptPayload(f"this {self.kind} field has no row lengths")
        return self.lengths

    @property
    def schema(self) -> tuple[str, str | None, tuple[int, ...]]:
        """What must agree between writes of the same field."""
        return (self.kind, self.dtype, tuple(self.shape))

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype] if self.dtype else 1

    @property
    def row_unit_bytes(self) -> int:
        """Bytes per unit of the first dim (dense: per row; jagged: per token)."""
        return self.itemsize * math.prod(self.shape)

    def row_nbytes(self) -> np.ndarray:
        """Byte size of each row, int64[N]."""
        if self.kind == DENSE:
            return np.full(self.num_rows, self.row_unit_bytes, dtype=np.int64)
        return self.require_lengths().astype(np.int64) * self.row_unit_bytes

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes) if self.values is not None else self.expected_nbytes()

    def expected_nbytes(self) -> int:
        """Bulk bytes the header describes."""
        if self.kind == DENSE:
            return self.num_rows * self.row_unit_bytes
        return int(self.require_lengths().sum()) * self.row_unit_bytes

    def validate(self, name: str, *, header_only: bool = False) -> None:
        """Check the header against hard bounds, then the bytes against the header.

        Raises CorruptPayload naming the field. Every check runs on Python
        integers before anything is allocated from the header's numbers, so a
        hostile header (a 1T x 1T shape, lengths that sum past int64) is
        refused rather than believed.
        """

        def corrupt(why: str) -> CorruptPayload:
            return CorruptPayload(why, fields=[name])

        if not isinstance(self.kind, str) or self.kind not in KINDS:
            raise corrupt(f"unknown field kind {self.kind!r}")
        if self.kind == OBJECT and (self.dtype is not None or self.shape):
            raise corrupt("object fields carry msgpack bytes: no dtype or shape")
        if self.kind != OBJECT and (
            not isinstance(self.dtype, str) or self.dtype not in DTYPE_SIZES
        ):
            raise corrupt(f"unknown dtype {self.dtype!r}")
        # Each dimension bounded too: a zero elsewhere would hide a huge one from the product.
        if not isinstance(self.shape, tuple) or not all(
            _is_int(d) and 0 <= d <= MAX_ROW_UNIT_BYTES for d in self.shape
        ):
            raise corrupt(f"shape must be ints in [0, {MAX_ROW_UNIT_BYTES}], got {self.shape!r}")
        if self.row_unit_bytes > MAX_ROW_UNIT_BYTES:
            raise corrupt(f"shape {self.shape} of {self.dtype} is past {MAX_ROW_UNIT_BYTES} bytes")
        if not _is_int(self.num_rows) or not 0 <= self.num_rows <= MAX_ROWS:
            raise corrupt(f"row count {self.num_rows!r} is not in [0, {MAX_ROWS}]")
        if self.kind != DENSE:
            lengths = self.lengths
            if (
                not isinstance(lengths, np.ndarray)
                or lengths.dtype.kind not in "iu"
                or lengths.shape != (self.num_rows,)
            ):
                raise corrupt("row lengths missing, mis-sized or not integers")
            if self.num_rows and int(lengths.min()) < 0:
                raise corrupt("negative row length")
            # A sum of num_rows values below this bound cannot leave int64.
            if self.num_rows and int(lengths.max()) > _INT64_MAX // self.num_rows:
                raise corrupt("row lengths sum past int64")
        expected = self.expected_nbytes()
        if expected > _INT64_MAX:
            raise corrupt(f"header describes {expected} bytes, past int64")
        if header_only:
            return
        if not isinstance(self.values, np.ndarray) or self.values.dtype != np.uint8:
            raise corrupt("values must be a uint8 array")
        if self.values.nbytes != expected:
            raise corrupt(f"values hold {self.values.nbytes} bytes, header says {expected}")


# ---------------------------------------------------------------------------
# row selection and concatenation on encoded fields (used by client and units)


def row_byte_offsets(enc: EncodedField) -> np.ndarray:
    """int64[N+1] byte offsets of each row in ``values``."""
    offs = np.zeros(enc.num_rows + 1, dtype=np.int64)
    np.cumsum(enc.row_nbytes(), out=offs[1:])
    return offs


def run_bounds(
    starts: np.ndarray, ends: np.ndarray, which: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Indices (first, last) of the maximal runs of byte ranges [starts[i], ends[i]):
    a run goes on while a range starts where the one before it ended and, given
    ``which`` (each range's source), comes from the same source.

    Vectorised: the Python-level work is per run, not per row. Correct for any
    number of sources (nothing is packed into the offsets' bits).
    """
    if len(starts) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    goes_on = starts[1:] == ends[:-1]
    if which is not None:
        goes_on &= which[1:] == which[:-1]
    breaks = np.flatnonzero(~goes_on) + 1
    first = np.concatenate(([0], breaks))
    last = np.concatenate((breaks - 1, [len(starts) - 1]))
    return first, last


def contiguous_runs(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge byte ranges [starts[i], ends[i]) that abut into maximal runs.

    Vectorised: the Python-level work is per run, not per row.
    """
    if len(starts) == 0:
        return starts, ends
    breaks = np.nonzero(starts[1:] != ends[:-1])[0] + 1
    run_starts = starts[np.concatenate(([0], breaks))]
    run_ends = ends[np.concatenate((breaks - 1, [len(ends) - 1]))]
    return run_starts, run_ends


def gather_pairs(
    buffers: list[np.ndarray],
    which: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    out: np.ndarray,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """The (destination, source) copies that put byte ranges (from ``buffers[which[i]]``)
    back to back into ``out``: one per run of adjacent ranges of one buffer."""
    if len(starts) == 0:
        return []
    # Merge only inside the same source buffer.
    first, last = run_bounds(starts, ends, which)
    pos, pairs = 0, []
    for w, lo, hi in zip(which[first].tolist(), starts[first].tolist(), ends[last].tolist()):
        n = hi - lo
        pairs.append((out[pos : pos + n], buffers[w][lo:hi]))
        pos += n
    return pairs


def gather_bytes(
    buffers: list[np.ndarray],
    which: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Copy byte ranges (from ``buffers[which[i]]``) back to back into one buffer.

    Adjacent ranges of the same buffer are merged first, so a contiguous
    selection is a single memcpy (split over threads when large).
    """
    if out is None:
        out = np.empty(int((ends - starts).sum()), dtype=np.uint8)
    parallel_copy.copy_pairs(gather_pairs(buffers, which, starts, ends, out))
    return out


def row_copy_pairs(
    enc: EncodedField, rows: np.ndarray, out: np.ndarray
) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """The copies that put ``rows`` of ``enc`` back to back into ``out``, to run together
    with other fields' (``parallel_copy.copy_pairs``); None for a string column, which
    ``take_rows(out=...)`` writes row by row, and for bytes still on a device
    (``devices.copy_rows_to_host`` copies them)."""
    if enc.values is None and (enc.strings is not None or enc.device_values is not None):
        return None
    rows = np.asarray(rows, dtype=np.int64)
    offs = row_byte_offsets(enc)
    which = np.zeros(len(rows), dtype=np.int64)
    return gather_pairs([enc.require_values()], which, offs[rows], offs[rows + 1], out)


def take_rows(
    enc: EncodedField, rows: np.ndarray, *, out: np.ndarray | None = None, header_only: bool = False
) -> EncodedField:
    """The given rows of ``enc`` (in that order) as a new EncodedField.

    A contiguous ascending selection is a zero-copy view; ``out`` makes the rows'
    bytes land in a given buffer instead (one copy, e.g. straight into shared
    memory); ``header_only`` skips the bytes altogether.
    """
    rows = np.asarray(rows, dtype=np.int64)
    offs = row_byte_offsets(enc)
    starts, ends = offs[rows], offs[rows + 1]
    if header_only:
        values = None
    elif enc.values is None and enc.strings is not None:  # written once, straight into place
        values = np.empty(int(ends.sum() - starts.sum()), dtype=np.uint8) if out is None else out
        enc.strings.write(rows, values)
    elif out is None and len(rows) and np.all(rows[1:] == rows[:-1] + 1):
        values = enc.require_values()[int(starts[0]) : int(ends[-1])]
    else:
        values = gather_bytes(
            [enc.require_values()], np.zeros(len(rows), dtype=np.int64), starts, ends, out=out
        )
    return EncodedField(
        kind=enc.kind,
        dtype=enc.dtype,
        shape=enc.shape,
        values=values,
        lengths=None if enc.lengths is None else enc.lengths[rows],
        num_rows=len(rows),
    )
