"""shard_meta_for_dp: the driver's key-list split equals shard_by_batch_size on real data, and its unsorted_indices restore order."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dataplane_client.batching.batched_data_dict import BatchedDataDict
from dataplane_client.batching.packing import PACKING_ALGORITHMS
from dataplane_client.batching.preshard import (
    ELEM_COUNTS_PER_GB,
    GLOBAL_FORWARD_PAD_SEQLEN,
    MICRO_BATCH_INDICES,
    MICRO_BATCH_LENGTHS,
    global_forward_pad_seqlen,
    plan_dp_shards,
    shard_meta_for_dp,
)
from dataplane_client.wire.errors import InvalidBatch
from dataplane_client.wire.meta import KVBatchMeta

MODES = ["none", "dynamic", "packing"]


def _meta(lengths, **extra):
    return KVBatchMeta(
        partition_id="p",
        task_name="logprobs",
        sample_ids=[f"s{i}" for i in range(len(lengths))],
        fields=["input_ids", "input_lengths"],
        sequence_lengths=list(lengths),
        extra_info=dict(extra),
    )


def _batch(lengths):
    """Real tensors for ``lengths``: row i holds i+1 in its first lengths[i] tokens."""
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = i + 1
    return BatchedDataDict(
        {
            "input_ids": ids,
            "input_lengths": torch.tensor(lengths),
            "sid": [f"s{i}" for i in range(len(lengths))],
        }
    )


def _args(
    mode,
    max_tokens,
    algorithm="first_fit_decreasing",
    pad_multiple=1,
    round_to=1,
    microbatch_order="packer",
):
    if mode == "dynamic":
        return {
            "dynamic_batching_args": {
                "max_tokens_per_microbatch": max_tokens,
                "sequence_length_round": round_to,
                "input_key": "input_ids",
                "input_lengths_key": "input_lengths",
            }
        }
    if mode == "packing":
        return {
            "sequence_packing_args": {
                "max_tokens_per_microbatch": max_tokens,
                "input_key": "input_ids",
                "input_lengths_key": "input_lengths",
                "algorithm": algorithm,
                "sequence_length_pad_multiple": pad_multiple,
                "microbatch_order": microbatch_order,
            }
        }
    return {}


@st.composite
def _case(draw):
    mode = draw(st.sampled_from(MODES))
    dp = draw(st.integers(1, 4))
    num_chunks = draw(st.integers(1, 3))
    if mode == "packing":
        per_chunk = draw(st.integers(1, 12))  # packing needs no multiple of dp
    else:
        per_chunk = dp * draw(st.integers(1, 4))
    n = per_chunk * num_chunks
    lengths = draw(st.lists(st.integers(1, 40), min_size=n, max_size=n))
    use_batch_size = num_chunks > 1 or draw(st.booleans())
    pad_multiple = draw(st.sampled_from([1, 2, 4]))
    round_to = draw(st.sampled_from([1, 4, 8]))
    # large enough for every (padded) sample
    max_tokens = draw(st.integers(48, 160))
    algorithm = draw(st.sampled_from(sorted(PACKING_ALGORITHMS)))
    order = draw(st.sampled_from(["packer", "largest_first"]))
    return dict(
        mode=mode,
        dp=dp,
        lengths=lengths,
        batch_size=per_chunk if use_batch_size else None,
        kwargs=_args(mode, max_tokens, algorithm, pad_multiple, round_to, order),
    )


@settings(max_examples=120, deadline=None)
@given(case=_case())
def test_preshard_matches_shard_by_batch_size_and_restores_order(case):
    lengths, dp, bs, kwargs = case["lengths"], case["dp"], case["batch_size"], case["kwargs"]
    meta = _meta(lengths, keep="me", micro_batch_indices="stale")
    before = copy.deepcopy(meta)

    metas, unsorted = shard_meta_for_dp(meta, dp_world=dp, batch_size=bs, **kwargs)

    # purity
    assert meta == before
    assert len(metas) == dp

    # the contract: reorder_data(unsorted) on the rank-ordered rows restores meta order
    concat = [s for m in metas for s in m.sample_ids]
    assert sorted(concat) == sorted(meta.sample_ids)
    if unsorted is None:
        assert concat == meta.sample_ids
    else:
        assert concat != meta.sample_ids
        rows = BatchedDataDict({"sid": list(concat), "n": torch.arange(len(concat))})
        rows.reorder_data(unsorted)
        assert rows["sid"] == meta.sample_ids
        assert [concat[j] for j in rows["n"].tolist()] == meta.sample_ids

    # same split as the in-memory path on real tensors
    result = _batch(lengths).shard_by_batch_size(dp, batch_size=bs, **kwargs)
    if case["mode"] == "none":
        shards = result
    else:
        shards, sbs_unsorted = result
        assert sbs_unsorted == (unsorted if unsorted is not None else list(range(len(lengths))))
    for m, shard in zip(metas, shards, strict=True):
        assert m.sample_ids == shard["sid"]
        assert m.sequence_lengths == shard["input_lengths"].tolist()
        assert m.partition_id == "p"
        assert m.extra_info["keep"] == "me"
        if case["mode"] == "none":
            assert not any(k in m.extra_info for k in (MICRO_BATCH_INDICES, ELEM_COUNTS_PER_GB))
            assert shard.micro_batch_indices is None
        else:
            assert m.extra_info[MICRO_BATCH_INDICES] == shard.micro_batch_indices
            assert m.extra_info[MICRO_BATCH_LENGTHS] == shard.micro_batch_lengths
        if case["mode"] == "packing":
            assert m.extra_info[ELEM_COUNTS_PER_GB] == shard.elem_counts_per_gb
        else:
            assert ELEM_COUNTS_PER_GB not in m.extra_info

    if case["mode"] != "none":
        _check_microbatches(case, metas)


def _check_microbatches(case, metas):
    args = next(iter(case["kwargs"].values()))
    max_tokens = args["max_tokens_per_microbatch"]
    num_chunks = len(case["lengths"]) // (case["batch_size"] or len(case["lengths"]))
    for m in metas:
        assert len(m.extra_info[MICRO_BATCH_INDICES]) == num_chunks
    # every rank has the same number of microbatches in every chunk
    for c in range(num_chunks):
        assert len({len(m.extra_info[MICRO_BATCH_INDICES][c]) for m in metas}) == 1
    if case["mode"] == "dynamic":
        first = metas[0].extra_info[MICRO_BATCH_INDICES]
        assert all(m.extra_info[MICRO_BATCH_INDICES] == first for m in metas)
        for m in metas:
            for idx, lens in zip(
                m.extra_info[MICRO_BATCH_INDICES], m.extra_info[MICRO_BATCH_LENGTHS], strict=True
            ):
                for (s, e), L in zip(idx, lens, strict=True):
                    assert (e - s) * L <= max_tokens
        return
    pad = args["sequence_length_pad_multiple"]
    for m in metas:
        pos = 0
        for c, (idx, lens) in enumerate(
            zip(m.extra_info[MICRO_BATCH_INDICES], m.extra_info[MICRO_BATCH_LENGTHS], strict=True)
        ):
            assert m.extra_info[ELEM_COUNTS_PER_GB][c] == (idx[-1][1] if idx else 0)
            end = 0
            for (s, e), total in zip(idx, lens, strict=True):
                assert s == end, "bins are contiguous row ranges"
                end = e
                rows = m.sequence_lengths[pos + s : pos + e]
                assert total == sum(-(-x // pad) * pad for x in rows) <= max_tokens
            pos += end
        assert pos == m.size


def test_dynamic_batching_with_several_chunks_restores_order():
    # the case the published reference gets wrong: chunking + sorting
    lengths = [9, 1, 8, 2, 7, 3, 6, 4]
    meta = _meta(lengths)
    metas, unsorted = shard_meta_for_dp(
        meta, dp_world=2, batch_size=4, **_args("dynamic", max_tokens=64)
    )
    # each chunk sorted by length, then dealt out strided over the two ranks
    assert [m.sample_ids for m in metas] == [["s1", "s2", "s5", "s6"], ["s3", "s0", "s7", "s4"]]
    assert unsorted == [1, 2, 5, 6, 3, 0, 7, 4]
    rows = BatchedDataDict({"sid": [s for m in metas for s in m.sample_ids]})
    rows.reorder_data(unsorted)
    assert rows["sid"] == meta.sample_ids


def test_plain_split_is_identity_or_interleaved():
    meta = _meta([5] * 8)
    metas, unsorted = shard_meta_for_dp(meta, dp_world=2)
    assert unsorted is None
    assert [m.sample_ids for m in metas] == [["s0", "s1", "s2", "s3"], ["s4", "s5", "s6", "s7"]]
    metas, unsorted = shard_meta_for_dp(meta, dp_world=2, batch_size=4)
    assert [m.sample_ids for m in metas] == [["s0", "s1", "s4", "s5"], ["s2", "s3", "s6", "s7"]]
    assert unsorted == [0, 1, 4, 5, 2, 3, 6, 7]
    metas, _ = shard_meta_for_dp(_meta([5] * 5), dp_world=2, allow_uneven_shards=True)
    assert [m.size for m in metas] == [3, 2]
    # no lengths needed without packing / dynamic batching
    bare = KVBatchMeta(partition_id="p", sample_ids=["a", "b"])
    metas, unsorted = shard_meta_for_dp(bare, dp_world=2)
    assert [m.sample_ids for m in metas] == [["a"], ["b"]]
    assert unsorted is None


def test_packing_metadata_in_extra_info():
    lengths = [10, 3, 7, 2, 9, 5, 1, 6]
    metas, unsorted = shard_meta_for_dp(
        _meta(lengths), dp_world=2, **_args("packing", max_tokens=12, pad_multiple=2)
    )
    assert unsorted is not None
    for m in metas:
        assert set(m.extra_info) == {MICRO_BATCH_INDICES, MICRO_BATCH_LENGTHS, ELEM_COUNTS_PER_GB}
        assert m.extra_info[ELEM_COUNTS_PER_GB] == [m.size]
        assert len(m.extra_info[MICRO_BATCH_INDICES]) == 1
    n_bins = [len(m.extra_info[MICRO_BATCH_INDICES][0]) for m in metas]
    assert n_bins[0] == n_bins[1]
    totals = [sum(m.extra_info[MICRO_BATCH_LENGTHS][0]) for m in metas]
    assert sum(totals) == sum(-(-x // 2) * 2 for x in lengths)


def test_largest_first_orders_each_ranks_microbatches_by_tokens():
    lengths = [10, 3, 7, 2, 9, 5, 1, 6, 4, 8, 2, 2]
    metas, _ = shard_meta_for_dp(
        _meta(lengths), dp_world=2, **_args("packing", 12, microbatch_order="largest_first")
    )
    for m in metas:
        totals = m.extra_info[MICRO_BATCH_LENGTHS][0]
        assert totals == sorted(totals, reverse=True)
        for (start, end), total in zip(m.extra_info[MICRO_BATCH_INDICES][0], totals):
            assert sum(m.sequence_lengths[start:end]) == total
    with pytest.raises(ValueError, match="microbatch_order"):
        shard_meta_for_dp(_meta(lengths), dp_world=2, **_args("packing", 12, microbatch_order=1))


def test_errors_are_typed():
    meta = KVBatchMeta(partition_id="p", sample_ids=["a", "b"])
    with pytest.raises(InvalidBatch, match="sequence packing needs meta.sequence_lengths"):
        shard_meta_for_dp(meta, dp_world=2, **_args("packing", 64))
    with pytest.raises(InvalidBatch, match="dynamic batching needs meta.sequence_lengths"):
        shard_meta_for_dp(meta, dp_world=2, **_args("dynamic", 64))
    m = _meta([4, 4])
    with pytest.raises(InvalidBatch, match="mutually exclusive"):
        shard_meta_for_dp(m, dp_world=2, **_args("packing", 64), **_args("dynamic", 64))
    with pytest.raises(InvalidBatch, match="shards must be an int >= 1"):
        shard_meta_for_dp(m, dp_world=0)
    with pytest.raises(InvalidBatch, match="not a multiple of shards"):
        shard_meta_for_dp(_meta([4, 4, 4]), dp_world=2)
    with pytest.raises(InvalidBatch, match="not a multiple of batch_size"):
        shard_meta_for_dp(_meta([4] * 6), dp_world=2, batch_size=4)
    with pytest.raises(InvalidBatch, match="empty batch"):
        shard_meta_for_dp(KVBatchMeta(partition_id="p"), dp_world=2)
    with pytest.raises(InvalidBatch, match="unknown sequence packing algorithm"):
        shard_meta_for_dp(m, dp_world=2, **_args("packing", 64, algorithm="magic"))
    with pytest.raises(InvalidBatch, match="sample 1 has sequence length 70"):
        shard_meta_for_dp(_meta([4, 70]), dp_world=2, **_args("packing", 64))
    with pytest.raises(InvalidBatch, match="exceeds max_tokens_per_microbatch=64"):
        shard_meta_for_dp(_meta([4, 70]), dp_world=2, **_args("dynamic", 64))
    with pytest.raises(InvalidBatch, match="missing required key 'max_tokens_per_microbatch'"):
        shard_meta_for_dp(m, dp_world=2, sequence_packing_args={"algorithm": "concatenative"})
    with pytest.raises(InvalidBatch, match="KVBatchMeta"):
        shard_meta_for_dp({"sample_ids": []}, dp_world=1)


def test_global_forward_pad_seqlen():
    assert GLOBAL_FORWARD_PAD_SEQLEN == "global_forward_pad_seqlen"
    metas, _ = shard_meta_for_dp(_meta([3, 17, 5, 9]), dp_world=2)
    assert global_forward_pad_seqlen(metas) == 17
    assert global_forward_pad_seqlen(metas, multiple=8) == 24
    assert global_forward_pad_seqlen([]) == 0
    with pytest.raises(InvalidBatch, match="sequence_lengths"):
        global_forward_pad_seqlen([KVBatchMeta(partition_id="p", sample_ids=["a"])])
    with pytest.raises(InvalidBatch, match="multiple"):
        global_forward_pad_seqlen(metas, multiple=0)


def test_plan_unsorted_is_concatenation_of_rank_rows():
    plan = plan_dp_shards(6, [3, 1, 2, 6, 5, 4], shards=2, **_args("dynamic", 64))
    assert plan.rank_rows == [[1, 0, 4], [2, 5, 3]]
    assert plan.unsorted_indices == [1, 0, 4, 2, 5, 3]
