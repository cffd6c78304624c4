"""The checksummed byte format: every single bit flip is caught, and so is every crafted header."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dataplane_client.codec.fields import decode_field, encode_fields
from dataplane_client.wire.byte_format import pack, seal, unpack, unseal
from dataplane_client.wire.errors import CorruptPayload


def _batch():
    return encode_fields(
        {
            "dense": torch.arange(6, dtype=torch.int64).reshape(3, 2),
            "jagged": [torch.ones(2), torch.zeros(0), torch.full((3,), 2.0)],
            "objects": ["a", {"k": 1}, None],
        },
        object_fields=["objects"],
    )


def _flip(blob: bytes, bit: int) -> bytes:
    out = bytearray(blob)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


def test_the_batch_round_trips():
    got = {k: decode_field(e) for k, e in unpack(pack(_batch())).items()}
    assert got["dense"].tolist() == [[0, 1], [2, 3], [4, 5]]
    assert [r.tolist() for r in got["jagged"].unbind()] == [[1.0, 1.0], [], [2.0, 2.0, 2.0]]
    assert got["objects"] == ["a", {"k": 1}, None]


def test_every_single_bit_flip_anywhere_is_detected():
    blob = pack(_batch())
    missed = []
    for bit in range(len(blob) * 8):
        try:
            unpack(_flip(blob, bit))
            missed.append(bit)
        except CorruptPayload:
            pass
    assert missed == []


@st.composite
def _random_blobs(draw):
    n = draw(st.integers(0, 6))
    fields = {}
    if draw(st.booleans()):
        fields["d"] = torch.randint(0, 100, (n, draw(st.integers(0, 3))), dtype=torch.int32)
    if draw(st.booleans()):
        fields["j"] = [torch.ones(draw(st.integers(0, 4)), 2) for _ in range(n)]
    fields["o"] = draw(st.lists(st.text(max_size=6) | st.none(), min_size=n, max_size=n))
    # An empty list says nothing of its rows' type: declared, it may be an object column.
    return pack(encode_fields(fields, num_rows=n, object_fields=["o", "j"]))


@settings(max_examples=200, deadline=None)
@given(_random_blobs(), st.data())
def test_a_bit_flip_in_any_batch_is_detected(blob, data):
    bit = data.draw(st.integers(0, len(blob) * 8 - 1))
    with pytest.raises(CorruptPayload):
        unpack(_flip(blob, bit))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_truncation_extension_and_garbage_are_detected(data):
    blob = pack(_batch())
    how = data.draw(st.sampled_from(["truncate", "extend", "garbage"]))
    if how == "truncate":
        damaged = blob[: data.draw(st.integers(0, len(blob) - 1))]
    elif how == "extend":
        damaged = blob + data.draw(st.binary(min_size=1, max_size=16))
    else:
        damaged = data.draw(st.binary(max_size=256))
    with pytest.raises(CorruptPayload):
        unpack(damaged)


# ---- headers with valid checksums --------------------------------------------------------
def _resealed(edit) -> bytes:
    """The batch with ``edit`` applied to its decoded header, sealed with a valid checksum."""
    header, payload = unseal(pack(_batch()))
    edit(header)
    return seal(header, [bytes(payload)])


def _set(field: int, key: str, value):
    def edit(header):
        header[field][key] = value

    return edit


def _lengths(*values: int) -> bytes:
    return np.array(values, dtype="<u8").tobytes()  # unsigned: lets values past int64 through


CRAFTED = {
    "1T x 1T dense shape": _set(0, "shape", [10**12, 10**12]),
    "dense rows past the payload": _set(0, "rows", 10**12),
    "negative dimension": _set(0, "shape", [-2]),
    "bool dimension": _set(0, "shape", [True, True]),
    "shape not a list": _set(0, "shape", "ab"),
    "dtype is a list": _set(0, "dtype", ["float32"]),
    "dtype not allowed": _set(0, "dtype", "complex64"),
    "dtype missing on a tensor field": _set(0, "dtype", None),
    "object field with a dtype": _set(2, "dtype", "uint8"),
    "unknown kind": _set(0, "kind", "sparse"),
    "kind is a list": _set(0, "kind", ["dense"]),
    "lengths sum wraps int64 to 0": lambda h: h[1].update(
        shape=[0], lengths=_lengths(2**63 - 1, 2**63 - 1, 2)
    ),
    "negative length": lambda h: h[1].update(lengths=_lengths(2**64 - 1, 3, 3)),
    "lengths mis-sized": _set(1, "lengths", b"\x00" * 7),
    "lengths on a dense field": _set(0, "lengths", b"\x00" * 24),
    "rows disagree": lambda h: h[1].update(rows=2, lengths=_lengths(2, 3)),
    "duplicate field names": _set(1, "name", "dense"),
    "empty field name": _set(0, "name", ""),
    "extra key": _set(0, "offset", 0),
    "missing key": lambda h: h[0].pop("rows"),
    "entry not a map": lambda h: h.__setitem__(0, 5),
    "header not a list": lambda h: h.clear() or h.append({"not": "a list"}),
    "object row cut in the wrong place": lambda h: h[2].update(
        lengths=np.array([1, 2, 2], dtype="<i8").tobytes()
    ),
}


@pytest.mark.parametrize("edit", CRAFTED.values(), ids=CRAFTED.keys())
def test_crafted_headers_with_valid_checksums_are_rejected(edit):
    with pytest.raises(CorruptPayload):
        unpack(_resealed(edit))


def test_a_zero_dimension_cannot_hide_a_huge_one():
    """[1, 0, 2**63] holds no bytes, so sizes agree; the dimension itself is out of bounds."""
    entry = {"name": "x", "kind": "dense", "dtype": "float32", "rows": 1, "lengths": None}
    assert unpack(seal([{**entry, "shape": [0, 2**40]}], []))["x"].num_rows == 1
    with pytest.raises(CorruptPayload, match="shape"):
        unpack(seal([{**entry, "shape": [0, 2**63]}], []))


def test_a_header_that_is_not_a_list_is_corrupt():
    with pytest.raises(CorruptPayload, match="not a list"):
        unpack(seal({"name": "x"}, []))


_NASTY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    st.text(max_size=8),
    st.binary(max_size=32),
    st.lists(st.integers(-(2**40), 2**40), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(-(2**63), 2**64 - 1), max_size=2),
)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, 2),
    st.sampled_from(["name", "kind", "dtype", "shape", "rows", "lengths"]),
    _NASTY,
)
def test_any_value_in_any_header_slot_decodes_consistently_or_is_corrupt(field, key, value):
    """Whatever a crafted header holds, unpack either refuses it with CorruptPayload or
    returns fields whose bytes match their headers; never another exception."""
    try:
        decoded = unpack(_resealed(_set(field, key, value)))
    except CorruptPayload:
        return
    for name, enc in decoded.items():
        enc.validate(name)
        decode_field(enc)


def test_seal_covers_the_header():
    """A flipped header bit that still parses as msgpack is caught by the checksum."""
    blob = bytearray(pack(_batch()))
    at = bytes(blob).index(b"jagged")
    blob[at] ^= 0x20  # "jagged" -> "Jagged": still a valid header without a checksum
    with pytest.raises(CorruptPayload, match="checksum"):
        unpack(bytes(blob))
