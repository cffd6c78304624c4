"""A batch of encoded fields as one self-describing byte string (non-Ray paths, checkpoints).

Layout::

    frame   magic "DPB2" | header bytes (u32) | payload bytes (u64)    little-endian
    header  msgpack list, one entry per field:
            {name, kind, dtype, shape, rows, lengths (int64 LE bytes or None)}
    payload every field's bytes, back to back in header order
    crc32   of frame + header + payload                                (u32)

One checksum covers everything before it, so any single flipped bit (and any
burst shorter than 32 bits) is detected, and the frame's sizes make any
truncation or extension a size mismatch. A header that passes the checksum is
still validated against hard bounds (:meth:`EncodedField.validate`) before a
byte is allocated from its numbers: an input may be crafted, not only damaged.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np

from dataplane_client.wire import object_columns
from dataplane_client.wire.encoded import DENSE, OBJECT, EncodedField
from dataplane_client.wire.errors import CorruptPayload

_MAGIC = b"DPB2"
_FRAME = struct.Struct("<4sIQ")  # magic, header bytes, payload bytes
_CRC = struct.Struct("<I")
_ENTRY_KEYS = frozenset({"name", "kind", "dtype", "shape", "rows", "lengths"})


def seal(header: Any, payload: list[bytes]) -> bytes:
    """Frame ``header`` (msgpack-able) and ``payload`` and append the checksum over both."""
    head = msgpack.packb(header, use_bin_type=True)
    body = b"".join([_FRAME.pack(_MAGIC, len(head), sum(map(len, payload))), head, *payload])
    return body + _CRC.pack(zlib.crc32(body))


def unseal(data: bytes | memoryview) -> tuple[Any, memoryview]:
    """(header, payload) of a sealed byte string; CorruptPayload unless sizes and checksum agree."""
    mv = memoryview(data).cast("B")
    if len(mv) < _FRAME.size + _CRC.size:
        raise CorruptPayload(f"{len(mv)} bytes are shorter than the frame")
    magic, head_len, payload_len = _FRAME.unpack_from(mv, 0)
    if magic != _MAGIC:
        raise CorruptPayload(f"bad magic {bytes(magic)!r}")
    end = _FRAME.size + head_len + payload_len
    if end + _CRC.size != len(mv):
        raise CorruptPayload(
            f"frame describes {end + _CRC.size} bytes, got {len(mv)} (truncated or extended)"
        )
    (crc,) = _CRC.unpack_from(mv, end)
    if zlib.crc32(mv[:end]) != crc:
        raise CorruptPayload("checksum mismatch")
    try:
        header = msgpack.unpackb(mv[_FRAME.size : _FRAME.size + head_len], raw=False)
    except Exception:  # noqa: BLE001 - msgpack raises several unrelated types on garbage
        raise CorruptPayload("unreadable header") from None
    return header, mv[_FRAME.size + head_len : end]


def pack(encoded: Mapping[str, EncodedField]) -> bytes:
    """Encoded fields -> one checksummed byte string (see the module docstring)."""
    header = [
        {
            "name": name,
            "kind": enc.kind,
            "dtype": enc.dtype,
            "shape": list(enc.shape),
            "rows": enc.num_rows,
            "lengths": None if enc.kind == DENSE else enc.require_lengths().astype("<i8").tobytes(),
        }
        for name, enc in encoded.items()
    ]
    return seal(header, [enc.require_values().tobytes() for enc in encoded.values()])


def _field_header(entry: Any, seen: Mapping[str, EncodedField]) -> tuple[str, EncodedField]:
    """One header entry as a bytes-less EncodedField, its types and bounds checked."""
    if not isinstance(entry, dict) or set(entry) != _ENTRY_KEYS:
        raise CorruptPayload(f"malformed header entry: want a map of {sorted(_ENTRY_KEYS)}")
    name, rows, shape, raw = entry["name"], entry["rows"], entry["shape"], entry["lengths"]
    if not isinstance(name, str) or not name:
        raise CorruptPayload(f"field name must be a non-empty str, got {name!r}")
    if name in seen:
        raise CorruptPayload("field name repeated in the header", fields=[name])
    if not isinstance(shape, list):
        raise CorruptPayload(f"shape must be a list, got {shape!r}", fields=[name])
    lengths = None
    if entry["kind"] != DENSE:
        if not isinstance(raw, bytes) or not isinstance(rows, int) or len(raw) != 8 * rows:
            raise CorruptPayload("row lengths missing or mis-sized", fields=[name])
        lengths = np.frombuffer(raw, dtype="<i8").astype(np.int64)
    elif raw is not None:
        raise CorruptPayload("a dense field has no row lengths", fields=[name])
    enc = EncodedField(
        kind=entry["kind"], dtype=entry["dtype"], shape=tuple(shape), lengths=lengths, num_rows=rows
    )
    enc.validate(name, header_only=True)
    return name, enc


def unpack(data: bytes | memoryview) -> dict[str, EncodedField]:
    """Inverse of :func:`pack`; damaged or crafted input raises CorruptPayload, never anything else."""
    header, payload = unseal(data)
    if not isinstance(header, list):
        raise CorruptPayload("header is not a list of fields")
    fields: dict[str, EncodedField] = {}
    for entry in header:
        name, enc = _field_header(entry, fields)
        fields[name] = enc
    if len({enc.num_rows for enc in fields.values()}) > 1:
        raise CorruptPayload("fields disagree on the number of rows", fields=list(fields))
    sizes = [enc.expected_nbytes() for enc in fields.values()]
    if sum(sizes) != len(payload):
        raise CorruptPayload(
            f"header describes {sum(sizes)} payload bytes, frame holds {len(payload)}"
        )
    pos = 0
    for enc, size in zip(fields.values(), sizes):
        enc.values = np.frombuffer(payload[pos : pos + size], dtype=np.uint8).copy()
        pos += size
        if enc.kind == OBJECT:  # undecodable rows are corruption, found now rather than later
            object_columns.check_row_boundaries(enc.values, enc.require_lengths())
    return fields
