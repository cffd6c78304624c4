"""materialize: the wire layout (dense / jagged / lists) becomes a padded or jagged BatchedDataDict."""

import doctest

import pytest
import torch

from dataplane_client.batching import materialize as materialize_module
from dataplane_client.batching.batched_data_dict import BatchedDataDict
from dataplane_client.batching.materialize import materialize
from dataplane_client.wire.errors import InvalidBatch


def _nt(rows):
    return torch.nested.nested_tensor(rows, layout=torch.jagged)


def test_doctests():
    res = doctest.testmod(materialize_module)
    assert res.attempted > 0
    assert res.failed == 0


def _wire():
    return {
        "input_ids": _nt([torch.tensor([1, 2, 3]), torch.tensor([4]), torch.tensor([5, 6])]),
        "input_lengths": torch.tensor([3, 1, 2]),
        "sample_mask": torch.tensor([1.0, 0.0, 1.0]),
        "logprobs": [torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0.4]), torch.tensor([0.5, 0.6])],
        "prompt": ["a", "b", "c"],
    }


def test_padded_layout_pads_jagged_fields_and_passes_the_rest():
    wire = _wire()
    out = materialize(wire, layout="padded", pad_value_dict={"input_ids": -1})
    assert isinstance(out, BatchedDataDict)
    assert list(out) == list(wire)
    assert out["input_ids"].tolist() == [[1, 2, 3], [4, -1, -1], [5, 6, -1]]
    assert out["input_ids"].dtype == torch.int64
    lp = out["logprobs"]
    assert lp.dtype == torch.float32
    assert lp.shape == (3, 3)
    assert torch.allclose(lp, torch.tensor([[0.1, 0.2, 0.3], [0.4, 0, 0], [0.5, 0.6, 0]]))
    assert out["input_lengths"] is wire["input_lengths"]  # dense passes through
    assert out["sample_mask"] is wire["sample_mask"]
    assert out["prompt"] == ["a", "b", "c"]
    assert out.size == 3


def test_pad_to_seqlen_is_a_lower_bound():
    wire = _wire()
    out = materialize(wire, pad_to_seqlen=6)
    assert out["input_ids"].shape == (3, 6)
    assert out["logprobs"].shape == (3, 6)
    assert out["input_ids"][0].tolist() == [1, 2, 3, 0, 0, 0]
    # smaller than the longest row: never truncates, the longest row wins
    out = materialize(wire, pad_to_seqlen=2)
    assert out["input_ids"].shape == (3, 3)
    assert out["input_ids"][0].tolist() == [1, 2, 3]
    with pytest.raises(InvalidBatch, match="pad_to_seqlen"):
        materialize(wire, pad_to_seqlen=-1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.bool, torch.int32, torch.float32])
def test_dtypes_preserved(dtype):
    rows = [torch.ones(2, dtype=dtype), torch.ones(4, dtype=dtype)]
    for value in (_nt(rows), rows):
        out = materialize({"x": value}, pad_to_seqlen=5)
        assert out["x"].dtype == dtype
        assert out["x"].shape == (2, 5)
        assert out["x"][0, :2].to(torch.float32).eq(1).all()
        assert out["x"][0, 2:].to(torch.float32).eq(0).all()


def test_multidim_rows_and_empty_rows():
    rows = [torch.ones(2, 4), torch.zeros(0, 4), torch.full((3, 4), 2.0)]
    out = materialize({"h": _nt(rows)}, pad_value_dict={"h": -1.0})
    assert out["h"].shape == (3, 3, 4)
    assert out["h"][0, :2].eq(1).all()
    assert out["h"][0, 2].eq(-1).all()
    assert out["h"][1].eq(-1).all()
    assert out["h"][2].eq(2).all()
    out = materialize({"h": rows})
    assert out["h"].shape == (3, 3, 4)


def test_jagged_layout_keeps_nested_tensors():
    wire = _wire()
    out = materialize(wire, layout="jagged", pad_to_seqlen=10)
    assert out["input_ids"] is wire["input_ids"]
    lp = out["logprobs"]
    assert lp.is_nested
    assert lp.layout == torch.jagged
    assert [r.tolist() for r in lp.unbind()] == [
        pytest.approx([0.1, 0.2, 0.3]),
        pytest.approx([0.4]),
        pytest.approx([0.5, 0.6]),
    ]
    assert out["prompt"] == ["a", "b", "c"]
    # the jagged result selects and slices like any other column
    assert [r.tolist() for r in out.select_indices([2])["input_ids"].unbind()] == [[5, 6]]


def test_bad_input_is_typed():
    with pytest.raises(InvalidBatch, match="unknown layout 'dense'"):
        materialize(_wire(), layout="dense")
    with pytest.raises(InvalidBatch, match="different numbers of samples"):
        materialize({"a": torch.ones(2), "b": [1, 2, 3]})
    with pytest.raises(InvalidBatch, match="mixes tensors"):
        materialize({"a": [torch.ones(1), 3]})
    with pytest.raises(InvalidBatch, match="only the first dim may vary"):
        materialize({"a": [torch.ones(1, 2), torch.ones(1, 3)]})
    with pytest.raises(InvalidBatch, match="only the first dim may vary"):
        materialize({"a": [torch.ones(1), torch.ones(1, dtype=torch.int64)]})
    with pytest.raises(InvalidBatch, match="unsupported field type"):
        materialize({"a": {"nested": "dict"}})
    with pytest.raises(InvalidBatch, match="0-d"):
        materialize({"a": torch.tensor(1.0)})
    with pytest.raises(InvalidBatch, match="mapping"):
        materialize([torch.ones(2)])


def test_empty_list_field_passes_through():
    out = materialize({"a": [], "b": torch.ones(0, 3)})
    assert out["a"] == []
    assert out["b"].shape == (0, 3)
