"""Object columns: per-row msgpack values stored as one byte column plus row lengths.

Each row's bytes are that value's own msgpack encoding, so a row range can be
cut out, moved and decoded on its own. Both directions run in msgpack's C code
once per column, not once per row: encoding packs the whole list in one call
and reads the row boundaries back with a C-level skip; decoding puts an array
header in front of the (selected) rows and unpacks them in one call. msgpack
only: never pickle.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from dataplane_client.errors import CorruptPayload, InvalidBatch


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


def decode_rows(values: np.ndarray, num_rows: int) -> list:
    """The ``num_rows`` values encoded back to back in ``values`` (CorruptPayload if not)."""
    try:
        out = msgpack.unpackb(_array_header(num_rows) + values.tobytes(), raw=False)
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
