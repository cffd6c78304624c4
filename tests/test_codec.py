"""The columnar jagged wire format: exact round trips, and typed errors on damaged input."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataplane_client.codec import (
    DTYPES,
    decode_field,
    decode_fields,
    encode_field,
    encode_fields,
    pack,
    take_rows,
    unpack,
)
from dataplane_client.errors import CorruptPayload, InvalidBatch, SchemaConflict
from dataplane_client.transport import assemble

TRAINING_DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.bool,
]


def _rand(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    return torch.randint(-(2**20), 2**20, shape, generator=g).to(dtype)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


@st.composite
def batches(draw):
    n = draw(st.integers(1, 12))
    fields = {}
    for k in range(draw(st.integers(1, 4))):
        dtype = draw(st.sampled_from(TRAINING_DTYPES))
        inner = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
        seed = draw(st.integers(0, 1000))
        kind = draw(st.sampled_from(["dense", "jagged", "nested", "object"]))
        if kind == "dense":
            fields[f"f{k}"] = _rand((n, *inner), dtype, seed)
        elif kind == "object":
            fields[f"f{k}"] = draw(
                st.lists(
                    st.one_of(
                        st.integers(-5, 5),
                        st.text(max_size=4),
                        st.dictionaries(
                            st.text(max_size=2), st.floats(allow_nan=False), max_size=2
                        ),
                    ),
                    min_size=n,
                    max_size=n,
                )
            )
        else:
            lengths = draw(
                st.lists(st.integers(0 if kind == "jagged" else 1, 9), min_size=n, max_size=n)
            )
            rows = [_rand((m, *inner), dtype, seed + i) for i, m in enumerate(lengths)]
            fields[f"f{k}"] = (
                torch.nested.nested_tensor(rows, layout=torch.jagged) if kind == "nested" else rows
            )
    return n, fields


def _assert_same(value, got):
    if isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
        value = (
            torch.nested.nested_tensor(value, layout=torch.jagged)
            if all(v.numel() for v in value)
            else value
        )
    if isinstance(value, list) and (not value or not isinstance(value[0], torch.Tensor)):
        assert got == value
        return
    if isinstance(value, list):  # jagged with empty rows
        rows = got.unbind()
        assert len(rows) == len(value)
        for a, b in zip(rows, value):
            assert a.dtype == b.dtype and a.shape == b.shape and _bits(a) == _bits(b)
        return
    if value.is_nested:
        assert got.is_nested and got.layout == torch.jagged and got.dtype == value.dtype
        for a, b in zip(got.unbind(), value.unbind()):
            assert a.shape == b.shape and _bits(a) == _bits(b)
        return
    assert not got.is_nested and got.dtype == value.dtype and got.shape == value.shape
    assert _bits(got) == _bits(value)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_round_trip_is_bit_exact_through_the_byte_format(batch):
    n, fields = batch
    decoded = decode_fields(unpack(pack(encode_fields(fields))))
    assert set(decoded) == set(fields)
    for name, value in fields.items():
        _assert_same(value, decoded[name])


@settings(max_examples=40, deadline=None)
@given(batches(), st.randoms(use_true_random=False))
def test_split_rows_reassemble_in_request_order(batch, rnd):
    """take_rows splits a batch the way a put splits it over units; assemble joins
    the parts back in request order the way a get does."""
    n, fields = batch
    enc = encode_fields(fields)
    perm = list(range(n))
    rnd.shuffle(perm)
    cut = rnd.randint(0, n)
    for e in enc.values():
        a, b = (
            take_rows(e, np.array(perm[:cut], dtype=np.int64)),
            take_rows(e, np.array(perm[cut:], dtype=np.int64)),
        )
        # order[j] = position in (a ++ b) of original row j
        order = np.argsort(np.array(perm))
        direct = decode_field(e, writable=True)
        again = assemble([a, b], order)
        if isinstance(direct, list):
            assert again == direct
        elif direct.is_nested:
            for x, y in zip(direct.unbind(), again.unbind()):
                assert _bits(x) == _bits(y) and x.shape == y.shape
        else:
            assert _bits(direct) == _bits(again)


@settings(max_examples=150, deadline=None)
@given(batches(), st.data())
def test_truncated_or_corrupted_bytes_raise_corrupt_payload(batch, data):
    n, fields = batch
    blob = bytearray(pack(encode_fields(fields)))
    how = data.draw(st.sampled_from(["truncate", "flip", "garbage"]))
    if how == "truncate":
        blob = blob[: data.draw(st.integers(0, len(blob) - 1))]
    elif how == "flip":
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i] ^= 1 << data.draw(st.integers(0, 7))
    else:
        blob = bytearray(data.draw(st.binary(max_size=64)))
    try:
        decoded = unpack(bytes(blob))
    except CorruptPayload:
        return
    # A flip that survives every check must have landed where it changes nothing we decode
    # (msgpack allows some equivalent encodings); the result must still be internally consistent.
    for name, enc in decoded.items():
        enc.validate(name)


def test_dense_stays_dense_and_jagged_stays_jagged():
    dense = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    nt = torch.nested.nested_tensor(
        [torch.ones(2), torch.ones(5), torch.ones(1)], layout=torch.jagged
    )
    out = decode_fields(encode_fields({"d": dense, "j": nt}))
    assert not out["d"].is_nested and torch.equal(out["d"], dense)
    assert out["j"].is_nested and out["j"].layout == torch.jagged
    assert [r.shape[0] for r in out["j"].unbind()] == [2, 5, 1]


def test_every_training_dtype_is_on_the_wire():
    for dt in TRAINING_DTYPES:
        assert dt in DTYPES.values()


def test_bad_inputs_are_typed_errors_naming_the_field():
    with pytest.raises(InvalidBatch) as e:
        encode_field("x", torch.tensor(3.0))
    assert e.value.fields == ["x"]
    with pytest.raises(InvalidBatch):
        encode_field("c", torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(SchemaConflict):
        encode_field("j", [torch.zeros(2), torch.zeros(2, dtype=torch.int64)])
    with pytest.raises(SchemaConflict):
        encode_field("j", [torch.zeros(2, 3), torch.zeros(2, 4)])
    with pytest.raises(InvalidBatch, match="rows"):
        encode_fields({"a": torch.zeros(2), "b": torch.zeros(3)})
    with pytest.raises(InvalidBatch):
        encode_fields({})


def test_non_contiguous_and_sliced_inputs_encode_their_logical_values():
    base = torch.arange(24.0).reshape(4, 6)
    t = base[:, ::2]
    assert torch.equal(decode_field(encode_field("t", t)), t)
    # A jagged view whose offsets do not start at 0 (a window into a larger values buffer).
    sub = torch.nested.nested_tensor_from_jagged(
        torch.arange(10.0), offsets=torch.tensor([3, 7, 9])
    )
    got = decode_field(encode_field("s", sub))
    assert [r.tolist() for r in got.unbind()] == [[3, 4, 5, 6], [7, 8]]
