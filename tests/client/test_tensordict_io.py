"""TensorDict in and out: decoded fields become a TensorDict of n rows, and puts accept one."""

import pytest
import torch
from tensordict import TensorDict

from dataplane_client.batching.batched_data_dict import BatchedDataDict
from dataplane_client.batching.materialize import materialize
from dataplane_client.codec.fields import decode_field, encode_fields
from dataplane_client.codec.tensordict_io import as_field_mapping, to_tensordict
from dataplane_client.wire.errors import InvalidBatch

VOCAB = ("easy", "hard")


def _decoded():
    """What a get decodes: dense, jagged, enum codes and objects, for 3 rows."""
    encoded = encode_fields(
        {
            "mask": torch.tensor([1.0, 0.0, 1.0]),
            "input_ids": [torch.tensor([1, 2, 3]), torch.tensor([4]), torch.tensor([5, 6])],
            "level": ["hard", "easy", "hard"],
            "info": [{"k": 1}, "x", None],
        },
        enums={"level": VOCAB},
        object_fields=["info"],
    )
    return {name: decode_field(enc) for name, enc in encoded.items()}


def test_fields_keep_their_kind_in_a_tensordict_of_n_rows():
    td = to_tensordict(_decoded(), 3, enums={"level": VOCAB})
    assert isinstance(td, TensorDict)
    assert td.batch_size == torch.Size([3])
    assert not td["mask"].is_nested
    assert td["mask"].tolist() == [1.0, 0.0, 1.0]
    ids = td["input_ids"]
    assert ids.is_nested
    assert ids.layout == torch.jagged
    assert [r.tolist() for r in ids.unbind()] == [[1, 2, 3], [4], [5, 6]]
    assert td.get("level").tolist() == ["hard", "easy", "hard"]
    assert td.get("info").tolist() == [{"k": 1}, "x", None]


def test_rows_select_and_move_with_every_field():
    td = to_tensordict(_decoded(), 3, enums={"level": VOCAB})
    picked = td[torch.tensor([2, 0])]
    assert picked.batch_size == torch.Size([2])
    assert [r.tolist() for r in picked["input_ids"].unbind()] == [[5, 6], [1, 2, 3]]
    assert picked.get("level").tolist() == ["hard", "hard"]
    assert picked.get("info").tolist() == [None, {"k": 1}]
    moved = td.to("cpu")
    assert moved["input_ids"].is_nested
    assert moved.get("info").tolist() == [{"k": 1}, "x", None]


def test_zero_rows_make_an_empty_tensordict():
    empty = to_tensordict({"mask": torch.zeros(0), "info": []}, 0)
    assert empty.batch_size == torch.Size([0])
    assert empty.get("info").tolist() == []


def test_field_mappings_from_every_container_agree():
    td = to_tensordict(_decoded(), 3, enums={"level": VOCAB})
    from_td = as_field_mapping(td)
    assert from_td["level"] == ["hard", "easy", "hard"]
    assert from_td["info"] == [{"k": 1}, "x", None]
    assert from_td["input_ids"].is_nested
    plain = {"a": torch.ones(2), "b": ["x", "y"]}
    assert as_field_mapping(plain) == plain
    assert as_field_mapping(BatchedDataDict(plain)) == plain
    with pytest.raises(InvalidBatch, match="mapping"):
        as_field_mapping([torch.ones(2)])
    nested = TensorDict({"sub": TensorDict({"x": torch.ones(2)}, [2])}, batch_size=[2])
    with pytest.raises(InvalidBatch, match="flatten") as e:
        as_field_mapping(nested)
    assert e.value.fields == ["sub"]


def test_a_fetched_tensordict_round_trips_through_a_put():
    td = to_tensordict(_decoded(), 3, enums={"level": VOCAB})
    again = encode_fields(td, enums={"level": VOCAB}, object_fields=["info"])
    back = to_tensordict(
        {name: decode_field(enc) for name, enc in again.items()}, 3, enums={"level": VOCAB}
    )
    assert back.get("level").tolist() == td.get("level").tolist()
    assert back.get("info").tolist() == td.get("info").tolist()
    assert torch.equal(back["input_ids"].values(), td["input_ids"].values())


def test_materialize_pads_a_tensordict_and_keeps_its_strings():
    td = to_tensordict(_decoded(), 3, enums={"level": VOCAB})
    out = materialize(td, layout="padded", pad_value_dict={"input_ids": -1})
    assert isinstance(out, BatchedDataDict)
    assert out["input_ids"].tolist() == [[1, 2, 3], [4, -1, -1], [5, 6, -1]]
    assert out["level"] == ["hard", "easy", "hard"]
    assert out["mask"].tolist() == [1.0, 0.0, 1.0]
    jagged = materialize(td, layout="jagged")
    assert jagged["input_ids"].is_nested
