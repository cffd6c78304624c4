"""Object columns: per-row msgpack values stored as one byte column plus row lengths.

Each row's bytes are that value's own msgpack encoding, so a row range can be
cut out, moved and decoded on its own. msgpack only: never pickle.

Two ways through, chosen once per column:

- **strings** (every row a ``str`` or ``None``, the common case: prompts,
  responses, ids): the rows are utf-8 bytes back to back, each behind its
  msgpack ``str`` header (``None`` is msgpack ``nil``). Headers and boundaries
  are computed with numpy from the rows' byte lengths, each row's bytes are
  written straight into their destination (the staging region in shared
  memory on a same-node put: no intermediate buffer), and decoding reads each
  row's utf-8 straight out of the buffer it arrived in (no copy of the column
  first). The bytes are exactly what msgpack would write, so either side can
  take the general path.
- **anything else** msgpack can encode: the whole list is packed in one call
  and the row boundaries read back with a C-level skip; decoding puts an array
  header in front of the (selected) rows and unpacks them in one call.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from dataplane_client.wire.errors import CorruptPayload, InvalidBatch

_NONE = type(None)
_NIL = 0xC0
_FIXSTR, _STR8, _STR16, _STR32 = 0xA0, 0xD9, 0xDA, 0xDB
_MAX_STR = 2**32 - 1  # msgpack's str32 limit


# ---- string columns -------------------------------------------------------------------


class StringRows:
    """The rows of a string column, kept as the caller's ``str`` objects until written.

    ``payload``: utf-8 bytes of each row (-1 for ``None``); ``header``: its
    msgpack header bytes. A row occupies ``header + max(payload, 0)`` bytes.
    """

    def __init__(self, name: str, rows: list):
        self.rows = rows
        try:
            # str.isascii() is O(1) (CPython keeps the flag): only non-ASCII rows are encoded to be measured.
            self.payload = np.fromiter(
                (
                    -1 if s is None else len(s) if s.isascii() else len(s.encode("utf-8"))
                    for s in rows
                ),
                dtype=np.int64,
                count=len(rows),
            )
        except UnicodeEncodeError as e:  # a lone surrogate: no utf-8 exists for it
            raise InvalidBatch(f"a string is not valid unicode: {e}", fields=[name]) from None
        if len(rows) and int(self.payload.max()) > _MAX_STR:
            raise InvalidBatch(f"a string is longer than {_MAX_STR} bytes", fields=[name])
        p = self.payload
        self.header = np.select([p < 0, p < 32, p < 256, p < 65536], [1, 1, 2, 3], 5).astype(
            np.int64
        )

    @property
    def row_nbytes(self) -> np.ndarray:
        return self.header + np.maximum(self.payload, 0)

    def write(self, rows: np.ndarray, out: np.ndarray) -> None:
        """Write the given rows (in that order) back to back into ``out`` (uint8, exact size)."""
        payload, header = self.payload[rows], self.header[rows]
        ends = np.cumsum(header + np.maximum(payload, 0))
        at = ends - header - np.maximum(payload, 0)  # where each row's header starts
        first = np.select(
            [payload < 0, header == 1, header == 2, header == 3],
            [_NIL, _FIXSTR | np.clip(payload, 0, 31), _STR8, _STR16],
            _STR32,
        )
        out[at] = first
        for width, nbytes in ((2, 1), (3, 2), (5, 4)):  # big-endian length after the tag
            m = header == width
            for k in range(nbytes):
                out[at[m] + 1 + k] = (payload[m] >> (8 * (nbytes - 1 - k))) & 0xFF
        view = out.data  # a memoryview: slice assignment is one memcpy
        src = self.rows
        for i, pos, n in zip(rows.tolist(), (at + header).tolist(), payload.tolist()):
            if n > 0:  # encoding one row at a time keeps the temporary in cache
                view[pos : pos + n] = src[i].encode("utf-8")


def string_rows(name: str, values: Sequence[Any]) -> StringRows | None:
    """The column as :class:`StringRows` when every row is a ``str`` or ``None`` (decided
    on the set of row types: one C-level pass, not an isinstance call per row)."""
    rows = list(values)
    kinds = set(map(type, rows))
    if not kinds or not kinds <= {str, _NONE}:
        return None
    return StringRows(name, rows)


def _decode_strings(values: np.ndarray, lengths: np.ndarray) -> list | None:
    """The rows as str/None when every row is a msgpack str or nil; None when some row is
    another kind of value (the general path decodes it); CorruptPayload when a row's
    header disagrees with its length or its bytes are not utf-8."""
    n = len(lengths)
    if n == 0:
        return []
    if int(lengths.min()) <= 0:
        return None  # an empty row is no msgpack value: the general path says so
    ends = np.cumsum(lengths)
    at = ends - lengths
    tag = values[at]
    nil = tag == _NIL
    fix = (tag & 0xE0) == _FIXSTR
    header = np.select([nil | fix, tag == _STR8, tag == _STR16, tag == _STR32], [1, 2, 3, 5], 0)
    if not header.all():
        return None
    if (lengths < header).any():
        raise CorruptPayload("an object row is shorter than its msgpack header")
    size = values.size

    def byte(
        k: int,
    ) -> np.ndarray:  # the k-th byte after each tag (clipped; used only where it exists)
        return values[np.minimum(at + k, size - 1)].astype(np.int64)

    declared = np.where(fix, tag.astype(np.int64) & 0x1F, 0)
    declared = np.where(header == 2, byte(1), declared)
    declared = np.where(header == 3, (byte(1) << 8) | byte(2), declared)
    declared = np.where(
        header == 5, (byte(1) << 24) | (byte(2) << 16) | (byte(3) << 8) | byte(4), declared
    )
    if ((header + declared) != lengths).any():
        raise CorruptPayload("an object row does not end where its length says")
    view = values.data
    try:
        return [
            None if is_nil else str(view[p:q], "utf-8")
            for is_nil, p, q in zip(nil.tolist(), (at + header).tolist(), ends.tolist())
        ]
    except UnicodeDecodeError:
        raise CorruptPayload("an object row's string is not utf-8") from None


# ---- any msgpack values ---------------------------------------------------------------


def encode_rows(name: str, values: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 bytes of every row back to back, int64 byte length of each row)."""
    try:
        blob = msgpack.packb(list(values), use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise InvalidBatch(f"values are not msgpack-serializable: {e}", fields=[name]) from None
    reader = msgpack.Unpacker(raw=False, max_buffer_size=len(blob))
    reader.feed(blob)
    reader.read_array_header()
    ends = np.empty(len(values) + 1, dtype=np.int64)
    ends[0] = reader.tell()
    for i in range(1, len(values) + 1):
        reader.skip()
        ends[i] = reader.tell()
    values_bytes = np.frombuffer(blob, dtype=np.uint8)[int(ends[0]) :]
    return values_bytes, np.diff(ends)


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes([0x90 | n])
    if n < 1 << 16:
        return b"\xdc" + struct.pack(">H", n)
    return b"\xdd" + struct.pack(">I", n)


def decode_rows(values: np.ndarray, lengths: np.ndarray) -> list:
    """The values encoded back to back in ``values``, one per entry of ``lengths``
    (CorruptPayload if they are not)."""
    if int(lengths.sum()) != values.nbytes:
        raise CorruptPayload(f"object rows hold {values.nbytes} bytes, lengths say {lengths.sum()}")
    strings = _decode_strings(values, lengths)
    if strings is not None:
        return strings
    num_rows = len(lengths)
    try:
        out = msgpack.unpackb(b"".join([_array_header(num_rows), values.data]), raw=False)
    except Exception:  # noqa: BLE001 - msgpack raises several unrelated types on garbage
        raise CorruptPayload(f"object rows are not {num_rows} msgpack values") from None
    return out


def check_row_boundaries(values: np.ndarray, lengths: np.ndarray) -> None:
    """Every row is exactly one msgpack value of its stated length (for untrusted bytes)."""
    reader = msgpack.Unpacker(raw=False, max_buffer_size=max(1, values.nbytes))
    reader.feed(values.tobytes())
    pos = 0
    for row, n in enumerate(lengths.tolist()):
        try:
            reader.skip()
        except Exception:  # noqa: BLE001 - msgpack raises several types on garbage
            raise CorruptPayload(f"object row {row} is not msgpack") from None
        pos += n
        if reader.tell() != pos:
            raise CorruptPayload(f"object row {row} does not end where its length says")
