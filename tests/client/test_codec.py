"""The columnar jagged codec: exact round trips, enums and objects, and typed errors on bad input."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataplane_client.batching.batched_data_dict import BatchedDataDict
from dataplane_client.codec import fields as codec
from dataplane_client.codec.assembly import assemble
from dataplane_client.codec.fields import DTYPES, decode_field, encode_field, encode_fields
from dataplane_client.wire.byte_format import pack, unpack
from dataplane_client.wire.encoded import take_rows
from dataplane_client.wire.errors import (
    CorruptPayload,
    InvalidBatch,
    NonTensorField,
    SchemaConflict,
)

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


def _decode_all(encoded):
    return {name: decode_field(enc) for name, enc in encoded.items()}


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
                        st.text(max_size=40),
                        st.lists(st.integers(-(2**63), 2**64 - 1), max_size=3),
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
    if isinstance(value, list) and (not value or not isinstance(value[0], torch.Tensor)):
        assert got == value
        return
    if isinstance(value, list) or value.is_nested:
        rows = value if isinstance(value, list) else value.unbind()
        assert got.is_nested
        assert got.layout == torch.jagged
        assert len(got.unbind()) == len(rows)
        for a, b in zip(got.unbind(), rows):
            assert a.dtype == b.dtype
            assert a.shape == b.shape
            assert _bits(a) == _bits(b)
        return
    assert not got.is_nested
    assert got.dtype == value.dtype
    assert got.shape == value.shape
    assert _bits(got) == _bits(value)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_round_trip_is_bit_exact_through_the_byte_format(batch):
    n, fields = batch
    decoded = _decode_all(unpack(pack(encode_fields(fields, object_fields=list(fields)))))
    assert set(decoded) == set(fields)
    for name, value in fields.items():
        _assert_same(value, decoded[name])


@settings(max_examples=40, deadline=None)
@given(batches(), st.randoms(use_true_random=False))
def test_split_rows_reassemble_in_request_order(batch, rnd):
    """take_rows splits a batch the way a put splits it over units; assemble joins
    the parts back in request order the way a get does."""
    n, fields = batch
    enc = encode_fields(fields, object_fields=list(fields))
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
                assert _bits(x) == _bits(y)
                assert x.shape == y.shape
        else:
            assert _bits(direct) == _bits(again)


def test_dense_stays_dense_and_jagged_stays_jagged():
    dense = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    nt = torch.nested.nested_tensor(
        [torch.ones(2), torch.ones(5), torch.ones(1)], layout=torch.jagged
    )
    out = _decode_all(encode_fields({"d": dense, "j": nt}))
    assert not out["d"].is_nested
    assert torch.equal(out["d"], dense)
    assert out["j"].is_nested
    assert out["j"].layout == torch.jagged
    assert [r.shape[0] for r in out["j"].unbind()] == [2, 5, 1]


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_every_wire_dtype_round_trips_bit_exact_dense_and_jagged(dtype):
    dense = _rand((4, 3), dtype, seed=1)
    rows = [_rand((m, 2), dtype, seed=m) for m in (3, 0, 5)]
    out = _decode_all(unpack(pack(encode_fields({"d": dense}))))
    _assert_same(dense, out["d"])
    out = _decode_all(unpack(pack(encode_fields({"j": rows}))))
    _assert_same(rows, out["j"])


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
    with pytest.raises(InvalidBatch, match="mapping"):
        encode_fields([torch.zeros(2)])
    with pytest.raises(InvalidBatch, match="device 'meta'") as e:
        encode_field("m", torch.zeros(2, device="meta"))
    assert e.value.fields == ["m"]


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


# ---- non-tensor values: refused unless declared -----------------------------------------
@pytest.mark.parametrize(
    "value",
    [["a", "b"], [{"k": 1}, None], np.array(["a", "b"], dtype=object), np.array(["a", "b"]), "ab"],
    ids=["str-list", "dict-list", "object-ndarray", "str-ndarray", "bare-str"],
)
def test_undeclared_non_tensor_values_are_refused_naming_the_field(value):
    with pytest.raises(NonTensorField, match="non-tensor") as e:
        encode_fields({"ok": torch.zeros(2), "prompt": value})
    assert isinstance(e.value, TypeError)
    assert "prompt" in str(e.value)


def test_declared_object_fields_travel_as_msgpack_rows_that_split_and_rejoin():
    values = [{"k": [1, 2]}, "text", None, 3.5, [True, b"\x00"]]
    enc = encode_fields({"meta": values}, object_fields=["meta"])["meta"]
    assert enc.kind == codec.OBJECT
    assert enc.lengths.tolist() == [
        len(codec.object_columns.encode_rows("x", [v])[0]) for v in values
    ]
    assert decode_field(enc) == values
    assert decode_field(take_rows(enc, np.array([4, 0, 2]))) == [values[4], values[0], None]
    with pytest.raises(InvalidBatch, match="msgpack") as e:
        encode_fields({"meta": [object()]}, object_fields=["meta"])
    assert e.value.fields == ["meta"]


def test_object_rows_with_a_wrong_boundary_are_corrupt():
    enc = encode_fields({"o": ["ab", "cd"]}, object_fields=["o"])["o"]
    enc.lengths = np.array([2, 4])  # the bytes are intact; the row cut is not
    with pytest.raises(CorruptPayload):
        codec.object_columns.check_row_boundaries(enc.require_values(), enc.lengths)
    enc.values = enc.values[:-1].copy()
    with pytest.raises(CorruptPayload):
        decode_field(enc)


# ---- enums ------------------------------------------------------------------------------
def test_enum_fields_travel_as_int32_codes_and_come_back_as_strings():
    vocab = ["easy", "medium", "hard"]
    enc = encode_fields({"level": ["hard", "easy", "hard"]}, enums={"level": vocab})
    level = enc["level"]
    assert (level.kind, level.dtype, level.shape) == (codec.DENSE, "int32", ())
    codes = decode_field(level)
    assert codes.tolist() == [2, 0, 2]
    assert codec.enum_codes.to_strings("level", codes, tuple(vocab)) == ["hard", "easy", "hard"]


def test_enum_errors_name_the_field_and_the_value():
    with pytest.raises(InvalidBatch, match="'impossible'") as e:
        encode_fields({"level": ["easy", "impossible"]}, enums={"level": ["easy"]})
    assert e.value.fields == ["level"]
    with pytest.raises(InvalidBatch, match="str values"):
        encode_fields({"level": ["easy", 1]}, enums={"level": ["easy", "1"]})
    with pytest.raises(InvalidBatch, match="repeats"):
        encode_fields({"level": ["a"]}, enums={"level": ["a", "a"]})
    with pytest.raises(InvalidBatch, match="non-empty"):
        encode_fields({"level": ["a"]}, enums={"level": []})
    with pytest.raises(CorruptPayload, match="outside"):
        codec.enum_codes.to_strings("level", torch.tensor([3], dtype=torch.int32), ("a",))


def test_strings_that_numpy_would_truncate_stay_distinct():
    vocab = ["a", "a\x00"]  # fixed-width numpy strings drop trailing NULs
    codes = decode_field(encode_fields({"e": ["a\x00", "a"]}, enums={"e": vocab})["e"])
    assert codes.tolist() == [1, 0]


# ---- containers --------------------------------------------------------------------------
def test_a_tensordict_and_a_batched_data_dict_encode_like_the_dict():
    from tensordict import TensorDict

    from dataplane_client.codec.tensordict_io import to_tensordict

    nt = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
    plain = {"d": torch.arange(2), "j": nt}
    want = {k: (e.schema, e.values.tobytes()) for k, e in encode_fields(plain).items()}
    for container in (TensorDict(plain, batch_size=[2]), BatchedDataDict(plain)):
        got = {k: (e.schema, e.values.tobytes()) for k, e in encode_fields(container).items()}
        assert got == want
    td = to_tensordict({"d": torch.arange(2), "s": ["x", "y"]}, 2)
    enc = encode_fields(td, enums={"s": ["x", "y"]})
    assert decode_field(enc["s"]).tolist() == [0, 1]
    with pytest.raises(NonTensorField, match="non-tensor"):
        encode_fields(td)
