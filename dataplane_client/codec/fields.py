"""Columnar jagged codec: tensors and values to and from the data plane's wire format.

A batch of N samples becomes, per field, one :class:`EncodedField` (defined, with its
checks and row selection, in :mod:`dataplane_client.wire.encoded`, which needs no torch):

- ``dense``: one flat byte buffer holding ``[N, *shape]`` of ``dtype``;
- ``jagged``: one flat byte buffer of all rows back to back plus ``lengths``
  (``int64[N]``, each row's first-dim length; every row is ``[len_i, *shape]``);
- ``object``: N small Python values, each msgpack-encoded; stored like a jagged
  uint8 field (``lengths`` = bytes per row), so selecting, splitting and joining
  rows is byte copying and only the final decode touches Python objects. A
  column of strings (``str`` or ``None`` rows) keeps the caller's strings until
  its bytes are written to their destination (``strings``; see
  :mod:`dataplane_client.wire.object_columns`).

Strings of an enum field (a vocabulary declared at registration) travel as a
dense ``int32`` field of codes (:mod:`dataplane_client.wire.enum_codes`). Python
objects travel only in fields declared as object fields; any other non-tensor
value is :class:`NonTensorField` (NeMo-RL's contract: no Python objects on the
bus unless asked for).

Buffers are numpy ``uint8`` arrays so Ray moves them out-of-band (zero-copy on
the same node); headers are plain builtins. Nothing here pickles.
:mod:`dataplane_client.wire.byte_format` turns encoded fields into one
self-describing, checksummed byte string for paths that are not Ray.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np
import torch

from dataplane_client.codec.tensordict_io import as_field_mapping
from dataplane_client.wire import enum_codes, object_columns
from dataplane_client.wire.encoded import DENSE, JAGGED, OBJECT, EncodedField
from dataplane_client.wire.errors import (
    CorruptPayload,
    InvalidBatch,
    NonTensorField,
    SchemaConflict,
)

# The torch dtype of every wire dtype name (encoded.DTYPE_SIZES names the same set).
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
