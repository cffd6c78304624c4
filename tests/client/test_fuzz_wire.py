"""Bad bytes to the wire decoder (``byte_format.unpack`` then ``codec.decode_field``).

Random batches (dense, jagged and object fields of every wire dtype) are packed, then
damaged: random bytes, overwritten / inserted / deleted bytes, truncation, splices of
two batches, and payload edits re-sealed with a valid checksum (so the decoder, not the
checksum, has to judge them). Only CorruptPayload may come out; whatever decodes holds
bytes consistent with its header. Inputs tried per surface are printed.
"""

from __future__ import annotations

from collections import Counter

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataplane_client.codec.fields import decode_field, encode_fields
from dataplane_client.wire.byte_format import pack, seal, unpack, unseal
from dataplane_client.wire.errors import CorruptPayload

# Fuzzing runs many examples: the full suite, not make test-fast.
pytestmark = pytest.mark.slow

TRIED: Counter = Counter()
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool]


@pytest.fixture(autouse=True, scope="module")
def _report_counts():
    yield
    print(f"\nwire fuzz inputs tried per surface: {dict(sorted(TRIED.items()))}")


def _tensor(dtype, shape, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g).to(dtype)


@st.composite
def batches(draw) -> bytes:
    rows = draw(st.integers(min_value=0, max_value=4))
    fields, objects = {}, []
    for i in range(draw(st.integers(min_value=1, max_value=3))):
        kind = draw(st.sampled_from(["dense", "jagged", "object"]))
        dtype = draw(st.sampled_from(DTYPES))
        if kind == "dense":
            fields[f"f{i}"] = _tensor(dtype, (rows, draw(st.integers(0, 3))), i)
        elif kind == "jagged" and rows:
            fields[f"f{i}"] = [
                _tensor(dtype, (draw(st.integers(0, 5)),), i + r) for r in range(rows)
            ]
        else:
            value = st.one_of(st.none(), st.integers(-(2**31), 2**31), st.text(max_size=6))
            fields[f"f{i}"] = draw(st.lists(value, min_size=rows, max_size=rows))
            objects.append(f"f{i}")
    return pack(encode_fields(fields, rows, object_fields=objects))


def _decodes_or_is_corrupt(blob: bytes) -> bool:
    """True when it decoded (consistently), False when refused as CorruptPayload."""
    try:
        decoded = unpack(blob)
        for name, enc in decoded.items():
            enc.validate(name)
            decode_field(enc)
    except CorruptPayload:
        return False
    return True


@SETTINGS
@given(st.binary(max_size=200))
def test_random_bytes_are_corrupt(blob):
    TRIED["random_bytes"] += 1
    assert not _decodes_or_is_corrupt(blob)


@SETTINGS
@given(batches(), st.data())
def test_damaged_batches_are_corrupt(blob, data):
    how = data.draw(st.sampled_from(["overwrite", "insert", "delete", "truncate", "extend"]))
    pos = data.draw(st.integers(min_value=0, max_value=len(blob) - 1))
    b = bytearray(blob)
    if how == "overwrite":
        new = data.draw(st.binary(min_size=1, max_size=8))
        b[pos : pos + len(new)] = new
        b = b[: len(blob)]  # same length: only the bytes differ
    elif how == "insert":
        b[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
    elif how == "delete":
        del b[pos : pos + data.draw(st.integers(min_value=1, max_value=8))]
    elif how == "truncate":
        b = b[:pos]
    else:
        b += data.draw(st.binary(min_size=1, max_size=8))
    TRIED[f"damaged.{how}"] += 1
    if bytes(b) == blob:  # an overwrite with the same bytes: still the batch
        assert _decodes_or_is_corrupt(bytes(b))
    else:
        assert not _decodes_or_is_corrupt(bytes(b))


@SETTINGS
@given(batches(), batches(), st.data())
def test_splices_of_two_batches_are_corrupt_or_one_of_them(a, b, data):
    cut_a = data.draw(st.integers(min_value=0, max_value=len(a)))
    cut_b = data.draw(st.integers(min_value=0, max_value=len(b)))
    blob = a[:cut_a] + b[cut_b:]
    TRIED["splice"] += 1
    if blob in (a, b):
        assert _decodes_or_is_corrupt(blob)
    else:
        assert not _decodes_or_is_corrupt(blob)


@SETTINGS
@given(batches(), st.data())
def test_payload_edits_under_a_valid_checksum_decode_consistently_or_are_corrupt(blob, data):
    """The checksum is recomputed, so the decoder's own checks judge the edit: object
    rows that no longer parse are corrupt; any other bytes decode as their header says."""
    header, payload = unseal(blob)
    body = bytearray(payload)
    if body:
        pos = data.draw(st.integers(min_value=0, max_value=len(body) - 1))
        body[pos] = data.draw(st.integers(min_value=0, max_value=255))
    drop = data.draw(st.integers(min_value=0, max_value=2))
    if drop and body:
        del body[-drop:]  # the header no longer matches the payload size
    TRIED["resealed_payload"] += 1
    resealed = seal(header, [bytes(body)])
    ok = _decodes_or_is_corrupt(resealed)
    if drop and payload:
        assert not ok


@SETTINGS
@given(batches(), st.data())
def test_header_edits_under_a_valid_checksum_decode_consistently_or_are_corrupt(blob, data):
    header, payload = unseal(blob)
    raw = bytearray(msgpack.packb(header, use_bin_type=True))
    pos = data.draw(st.integers(min_value=0, max_value=len(raw) - 1))
    raw[pos] = data.draw(st.integers(min_value=0, max_value=255))
    try:
        edited = msgpack.unpackb(bytes(raw), raw=False, strict_map_key=False)
    except Exception:  # noqa: BLE001 - not a header any more: the frame check is tested above
        edited = bytes(raw)
    TRIED["resealed_header"] += 1
    _decodes_or_is_corrupt(seal(edited, [bytes(payload)]))  # raises anything but CorruptPayload
