"""Sequence packing: every algorithm places each item once within capacity, bin counts fit DP, ranks balance."""

import doctest
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataplane_client.batching import packing
from dataplane_client.batching.packing import (
    PACKING_ALGORITHMS,
    PackingAlgorithm,
    assign_bins_to_ranks,
    concatenative,
    first_fit_decreasing,
    first_fit_shuffle,
    get_packer,
    modified_first_fit_decreasing,
    round_robin_assign,
)
from dataplane_client.batching.preshard import plan_dp_shards
from dataplane_client.wire.errors import InvalidBatch

ALGOS = sorted(PACKING_ALGORITHMS)


def test_doctests():
    res = doctest.testmod(packing)
    assert res.attempted > 0
    assert res.failed == 0


def _check_bins(bins, lengths, capacity, min_bin_count=0, multiple=1):
    placed = sorted(i for b in bins for i in b)
    assert placed == list(range(len(lengths))), "every item exactly once"
    for b in bins:
        assert sum(lengths[i] for i in b) <= capacity
    assert len(bins) >= min_bin_count
    assert len(bins) % multiple == 0
    if any(not b for b in bins):
        # empty bins only when there was nothing left to split
        assert all(len(b) <= 1 for b in bins)
        assert len(lengths) < len(bins)


@pytest.mark.parametrize("algo", ALGOS)
@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    capacity=st.integers(1, 100),
    min_bin_count=st.integers(0, 12),
    multiple=st.integers(1, 8),
    seed=st.integers(0, 5),
)
def test_every_item_once_within_capacity(algo, data, capacity, min_bin_count, multiple, seed):
    lengths = data.draw(st.lists(st.integers(0, capacity), max_size=60))
    fn = PACKING_ALGORITHMS[algo]
    bins = fn(
        lengths, capacity, min_bin_count=min_bin_count, bin_count_multiple=multiple, seed=seed
    )
    _check_bins(bins, lengths, capacity, min_bin_count, multiple)
    # without count constraints there is never an empty bin, and never more
    # than one bin per item
    plain = fn(lengths, capacity, seed=seed)
    _check_bins(plain, lengths, capacity)
    assert all(plain)
    assert len(plain) <= len(lengths)
    # packing lower bound
    assert len(plain) >= math.ceil(sum(lengths) / capacity)


@pytest.mark.parametrize("algo", ALGOS)
def test_bin_count_grows_by_splitting_not_empty_bins(algo):
    lengths = [1] * 10  # everything fits into one bin
    bins = PACKING_ALGORITHMS[algo](lengths, 100, min_bin_count=4, bin_count_multiple=4)
    assert len(bins) == 4
    assert all(bins)
    assert sorted(len(b) for b in bins) == [2, 2, 3, 3]  # largest bins split in halves
    # more bins required than items: the extra bins are empty (documented)
    bins = PACKING_ALGORITHMS[algo]([5, 5, 5], 100, min_bin_count=4)
    assert sorted(len(b) for b in bins) == [0, 1, 1, 1]
    # no items at all
    assert PACKING_ALGORITHMS[algo]([], 100) == []
    assert PACKING_ALGORITHMS[algo]([], 100, min_bin_count=2) == [[], []]


@pytest.mark.parametrize("algo", ALGOS)
def test_item_longer_than_capacity_is_named(algo):
    with pytest.raises(InvalidBatch, match="item 2 has length 11") as ei:
        PACKING_ALGORITHMS[algo]([3, 4, 11, 2], 10)
    assert ei.value.ids == [2]
    with pytest.raises(InvalidBatch, match="negative"):
        PACKING_ALGORITHMS[algo]([3, -1], 10)
    with pytest.raises(InvalidBatch, match="capacity"):
        PACKING_ALGORITHMS[algo]([3], 0)
    with pytest.raises(InvalidBatch, match="bin_count_multiple"):
        PACKING_ALGORITHMS[algo]([3], 10, bin_count_multiple=0)


def test_the_algorithms_are_nemo_rls_enum():
    assert {a.name: a.value for a in PackingAlgorithm} == {
        "CONCATENATIVE": "concatenative",
        "FIRST_FIT_DECREASING": "first_fit_decreasing",
        "FIRST_FIT_SHUFFLE": "first_fit_shuffle",
        "MODIFIED_FIRST_FIT_DECREASING": "modified_first_fit_decreasing",
    }
    assert set(PACKING_ALGORITHMS) == set(PackingAlgorithm)


@pytest.mark.parametrize("algo", ALGOS)
def test_get_packer_packs_like_its_algorithm_by_enum_or_name(algo):
    lengths = [(i * 37) % 50 + 1 for i in range(40)]
    want = PACKING_ALGORITHMS[algo](lengths, 100, min_bin_count=6, bin_count_multiple=4)
    for key in (algo, algo.value):
        packer = get_packer(key, 100, min_bin_count=6, bin_count_multiple=4)
        assert packer.pack(lengths) == want
    _check_bins(get_packer(algo, 100).pack(lengths), lengths, 100)


def test_unset_constraints_stay_none_as_nemo_rl_keeps_them():
    packer = get_packer("first_fit_decreasing", 10)
    assert packer.min_bin_count is None
    assert packer.bin_count_multiple is None
    assert packer.pack([7, 5, 3]) == [[0, 2], [1]]  # None means no constraint
    set_ = get_packer("first_fit_decreasing", 10, min_bin_count=3, bin_count_multiple=2)
    assert (set_.min_bin_count, set_.bin_count_multiple) == (3, 2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"bin_capacity": 0}, "capacity"),
        ({"bin_capacity": -4}, "capacity"),
        ({"bin_capacity": 2.5}, "capacity"),
        ({"bin_capacity": True}, "capacity"),
        ({"min_bin_count": -1}, "min_bin_count"),
        ({"min_bin_count": 1.0}, "min_bin_count"),
        ({"bin_count_multiple": 0}, "bin_count_multiple"),
        ({"algorithm": "best_fit"}, "unknown sequence packing algorithm 'best_fit'"),
    ],
)
def test_invalid_constraints_are_value_errors_at_construction(kwargs, match):
    args = {"algorithm": PackingAlgorithm.FIRST_FIT_DECREASING, "bin_capacity": 10, **kwargs}
    with pytest.raises(ValueError, match=match) as ei:
        get_packer(**args)
    if "algorithm" in kwargs:
        for name in ALGOS:
            assert name.value in str(ei.value)


def test_first_fit_decreasing_known_answer():
    # 7 -> bin0, 5 -> bin1, 3 -> bin1 (bin0 has 1 left), 2 -> new bin, 1 -> bin0
    assert first_fit_decreasing([3, 7, 2, 5, 1], 8) == [[1, 4], [3, 0], [2]]


def test_concatenative_keeps_input_order():
    lengths = [4, 4, 4, 9, 1, 1, 5]
    bins = concatenative(lengths, 10)
    assert bins == [[0, 1], [2], [3, 4], [5, 6]]
    assert [i for b in bins for i in b] == list(range(len(lengths)))


def test_first_fit_shuffle_is_seeded():
    lengths = [(i * 37) % 50 + 1 for i in range(200)]
    a = first_fit_shuffle(lengths, 100, seed=3)
    assert a == first_fit_shuffle(lengths, 100, seed=3)
    assert a != first_fit_shuffle(lengths, 100, seed=4)
    assert a != first_fit_decreasing(lengths, 100)


def test_mffd_phases():
    c = 120  # large > 60, medium (40, 60], small (20, 40], tiny <= 20
    lengths = [
        70,  # 0 large
        65,  # 1 large
        61,  # 2 large
        45,  # 3 medium
        50,  # 4 medium
        30,  # 5 small
        25,  # 6 small
        22,  # 7 small
        10,  # 8 tiny
        5,  # 9 tiny
    ]
    bins = modified_first_fit_decreasing(lengths, c)
    _check_bins(bins, lengths, c)
    # step 1: one bin per large item, largest first
    assert [b[0] for b in bins[:3]] == [0, 1, 2]
    # step 2: forward, the largest medium that fits: bin0 (room 50) takes 50, bin1 (room 55) takes 45
    assert bins[0][1] == 4
    assert bins[1][1] == 3
    # step 3: backward over bins without medium: bin2 (room 59) gets smallest small (22)
    # then the largest remaining small that fits (30 fits: 59-22=37)
    assert bins[2][1:3] == [7, 5]
    # step 4: top up: bin1 room 10 -> tiny 10; bin2 room 7 -> tiny 5
    assert 8 in bins[1]
    assert 9 in bins[2]
    # step 5: leftover small item 25 in a new bin
    assert bins[3] == [6]


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 8])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_assign_bins_equal_counts_and_never_worse_than_round_robin(num_ranks, data):
    per_rank = data.draw(st.integers(0, 8))
    totals = data.draw(
        st.lists(st.integers(0, 1000), min_size=per_rank * num_ranks, max_size=per_rank * num_ranks)
    )
    assign = assign_bins_to_ranks(totals, num_ranks)
    assert len(assign) == num_ranks
    assert sorted(b for r in assign for b in r) == list(range(len(totals)))
    assert all(len(r) == per_rank for r in assign)
    for r in assign:  # largest first within a rank
        assert [totals[b] for b in r] == sorted((totals[b] for b in r), reverse=True)

    def worst(a):
        return max(sum(totals[b] for b in r) for r in a)

    assert worst(assign) <= worst(round_robin_assign(totals, num_ranks))


def test_assign_bins_rejects_uneven_counts():
    with pytest.raises(InvalidBatch, match="5 bins cannot be shared equally by 2 ranks"):
        assign_bins_to_ranks([1, 2, 3, 4, 5], 2)
    with pytest.raises(InvalidBatch, match="num_ranks"):
        assign_bins_to_ranks([1], 0)
    assert round_robin_assign([5, 4, 3], 2) == [[0, 2], [1]]


def _lognormal_lengths(n=1024, median=2048, cap=16384, seed=1234):
    rng = np.random.default_rng(seed)
    raw = rng.lognormal(mean=math.log(median), sigma=1.0, size=n)
    return np.clip(np.round(raw), 1, cap).astype(int).tolist()


@pytest.mark.parametrize("algo", ALGOS)
def test_balance_lognormal_dp8(algo):
    lengths = _lognormal_lengths()
    dp, cap = 8, 16384
    args = {
        "max_tokens_per_microbatch": cap,
        "input_key": "input_ids",
        "input_lengths_key": "input_lengths",
        "algorithm": algo,
    }
    plan = plan_dp_shards(len(lengths), lengths, shards=dp, sequence_packing_args=args)
    ours = [sum(sum(c) for c in per_rank) for per_rank in plan.micro_batch_lengths]
    assert sum(ours) == sum(lengths)
    # per-rank token totals are the rows' lengths (pad multiple 1)
    assert ours == [sum(lengths[i] for i in rows) for rows in plan.rank_rows]
    n_bins = {len(per_rank[0]) for per_rank in plan.micro_batch_indices}
    assert len(n_bins) == 1, "every rank gets the same number of microbatches"

    # round-robin over the same bins the planner packed
    bins = PACKING_ALGORITHMS[algo](lengths, cap, min_bin_count=dp, bin_count_multiple=dp)
    assert len(bins) == n_bins.pop() * dp
    totals = [sum(lengths[i] for i in b) for b in bins]
    rr = [sum(totals[b] for b in r) for r in round_robin_assign(totals, dp)]

    mean = sum(lengths) / dp
    rr_ratio, our_ratio = max(rr) / mean, max(ours) / mean
    print(
        f"\n{algo}: {len(bins)} bins; max/mean rank tokens round-robin={rr_ratio:.4f} ours={our_ratio:.4f}"
    )
    assert our_ratio <= 1.05
    assert our_ratio <= rr_ratio
