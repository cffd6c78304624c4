"""Columnar jagged codec: the data plane's wire format.

A batch of N samples becomes, per field, one :class:`EncodedField`:

- ``dense``: one flat byte buffer holding ``[N, *shape]`` of ``dtype``;
- ``jagged``: one flat byte buffer of all rows back to back plus ``lengths``
  (``int64[N]``, each row's first-dim length; every row is ``[len_i, *shape]``);
- ``object``: N small Python values, each msgpack-encoded; stored like a jagged
  uint8 field (``lengths`` = bytes per row), so selecting, splitting and joining
  rows is byte copying and only the final decode touches Python objects.

Buffers are numpy ``uint8`` arrays so Ray moves them out-of-band (zero-copy on
the same node); headers are plain builtins. :func:`pack` / :func:`unpack` turn
a batch into one self-describing byte string (msgpack header + buffers + CRC32)
for paths that are not Ray. Nothing here pickles.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch

from dataplane_client.errors import CorruptPayload, InvalidBatch, SchemaConflict

DENSE, JAGGED, OBJECT = "dense", "jagged", "object"

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


@dataclass
class EncodedField:
    """One field of N samples in wire form."""

    kind: str
    dtype: str | None = None  # DTYPES key; None for object fields (their bytes are msgpack)
    shape: tuple[int, ...] = ()  # trailing shape of one row (after the jagged dim for jagged)
    values: np.ndarray | None = None  # uint8, dense/jagged
    lengths: np.ndarray | None = None  # int64[N]: jagged rows' first dim / object rows' bytes
    num_rows: int = 0

    @property
    def schema(self) -> tuple[str, str | None, tuple[int, ...]]:
        """What must agree between writes of the same field."""
        return (self.kind, self.dtype, tuple(self.shape))

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=DTYPES[self.dtype]).element_size() if self.dtype else 1

    @property
    def row_unit_bytes(self) -> int:
        """Bytes per unit of the first dim (dense: per row; jagged: per token)."""
        return self.itemsize * math.prod(self.shape)

    def row_nbytes(self) -> np.ndarray:
        """Byte size of each row, int64[N]."""
        if self.kind == DENSE:
            return np.full(self.num_rows, self.row_unit_bytes, dtype=np.int64)
        return self.lengths.astype(np.int64) * self.row_unit_bytes

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes) if self.values is not None else self.expected_nbytes()

    def expected_nbytes(self) -> int:
        """Bulk bytes the header describes."""
        if self.kind == DENSE:
            return self.num_rows * self.row_unit_bytes
        return int(self.lengths.sum()) * self.row_unit_bytes

    def validate(self, name: str, *, header_only: bool = False) -> None:
        """Check internal consistency; raise CorruptPayload naming the field."""
        if self.kind not in (DENSE, JAGGED, OBJECT):
            raise CorruptPayload(f"unknown field kind {self.kind!r}", fields=[name])
        if self.kind == OBJECT and (self.dtype is not None or self.shape):
            raise CorruptPayload(
                "object fields carry msgpack bytes: no dtype or shape", fields=[name]
            )
        if self.kind != OBJECT and self.dtype not in DTYPES:
            raise CorruptPayload(f"unknown dtype {self.dtype!r}", fields=[name])
        if any(int(d) < 0 for d in self.shape):
            raise CorruptPayload(f"negative dimension in shape {self.shape}", fields=[name])
        if not header_only and (
            not isinstance(self.values, np.ndarray) or self.values.dtype != np.uint8
        ):
            raise CorruptPayload("values must be a uint8 array", fields=[name])
        if self.kind != DENSE and (
            not isinstance(self.lengths, np.ndarray)
            or self.lengths.shape != (self.num_rows,)
            or (self.num_rows and int(self.lengths.min()) < 0)
        ):
            raise CorruptPayload("jagged lengths missing, mis-sized or negative", fields=[name])
        expected = self.expected_nbytes()
        if not header_only and self.values.nbytes != expected:
            raise CorruptPayload(
                f"values hold {self.values.nbytes} bytes, header says {expected}", fields=[name]
            )


# ---------------------------------------------------------------------------
# tensors <-> EncodedField


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


def _encode_jagged_list(name: str, rows: list[torch.Tensor]) -> EncodedField:
    if not rows:
        raise InvalidBatch("empty list of tensors", fields=[name])
    first = rows[0]
    for i, r in enumerate(rows):
        if r.ndim < 1:
            raise InvalidBatch(f"jagged row {i} is 0-dim; rows must be >= 1-D", fields=[name])
        if r.dtype != first.dtype or tuple(r.shape[1:]) != tuple(first.shape[1:]):
            raise SchemaConflict(
                f"jagged row {i} has dtype {r.dtype} / inner shape {tuple(r.shape[1:])}, "
                f"row 0 has {first.dtype} / {tuple(first.shape[1:])}",
                fields=[name],
            )
    values = torch.cat([r.detach().cpu().reshape(r.shape[0], *first.shape[1:]) for r in rows])
    lengths = np.array([r.shape[0] for r in rows], dtype=np.int64)
    return EncodedField(
        kind=JAGGED,
        dtype=_dtype_name(first, name),
        shape=tuple(int(d) for d in first.shape[1:]),
        values=_as_bytes(values),
        lengths=lengths,
        num_rows=len(rows),
    )


def encode_field(name: str, value: Any) -> EncodedField:
    """Encode one field's value for N samples."""
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            if value.layout != torch.jagged:
                return _encode_jagged_list(name, list(value.unbind()))
            offsets = value.offsets()
            values = value.values()
            lengths = (offsets[1:] - offsets[:-1]).cpu().numpy().astype(np.int64)
            start, end = int(offsets[0]), int(offsets[-1])
            return EncodedField(
                kind=JAGGED,
                dtype=_dtype_name(values, name),
                shape=tuple(int(d) for d in values.shape[1:]),
                values=_as_bytes(values[start:end]),
                lengths=lengths,
                num_rows=len(lengths),
            )
        if value.ndim == 0:
            raise InvalidBatch("a dense field needs a leading sample dim [N, ...]", fields=[name])
        return EncodedField(
            kind=DENSE,
            dtype=_dtype_name(value, name),
            shape=tuple(int(d) for d in value.shape[1:]),
            values=_as_bytes(value),
            num_rows=int(value.shape[0]),
        )
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(v, torch.Tensor) for v in value):
            return _encode_jagged_list(name, list(value))
        if any(isinstance(v, torch.Tensor) for v in value):
            raise InvalidBatch("a list mixes tensors and non-tensors", fields=[name])
        try:
            rows = [msgpack.packb(v, use_bin_type=True) for v in value]
        except (TypeError, ValueError, OverflowError) as e:
            raise InvalidBatch(f"values are not msgpack-serializable: {e}", fields=[name]) from None
        return EncodedField(
            kind=OBJECT,
            values=np.frombuffer(b"".join(rows), dtype=np.uint8),
            lengths=np.fromiter(map(len, rows), dtype=np.int64, count=len(rows)),
            num_rows=len(rows),
        )
    if isinstance(value, np.ndarray):
        return encode_field(name, torch.from_numpy(np.ascontiguousarray(value)))
    raise InvalidBatch(
        f"unsupported field type {type(value).__name__}: use a tensor [N, ...], a jagged "
        "torch.nested tensor or list of tensors, or a list of msgpack-able values",
        fields=[name],
    )


def encode_fields(
    fields: Mapping[str, Any], num_rows: int | None = None
) -> dict[str, EncodedField]:
    """Encode every field; all must describe the same number of samples."""
    if not isinstance(fields, Mapping) or not fields:
        raise InvalidBatch("fields must be a non-empty mapping of name -> value")
    out: dict[str, EncodedField] = {}
    for name, value in fields.items():
        if not isinstance(name, str) or not name:
            raise InvalidBatch(f"field names must be non-empty str, got {name!r}")
        enc = encode_field(name, value)
        if num_rows is None:
            num_rows = enc.num_rows
        if enc.num_rows != num_rows:
            raise InvalidBatch(f"field has {enc.num_rows} rows, expected {num_rows}", fields=[name])
        out[name] = enc
    return out


def decode_field(enc: EncodedField, *, writable: bool = True) -> Any:
    """EncodedField -> dense tensor, jagged torch.nested tensor, or list."""
    if enc.kind == OBJECT:
        return decode_objects(enc)
    dtype = DTYPES[enc.dtype]
    buf = enc.values
    if writable and not buf.flags.writeable:
        buf = buf.copy()
    if buf.nbytes == 0:
        flat = torch.empty(0, dtype=dtype)  # a 0-byte array has no stride to reinterpret
    else:
        flat = torch.from_numpy(buf)
        flat = flat.view(dtype) if dtype != torch.uint8 else flat
    if enc.kind == DENSE:
        return flat.reshape(enc.num_rows, *enc.shape)
    lengths = torch.from_numpy(enc.lengths.astype(np.int64))
    offsets = torch.zeros(enc.num_rows + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    values = flat.reshape(int(offsets[-1]), *enc.shape)
    return torch.nested.nested_tensor_from_jagged(values, offsets=offsets)


def decode_objects(enc: EncodedField) -> list:
    """The Python values of an object field (raises CorruptPayload on undecodable rows)."""
    blob = enc.values.tobytes()
    out, pos = [], 0
    for n in enc.lengths.tolist():
        try:
            out.append(msgpack.unpackb(blob[pos : pos + n], raw=False))
        except Exception:  # msgpack raises several unrelated types on garbage
            raise CorruptPayload(f"object row at byte {pos} is not msgpack") from None
        pos += n
    return out


def decode_fields(encoded: Mapping[str, EncodedField]) -> dict[str, Any]:
    return {name: decode_field(enc) for name, enc in encoded.items()}


# ---------------------------------------------------------------------------
# row selection and concatenation on encoded fields (used by client and units)


def row_byte_offsets(enc: EncodedField) -> np.ndarray:
    """int64[N+1] byte offsets of each row in ``values``."""
    offs = np.zeros(enc.num_rows + 1, dtype=np.int64)
    np.cumsum(enc.row_nbytes(), out=offs[1:])
    return offs


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


def gather_bytes(
    buffers: list[np.ndarray],
    which: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Copy byte ranges (from ``buffers[which[i]]``) back to back into one buffer.

    Adjacent ranges of the same buffer are merged first, so a contiguous
    selection is a single memcpy.
    """
    total = int((ends - starts).sum())
    if out is None:
        out = np.empty(total, dtype=np.uint8)
    if len(starts) == 0:
        return out
    # Merge only inside the same source buffer: offset the ranges so buffers never abut.
    key = which.astype(np.int64) << 48
    rs, re_ = contiguous_runs(starts + key, ends + key)
    pos = 0
    for s, e in zip(rs.tolist(), re_.tolist()):
        buf = buffers[s >> 48]
        lo, hi = s & ((1 << 48) - 1), e & ((1 << 48) - 1)
        n = hi - lo
        out[pos : pos + n] = buf[lo:hi]
        pos += n
    return out


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
    elif out is None and len(rows) and np.all(rows[1:] == rows[:-1] + 1):
        values = enc.values[int(starts[0]) : int(ends[-1])]
    else:
        values = gather_bytes(
            [enc.values], np.zeros(len(rows), dtype=np.int64), starts, ends, out=out
        )
    return EncodedField(
        kind=enc.kind,
        dtype=enc.dtype,
        shape=enc.shape,
        values=values,
        lengths=None if enc.lengths is None else enc.lengths[rows],
        num_rows=len(rows),
    )


# ---------------------------------------------------------------------------
# self-describing byte string (non-Ray paths, persistence, tests)

_MAGIC = b"DPB1"
_HEAD = struct.Struct("<4sI")  # magic, header length


def pack(encoded: Mapping[str, EncodedField]) -> bytes:
    """Encoded fields -> one byte string: magic, msgpack header, buffers."""
    header, blobs, pos = [], [], 0
    for name, enc in encoded.items():
        blob = enc.values.tobytes()
        entry = {
            "name": name,
            "kind": enc.kind,
            "dtype": enc.dtype,
            "shape": list(enc.shape),
            "rows": enc.num_rows,
            "offset": pos,
            "nbytes": len(blob),
            "crc": zlib.crc32(blob),
        }
        if enc.kind != DENSE:
            entry["lengths"] = enc.lengths.astype("<i8").tobytes()
        header.append(entry)
        blobs.append(blob)
        pos += len(blob)
    head = msgpack.packb(header, use_bin_type=True)
    return b"".join([_HEAD.pack(_MAGIC, len(head)), head, *blobs])


def unpack(data: bytes | memoryview) -> dict[str, EncodedField]:
    """Inverse of :func:`pack`; any truncation or corruption raises CorruptPayload."""
    mv = memoryview(data)
    if len(mv) < _HEAD.size:
        raise CorruptPayload(f"payload of {len(mv)} bytes is shorter than its fixed header")
    magic, head_len = _HEAD.unpack_from(mv, 0)
    if magic != _MAGIC:
        raise CorruptPayload(f"bad magic {bytes(magic)!r}")
    body = _HEAD.size + head_len
    if body > len(mv):
        raise CorruptPayload(f"header claims {head_len} bytes, payload has {len(mv) - _HEAD.size}")
    try:
        header = msgpack.unpackb(mv[_HEAD.size : body], raw=False)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise CorruptPayload(f"unreadable header: {type(e).__name__}") from None
    if not isinstance(header, list):
        raise CorruptPayload("header is not a list")
    out: dict[str, EncodedField] = {}
    for entry in header:
        try:
            name, kind, off, nbytes = (
                entry["name"],
                entry["kind"],
                int(entry["offset"]),
                int(entry["nbytes"]),
            )
            rows, crc = int(entry["rows"]), int(entry["crc"])
            dtype, shape = entry["dtype"], tuple(int(d) for d in entry["shape"])
        except (KeyError, TypeError, ValueError):
            raise CorruptPayload("malformed header entry") from None
        if (
            not isinstance(name, str)
            or off < 0
            or nbytes < 0
            or rows < 0
            or body + off + nbytes > len(mv)
        ):
            raise CorruptPayload("field bytes out of range (truncated?)", fields=[str(name)])
        blob = mv[body + off : body + off + nbytes]
        if zlib.crc32(blob) != crc:
            raise CorruptPayload("checksum mismatch", fields=[name])
        lengths = None
        if kind != DENSE:
            raw = entry.get("lengths")
            if not isinstance(raw, bytes) or len(raw) != 8 * rows:
                raise CorruptPayload("row lengths missing or mis-sized", fields=[name])
            lengths = np.frombuffer(raw, dtype="<i8").astype(np.int64)
        enc = EncodedField(
            kind=kind,
            dtype=dtype,
            shape=shape,
            lengths=lengths,
            num_rows=rows,
            values=np.frombuffer(blob, dtype=np.uint8).copy(),
        )
        enc.validate(name)
        if kind == OBJECT:
            decode_objects(enc)  # undecodable rows are corruption, found now rather than later
        out[name] = enc
    return out
