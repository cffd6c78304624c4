"""Columnar jagged codec: the data plane's wire format.

A batch of N samples becomes, per field, one :class:`EncodedField`:

- ``dense``: one flat byte buffer holding ``[N, *shape]`` of ``dtype``;
- ``jagged``: one flat byte buffer of all rows back to back plus ``lengths``
  (``int64[N]``, each row's first-dim length; every row is ``[len_i, *shape]``);
- ``object``: N small Python values, each msgpack-encoded; stored like a jagged
  uint8 field (``lengths`` = bytes per row), so selecting, splitting and joining
  rows is byte copying and only the final decode touches Python objects. A
  column of strings (``str`` or ``None`` rows) keeps the caller's strings until
  its bytes are written to their destination (``strings``; see
  :mod:`dataplane_client.object_columns`).

Strings of an enum field (a vocabulary declared at registration) travel as a
dense ``int32`` field of codes (:mod:`dataplane_client.enum_codes`). Python
objects travel only in fields declared as object fields; any other non-tensor
value is :class:`NonTensorField` (NeMo-RL's contract: no Python objects on the
bus unless asked for).

Buffers are numpy ``uint8`` arrays so Ray moves them out-of-band (zero-copy on
the same node); headers are plain builtins. Nothing here pickles.
:mod:`dataplane_client.byte_format` turns encoded fields into one
self-describing, checksummed byte string for paths that are not Ray.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dataplane_client import enum_codes, object_columns, parallel_copy
from dataplane_client.errors import (
    CorruptPayload,
    InvalidBatch,
    NonTensorField,
    SchemaConflict,
)
from dataplane_client.tensordict_io import as_field_mapping

DENSE, JAGGED, OBJECT = "dense", "jagged", "object"
KINDS = (DENSE, JAGGED, OBJECT)

# Every dtype a training loop stores. Names are the wire names.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

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
    dtype: str | None = None  # DTYPES key; None for object fields (their bytes are msgpack)
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
        return DTYPES[self.dtype].itemsize if self.dtype else 1

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
        if self.kind != OBJECT and (not isinstance(self.dtype, str) or self.dtype not in DTYPES):
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
# tensors <-> EncodedField


def _device_bytes(t: torch.Tensor) -> torch.Tensor | None:
    """A contiguous CUDA tensor's bytes, flat uint8 on its device (no copy), kept for a copy
    straight to their destination; None for any other tensor (copied to host memory now)."""
    if t.device.type != "cuda" or not t.is_contiguous() or t.numel() == 0:
        return None
    flat = t.detach().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def _bytes_of(t: torch.Tensor) -> dict[str, Any]:
    """``values`` (host bytes) or ``device_values`` (a CUDA tensor's) of an EncodedField."""
    on_device = _device_bytes(t)
    if on_device is not None:
        return {"device_values": on_device}
    return {"values": _as_bytes(t)}


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view of a contiguous CPU tensor (copies only if needed)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.dtype == torch.uint8:
        return t.numpy()
    return t.view(torch.uint8).numpy()


def _dtype_name(t: torch.Tensor, name: str) -> str:
    try:
        return DTYPE_NAMES[t.dtype]
    except KeyError:
        raise InvalidBatch(f"unsupported dtype {t.dtype}", fields=[name]) from None


def _check_storable(t: torch.Tensor, name: str) -> None:
    """Only CPU/CUDA tensors hold bytes we can copy; only dense and nested layouts map to rows."""
    if t.device.type not in ("cpu", "cuda"):
        raise InvalidBatch(
            f"tensor on device {t.device.type!r}: only CPU and CUDA tensors hold data",
            fields=[name],
        )
    if not t.is_nested and t.layout != torch.strided:
        raise InvalidBatch(
            f"{t.layout} tensor: only dense (strided) and jagged nested tensors are stored; "
            "convert it with .to_dense()",
            fields=[name],
        )


def _encode_jagged_list(name: str, rows: list[torch.Tensor]) -> EncodedField:
    first = rows[0]
    for i, r in enumerate(rows):
        _check_storable(r, name)
        if r.ndim < 1:
            raise InvalidBatch(f"jagged row {i} is 0-dim; rows must be >= 1-D", fields=[name])
        if r.dtype != first.dtype or tuple(r.shape[1:]) != tuple(first.shape[1:]):
            raise SchemaConflict(
                f"jagged row {i} has dtype {r.dtype} / inner shape {tuple(r.shape[1:])}, "
                f"row 0 has {first.dtype} / {tuple(first.shape[1:])}",
                fields=[name],
            )
    # Rows all on one device are joined there (a CUDA field then goes to host memory once).
    device = first.device if len({r.device for r in rows}) == 1 else torch.device("cpu")
    values = torch.cat([r.detach().to(device).reshape(r.shape[0], *first.shape[1:]) for r in rows])
    return EncodedField(
        kind=JAGGED,
        dtype=_dtype_name(first, name),
        shape=tuple(int(d) for d in first.shape[1:]),
        **_bytes_of(values),
        lengths=np.array([r.shape[0] for r in rows], dtype=np.int64),
        num_rows=len(rows),
    )


def _encode_tensor(name: str, value: torch.Tensor) -> EncodedField:
    _check_storable(value, name)
    if value.is_nested:
        if value.layout != torch.jagged:
            return _encode_jagged_list(name, list(value.unbind()))
        offsets = value.offsets()  # type: ignore[attr-defined]  # nested-tensor API
        values = value.values()
        start, end = int(offsets[0]), int(offsets[-1])
        return EncodedField(
            kind=JAGGED,
            dtype=_dtype_name(values, name),
            shape=tuple(int(d) for d in values.shape[1:]),
            **_bytes_of(values[start:end]),
            lengths=(offsets[1:] - offsets[:-1]).cpu().numpy().astype(np.int64),
            num_rows=len(offsets) - 1,
        )
    if value.ndim == 0:
        raise InvalidBatch("a dense field needs a leading sample dim [N, ...]", fields=[name])
    return EncodedField(
        kind=DENSE,
        dtype=_dtype_name(value, name),
        shape=tuple(int(d) for d in value.shape[1:]),
        **_bytes_of(value),
        num_rows=int(value.shape[0]),
    )


def _row_values(value: Any) -> list | None:
    """A non-tensor column as a list of per-row values (None when it is not a column)."""
    if isinstance(value, np.ndarray):
        return value.tolist() if value.ndim >= 1 else None
    if isinstance(value, (list, tuple)):
        return list(value)
    return None


def _describe(value: Any) -> str:
    rows = _row_values(value)
    if rows:
        kinds = sorted({type(v).__name__ for v in rows})
        return f"a {type(value).__name__} of {'/'.join(kinds[:3])}"
    return f"a {type(value).__name__}"


def encode_field(
    name: str,
    value: Any,
    *,
    vocabulary: tuple[str, ...] | None = None,
    objects_allowed: bool = False,
) -> EncodedField:
    """Encode one field's value for N samples.

    Tensors (dense ``[N, ...]``, jagged ``torch.nested``, a list of tensors,
    a numeric ndarray) encode as themselves. With a ``vocabulary`` the value is
    a column of strings and travels as int32 codes. Any other value is a
    column of Python objects, accepted only when ``objects_allowed``.
    """
    if vocabulary is not None:
        rows = _row_values(value)
        if rows is None:
            raise InvalidBatch(
                f"an enum field takes a list of str, got {_describe(value)}", fields=[name]
            )
        return _encode_tensor(name, enum_codes.to_codes(name, rows, vocabulary))
    if isinstance(value, torch.Tensor):
        return _encode_tensor(name, value)
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
        return _encode_tensor(name, torch.from_numpy(np.ascontiguousarray(value)))
    rows = _row_values(value)
    # Decided on the set of row types: one C-level pass, not an isinstance call per row.
    tensor_rows = [issubclass(t, torch.Tensor) for t in set(map(type, rows or ()))]
    if rows is not None and tensor_rows and all(tensor_rows):
        return _encode_jagged_list(name, rows)
    if any(tensor_rows):
        raise InvalidBatch("a list mixes tensors and non-tensors", fields=[name])
    if not objects_allowed:
        raise NonTensorField(
            f"field {name!r} holds a non-tensor value ({_describe(value)}): give a tensor, "
            "or declare the field in enums (strings) or object_fields (msgpack values)",
            fields=[name],
        )
    if rows is None:
        raise InvalidBatch(
            f"unsupported field type {type(value).__name__}: use a tensor [N, ...], a jagged "
            "torch.nested tensor or list of tensors, or a list of msgpack-able values",
            fields=[name],
        )
    strings = object_columns.string_rows(name, rows)
    if strings is not None:
        return EncodedField(
            kind=OBJECT, lengths=strings.row_nbytes, num_rows=len(rows), strings=strings
        )
    values, lengths = object_columns.encode_rows(name, rows)
    return EncodedField(kind=OBJECT, values=values, lengths=lengths, num_rows=len(rows))


def encode_fields(
    fields: Any,
    num_rows: int | None = None,
    *,
    enums: Mapping[str, Any] | None = None,
    object_fields: Collection[str] = (),
) -> dict[str, EncodedField]:
    """Encode every field of a TensorDict, dict or BatchedDataDict; all must have the same rows.

    ``enums`` maps a field to its vocabulary (strings travel as codes);
    ``object_fields`` names the fields that may hold msgpack values. Any other
    non-tensor value is NonTensorField naming its field.
    """
    fields = as_field_mapping(fields)
    if not fields:
        raise InvalidBatch("fields must be a non-empty mapping of name -> value")
    vocabularies = {k: enum_codes.vocabulary(k, v) for k, v in (enums or {}).items()}
    out: dict[str, EncodedField] = {}
    for name, value in fields.items():
        if not isinstance(name, str) or not name:
            raise InvalidBatch(f"field names must be non-empty str, got {name!r}")
        enc = encode_field(
            name,
            value,
            vocabulary=vocabularies.get(name),
            objects_allowed=name in object_fields,
        )
        if num_rows is None:
            num_rows = enc.num_rows
        if enc.num_rows != num_rows:
            raise InvalidBatch(f"field has {enc.num_rows} rows, expected {num_rows}", fields=[name])
        out[name] = enc
    return out


def decode_field(enc: EncodedField, *, writable: bool = True) -> Any:
    """EncodedField -> dense tensor, jagged torch.nested tensor, or list.

    ``writable=False`` makes tensors that view the bytes where they are, even when
    those are read-only (no copy).
    """
    if enc.kind == OBJECT:
        return decode_objects(enc)
    if enc.dtype is None:
        raise CorruptPayload(f"a {enc.kind} field has no dtype")
    buf = enc.require_values()
    if writable and not buf.flags.writeable:
        buf = buf.copy()
    if buf.nbytes == 0:
        flat = torch.empty(0, dtype=torch.uint8)  # a 0-byte array has no stride to reinterpret
    elif buf.flags.writeable:
        flat = torch.from_numpy(buf)
    else:
        # A view of bytes that arrived through Ray (the object store's own copy for this
        # read): torch has no read-only tensors and says so once; the contract says it.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")
            flat = torch.from_numpy(buf)
    return tensor_from_bytes(enc, flat)


def tensor_from_bytes(enc: EncodedField, flat: torch.Tensor) -> torch.Tensor:
    """A dense or jagged field's tensor over its bytes ``flat`` (1-D uint8, on any device;
    no copy): ``[N, *shape]``, or a jagged ``torch.nested`` tensor on the same device."""
    if enc.dtype is None:
        raise CorruptPayload(f"a {enc.kind} field has no dtype")
    dtype = DTYPES[enc.dtype]
    if flat.numel() == 0:
        flat = torch.empty(0, dtype=dtype, device=flat.device)
    elif dtype != torch.uint8:
        flat = flat.view(dtype)
    if enc.kind == DENSE:
        return flat.reshape(enc.num_rows, *enc.shape)
    lengths = torch.from_numpy(enc.require_lengths().astype(np.int64))
    offsets = torch.zeros(enc.num_rows + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    values = flat.reshape(int(offsets[-1]), *enc.shape)
    return torch.nested.nested_tensor_from_jagged(values, offsets=offsets.to(flat.device))


def decode_objects(enc: EncodedField) -> list:
    """The Python values of an object field, decoded in one call (CorruptPayload if garbled)."""
    return object_columns.decode_rows(enc.require_values(), enc.require_lengths())


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
