"""String columns: str/None rows written as msgpack str bytes without a per-row msgpack call,
decoded straight out of the buffer they arrived in; the general msgpack path for the rest."""

import uuid

import msgpack
import numpy as np
import pytest

from dataplane_client.codec import fields as codec
from dataplane_client.codec.fields import decode_field, encode_fields
from dataplane_client.wire import byte_format
from dataplane_client.wire.encoded import take_rows
from dataplane_client.wire.errors import CorruptPayload, InvalidBatch

# Every msgpack str header width (fixstr, str8, str16, str32), empty strings, non-ASCII
# (2-, 3- and 4-byte utf-8) and None rows.
ROWS = [
    "",
    "a",
    "é" * 20,  # 40 bytes: str8 although 20 characters
    "x" * 31,
    "y" * 32,
    None,
    "日本語テキスト" * 40,
    "z" * 70_000,  # str32
    "🙂" * 9,
    "",
    None,
    "mixed ascii and ü",
]


def _encode(rows):
    return encode_fields({"s": rows}, object_fields=["s"])["s"]


def test_rows_are_exactly_msgpack_str_bytes_and_round_trip():
    enc = _encode(ROWS)
    assert enc.kind == codec.OBJECT
    assert enc.strings is not None
    packed = b"".join(msgpack.packb(r, use_bin_type=True) for r in ROWS)
    assert enc.require_values().tobytes() == packed  # either side can take the general path
    assert enc.lengths.tolist() == [len(msgpack.packb(r, use_bin_type=True)) for r in ROWS]
    assert decode_field(enc) == ROWS


def test_selected_rows_written_straight_into_a_destination_in_any_order():
    enc = _encode(ROWS)
    rows = np.array([7, 0, 5, 6, 6, 11])
    header = take_rows(enc, rows, header_only=True)
    dest = np.full(header.nbytes, 0xEE, dtype=np.uint8)  # as a staging region would be
    got = take_rows(enc, rows, out=dest)
    assert got.values is dest
    assert decode_field(got) == [ROWS[i] for i in rows]
    assert enc.strings is not None, "writing a selection keeps the column's strings"
    assert decode_field(take_rows(enc, rows)) == [ROWS[i] for i in rows]


def test_decoding_reads_from_a_read_only_buffer():
    enc = _encode(ROWS)
    frozen = enc.require_values().copy()
    frozen.flags.writeable = False  # as an object-store buffer is
    enc.values = frozen
    assert decode_field(enc) == ROWS


def test_other_values_take_the_general_path_and_mixed_columns_decode():
    lists = [["a", "ü"], [], ["x" * 40], None]
    enc = _encode(lists)
    assert enc.strings is None  # lists of strings: one msgpack call for the column
    assert decode_field(enc) == lists
    mixed = ["a", 1, None, {"k": "v"}]
    assert decode_field(_encode(mixed)) == mixed


def test_all_none_and_empty_columns():
    assert decode_field(_encode([None, None])) == [None, None]
    assert decode_field(_encode(["", ""])) == ["", ""]


def test_a_lone_surrogate_is_invalid_naming_the_field():
    with pytest.raises(InvalidBatch, match="unicode") as e:
        _encode(["ok", "\ud800"])
    assert e.value.fields == ["s"]


def _corrupt(values: bytes, lengths: list[int]) -> codec.EncodedField:
    return codec.EncodedField(
        kind=codec.OBJECT,
        values=np.frombuffer(values, dtype=np.uint8).copy(),
        lengths=np.array(lengths, dtype=np.int64),
        num_rows=len(lengths),
    )


@pytest.mark.parametrize(
    ("values", "lengths"),
    [
        (b"\xa3abcd", [5]),  # fixstr says 3 bytes, the row holds 4
        (b"\xd9\x05abc", [5]),  # str8 says 5, the row holds 3
        (b"\xa2\xff\xfe", [3]),  # not utf-8
        (b"\xa1a\xa1b", [2, 1]),  # a row cut inside the next one's header
        (b"\xa1a", [2, 1]),  # lengths sum past the bytes
        (b"\xdb\x00\x00", [3]),  # a str32 header cut short
    ],
)
def test_damaged_string_rows_are_corrupt_payload(values, lengths):
    with pytest.raises(CorruptPayload):
        decode_field(_corrupt(values, lengths))


def test_string_columns_through_the_checksummed_byte_format():
    enc = _encode(ROWS)
    back = byte_format.unpack(byte_format.pack({"s": enc}))["s"]
    assert decode_field(back) == ROWS


def test_string_columns_through_the_service(client):
    """Same-node put (written straight into shared memory) and get, any order, a subset."""
    pid = f"str-{uuid.uuid4().hex[:8]}"
    client.register_partition(pid, ["s", "t"], None, [], object_fields=["s", "t"])
    ids = [f"s{i}" for i in range(len(ROWS))]
    client.put_samples(ids, pid, {"s": ROWS, "t": [["l", "ü"]] * len(ROWS)})
    picked = [ids[i] for i in (11, 0, 7, 5, 2)]
    got = client.get_samples(picked, pid, ["s", "t"])
    assert got["s"].tolist() == [ROWS[int(s[1:])] for s in picked]
    assert got["t"].tolist() == [["l", "ü"]] * len(picked)
    client.clear_samples(None, pid)
