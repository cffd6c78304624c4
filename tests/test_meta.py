"""KVBatchMeta: validation, and every view returns a new meta that shares nothing mutable."""

import pytest

from dataplane_client import KVBatchMeta
from dataplane_client.errors import InvalidBatch


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


def test_validation_names_what_is_wrong():
    with pytest.raises(InvalidBatch, match="tags has 1 entries for 2"):
        KVBatchMeta("p", sample_ids=["a", "b"], tags=[{}])
    with pytest.raises(InvalidBatch, match="sequence_lengths"):
        KVBatchMeta("p", sample_ids=["a"], sequence_lengths=[1, 2])
    with pytest.raises(InvalidBatch, match="partition_id"):
        KVBatchMeta("", sample_ids=["a"])
    with pytest.raises(InvalidBatch, match="str"):
        KVBatchMeta("p", sample_ids=[1])


def test_no_shared_mutable_defaults():
    a, b = KVBatchMeta("p"), KVBatchMeta("p")
    a.extra_info["x"] = 1
    a.sample_ids.append("z")
    assert b.extra_info == {} and b.sample_ids == []


def test_views_align_every_per_sample_list_and_copy_extra_info():
    m = _meta()
    sub = m.subset([4, 0])
    assert sub.sample_ids == ["s4", "s0"] and sub.sequence_lengths == [14, 10]
    assert sub.tags == [{"group_id": 2}, {"group_id": 0}]
    assert m.slice(1, 3).sample_ids == ["s1", "s2"]
    assert m.drop([0, 2]).sample_ids == ["s1", "s3", "s4"]
    assert m.with_fields(["a", "b"]).fields == ["a", "b"] and m.fields == ["input_ids"]
    stamped = m.stamp_tags({"step": 3})
    assert all(t["step"] == 3 for t in stamped.tags) and "step" not in m.tags[0]
    sub.extra_info["new"] = 1
    assert "new" not in m.extra_info
    assert m.size == 5 and len(m) == 5
    with pytest.raises(InvalidBatch, match="out of range"):
        m.subset([7])


def test_concat_keeps_order_and_refuses_mixing_partitions_or_duplicates():
    a, b = (
        _meta(3),
        KVBatchMeta("p", sample_ids=["x", "y"], sequence_lengths=[1, 2], fields=["input_ids"]),
    )
    c = a.concat(b)
    assert c.sample_ids == ["s0", "s1", "s2", "x", "y"]
    assert c.sequence_lengths == [10, 11, 12, 1, 2]
    assert c.tags[3:] == [{}, {}]
    with pytest.raises(InvalidBatch, match="different partitions"):
        a.concat(KVBatchMeta("q", sample_ids=["z"]))
    with pytest.raises(InvalidBatch, match="duplicate"):
        a.concat(a)
