"""KVBatchMeta: NeMo-RL's seven fields and method semantics, and views that share nothing mutable."""

import dataclasses

import numpy as np
import pytest
import torch

from dataplane_client import KVBatchMeta
from dataplane_client.wire.errors import InvalidBatch


def _meta(n=5, **kw):
    return KVBatchMeta(
        partition_id="p",
        task_name="t",
        sample_ids=[f"s{i}" for i in range(n)],
        fields=["input_ids"],
        sequence_lengths=list(range(10, 10 + n)),
        extra_info={"k": [1]},
        tags=[{"group_id": i // 2} for i in range(n)],
        **kw,
    )


def test_exactly_the_seven_contract_fields_in_order():
    names = [f.name for f in dataclasses.fields(KVBatchMeta)]
    assert names == [
        "partition_id",
        "task_name",
        "sample_ids",
        "fields",
        "sequence_lengths",
        "extra_info",
        "tags",
    ]
    m = KVBatchMeta("p", "t", ["a"])
    assert (m.fields, m.sequence_lengths, m.tags, m.extra_info) == (None, None, None, {})


def test_validation_names_what_is_wrong():
    with pytest.raises(ValueError, match="align 1:1"):
        KVBatchMeta("p", None, ["a", "b"], tags=[{}])
    with pytest.raises(InvalidBatch, match="sequence_lengths"):
        KVBatchMeta("p", None, ["a"], sequence_lengths=[1, 2])
    with pytest.raises(InvalidBatch, match="partition_id"):
        KVBatchMeta("", None, ["a"])
    with pytest.raises(InvalidBatch, match="str"):
        KVBatchMeta("p", None, [1])


def test_no_shared_mutable_defaults():
    a, b = KVBatchMeta("p", None, []), KVBatchMeta("p", None, [])
    a.extra_info["x"] = 1
    a.sample_ids.append("z")
    assert b.extra_info == {}
    assert b.sample_ids == []


def test_views_align_every_per_sample_list_and_copy_extra_info():
    m = _meta()
    sub = m.subset([4, 0])
    assert sub.sample_ids == ["s4", "s0"]
    assert sub.sequence_lengths == [14, 10]
    assert sub.tags == [{"group_id": 2}, {"group_id": 0}]
    assert m.subset(torch.tensor([1, 3])).sample_ids == ["s1", "s3"]
    assert m.slice(1, 3).sample_ids == ["s1", "s2"]
    assert m.slice(1, 3).tags == [{"group_id": 0}, {"group_id": 1}]
    sub.extra_info["new"] = 1
    assert "new" not in m.extra_info
    assert m.size == 5
    assert len(m) == 5
    with pytest.raises(InvalidBatch, match="out of range"):
        m.subset([7])


def test_drop_is_the_complement_of_subset_and_none_when_all_rows_go():
    m = _meta()
    kept = m.drop([0, 2])
    assert kept.sample_ids == ["s1", "s3", "s4"]
    assert kept.sequence_lengths == [11, 13, 14]
    assert m.drop(np.arange(5)) is None
    assert m.drop([4, -5, 1, 2, 3]) is None
    with pytest.raises(InvalidBatch, match="out of range"):
        m.drop([5])


def test_with_fields_merges_without_repeats_in_order():
    m = _meta()
    assert m.with_fields(["a", "input_ids", "b", "a"]).fields == ["input_ids", "a", "b"]
    assert m.fields == ["input_ids"]
    assert KVBatchMeta("p", None, ["x"]).with_fields(["a"]).fields == ["a"]


@pytest.mark.parametrize(
    "values", [[1, 2, 3], torch.tensor([1, 2, 3]), np.array([1, 2, 3])], ids=type
)
def test_stamp_tags_writes_per_row_values_in_place(values):
    m = KVBatchMeta("p", None, ["a", "b", "c"], tags=[{"g": 0}, {"g": 0}, {"g": 1}])
    assert m.stamp_tags({"reward": values}) is None
    assert m.tags == [{"g": 0, "reward": 1}, {"g": 0, "reward": 2}, {"g": 1, "reward": 3}]
    assert all(type(t["reward"]) is int for t in m.tags)  # plain Python, not 0-dim tensors


def test_stamp_tags_initialises_tags_and_rejects_wrong_lengths_atomically():
    m = KVBatchMeta("p", None, ["a", "b"])
    m.stamp_tags({"step": [7, 7]})
    assert m.tags == [{"step": 7}, {"step": 7}]
    for bad in ([1], torch.zeros(3), 5, "ab", torch.zeros(2, 1)):
        with pytest.raises(ValueError, match="step2"):
            m.stamp_tags({"ok": [0, 0], "step2": bad})
    assert m.tags == [{"step": 7}, {"step": 7}]  # nothing written by a rejected call


def test_stamping_a_view_never_edits_its_source():
    m = _meta(3)
    view = m.subset([0, 1, 2])
    view.stamp_tags({"x": [1, 2, 3]})
    assert all("x" not in t for t in m.tags)


def test_concat_keeps_order_and_refuses_mixing_partitions_or_duplicates():
    a = _meta(3)
    b = KVBatchMeta("p", "t", ["x", "y"], fields=["input_ids"], sequence_lengths=[1, 2])
    c = a.concat(b)
    assert c.sample_ids == ["s0", "s1", "s2", "x", "y"]
    assert c.sequence_lengths == [10, 11, 12, 1, 2]
    assert c.tags is None  # b has no tags: none are invented
    assert c.fields == ["input_ids"]
    both = a.concat(_meta(5).slice(3, 5))
    assert both.tags == [{"group_id": 0}, {"group_id": 0}, {"group_id": 1}, *_meta(5).tags[3:]]
    assert a.concat(KVBatchMeta("p", None, ["z"])).sequence_lengths is None
    with pytest.raises(ValueError, match="partition_ids must match"):
        a.concat(KVBatchMeta("q", None, ["z"]))
    with pytest.raises(InvalidBatch, match="duplicate"):
        a.concat(a)
