"""The ``token_budget`` claim policy, without Ray (milliseconds).

Items (samples, or whole complete GRPO groups) are handed out oldest first while their
tokens fit the budget; the first item that does not fit ends the batch; a first item
over the whole budget goes alone (``oversize="alone"``) or not at all (``"refuse"``);
``step_end`` caps what the task has consumed or holds, so claims of several ranks
together never pass a step's quota. Bad options are ``InvalidBatch`` naming them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dataplane_client.wire.errors import InvalidBatch
from dataplane_server.core import claim_policies
from dataplane_server.core.claim_policies import ReadyRows
from dataplane_server.core.inprocess import InProcessDataPlaneClient

POLICY = claim_policies.get("token_budget")


def _choose(ready: ReadyRows, batch_size: int = 1000, **options) -> list[int]:
    checked = POLICY.check_options(options, claim_policies.PartitionTraits())
    return POLICY.choose(ready, batch_size, checked).tolist()


def test_samples_oldest_first_while_their_tokens_fit_and_the_first_misfit_ends_the_batch():
    ready = ReadyRows.of([3, 4, 2, 9, 1, 1])
    assert _choose(ready, token_budget=9) == [0, 1, 2]  # 3 + 4 + 2; the 9 does not fit
    assert _choose(ready, token_budget=8) == [0, 1]  # never skips to a later, smaller one
    assert _choose(ready, batch_size=2, token_budget=100) == [0, 1]
    assert _choose(ready, token_budget=100) == [0, 1, 2, 3, 4, 5]
    # a row with no recorded length counts 0 tokens
    assert _choose(ReadyRows.of([-1, 5, -1]), token_budget=5) == [0, 1, 2]


def test_a_first_item_over_the_budget_goes_alone_or_is_refused():
    ready = ReadyRows.of([50, 1, 1])
    assert _choose(ready, token_budget=10) == [0]
    assert _choose(ready, token_budget=10, oversize="alone") == [0]
    assert _choose(ready, token_budget=10, oversize="refuse") == []
    # only a first item: after others, a long one ends the batch as any misfit does
    assert _choose(ReadyRows.of([1, 50]), token_budget=10) == [0]


def test_groups_go_whole_and_complete_in_order_of_their_oldest_row():
    # group 0: rows 0, 3 (6 tokens); group 1: rows 1, 2 (incomplete: one member missing);
    # group 2: rows 4, 5 (2 tokens); group 3: rows 6, 7 (20 tokens)
    ready = ReadyRows.of([5, 1, 1, 1, 1, 1, 10, 10], group=[0, 1, 1, 0, 2, 2, 3, 3], group_size=2)
    ready.columns.group_live[1] = 3  # a third member of group 1 is live, not ready
    assert _choose(ready, token_budget=8) == [0, 3, 4, 5]
    assert _choose(ready, token_budget=7) == [0, 3]  # 6 + 2 > 7: the group stays whole
    assert _choose(ready, token_budget=5) == [0, 3]  # over the budget, first: alone
    assert _choose(ready, token_budget=5, oversize="refuse") == []
    assert _choose(ready, batch_size=2, token_budget=100) == [0, 3]


def test_step_end_caps_what_the_task_has_taken():
    lengths = [1] * 10
    assert _choose(ReadyRows.of(lengths, taken=4), token_budget=100, step_end=6) == [0, 1]
    assert _choose(ReadyRows.of(lengths, taken=6), token_budget=100, step_end=6) == []
    assert _choose(ReadyRows.of(lengths, taken=9), token_budget=100, step_end=6) == []
    # the quota counts samples: a group that would pass it waits for the next step
    grouped = ReadyRows.of([1] * 4, group=[0, 0, 1, 1], group_size=2, taken=2)
    assert _choose(grouped, token_budget=100, step_end=5) == [0, 1]
    # even an oversize item stays within the quota
    assert _choose(ReadyRows.of([50], taken=3), token_budget=1, step_end=3) == []


@settings(max_examples=100, deadline=None)
@given(
    lengths=st.lists(st.integers(-1, 40), max_size=30),
    group_size=st.sampled_from([None, 1, 2, 3]),
    budget=st.integers(1, 100),
    room=st.integers(0, 40),
    oversize=st.sampled_from(["alone", "refuse"]),
)
def test_the_batch_is_the_longest_prefix_of_items_that_fits(
    lengths, group_size, budget, room, oversize
):
    group = None
    if group_size is not None:
        group = [i // group_size for i in range(len(lengths))]
    ready = ReadyRows.of(lengths, group=group, group_size=group_size)
    got = _choose(ready, batch_size=room, token_budget=budget, oversize=oversize)
    tokens = np.maximum(np.asarray(lengths, dtype=np.int64), 0)
    size = group_size or 1
    complete = (len(lengths) // size) * size  # the last group may be incomplete
    # the model: whole items in order while the running token sum and count fit
    want: list[int] = []
    for start in range(0, complete, size):
        rows = list(range(start, start + size))
        if len(want) + size > room:
            break
        if int(tokens[want + rows].sum()) > budget:
            if not want and oversize == "alone":
                want = rows
            break
        want += rows
    assert got == want
    assert len(got) <= room
    assert len(set(got)) == len(got)


def test_bad_options_are_invalid_batch_naming_them_and_change_nothing():
    dp = InProcessDataPlaneClient()
    dp.register_partition("p", ["x"], None, ["t"])
    dp.put_samples(["a", "b"], "p", {"x": [torch.zeros(3), torch.zeros(4)]})
    cases = {
        "needs the option 'token_budget'": {},
        "token_budget must be an int >= 1": {"token_budget": 0},
        "token_budget must be an int >= 1, got True": {"token_budget": True},
        "step_end must be an int >= 0": {"token_budget": 5, "step_end": -1},
        "step_end must be an int >= 0, got 1.5": {"token_budget": 5, "step_end": 1.5},
        "oversize must be one of": {"token_budget": 5, "oversize": "split"},
        "has no option": {"token_budget": 5, "dp_size": 2},
    }
    for message, options in cases.items():
        with pytest.raises(InvalidBatch, match=message):
            dp.claim_meta(
                "p",
                "t",
                ["x"],
                2,
                blocking=False,
                claim_policy="token_budget",
                policy_options=options,
            )
        with pytest.raises(InvalidBatch, match=message):
            dp.register_partition(
                "q", ["x"], None, ["t"], claim_policy="token_budget", policy_options=options
            )
    assert dp.claim_meta("p", "t", ["x"], 2, blocking=False).sample_ids == ["a", "b"]


def test_claims_of_many_ranks_share_one_step_quota_through_the_key_space():
    """Three ranks claim in turn with the same step_end: together they take exactly the
    step's samples, each once, whole groups, and a fourth claim finds the step done."""
    dp = InProcessDataPlaneClient()
    dp.register_partition("p", ["x"], None, ["t"], grpo_group_size=2)
    lengths = [5, 3, 8, 8, 1, 1, 4, 6, 2, 2, 7, 7]
    ids = [f"s{i}" for i in range(len(lengths))]
    dp.put_samples(
        ids,
        "p",
        {"x": [torch.zeros(n) for n in lengths]},
        tags=[{"group_id": i // 2} for i in range(len(lengths))],
    )
    options = {"token_budget": 16, "step_end": 8}
    got = []
    for rank in (0, 1, 2, 0):
        meta = dp.claim_meta(
            "p",
            "t",
            ["x"],
            12,
            rank,
            blocking=False,
            claim_policy="token_budget",
            policy_options=options,
        )
        got.append(meta.sample_ids)
    assert got == [["s0", "s1"], ["s2", "s3"], ["s4", "s5", "s6", "s7"], []]
    assert dp.consumption_detail("p", ["t"])[0].consumed == 8
    # the next step's quota counts from there
    meta = dp.claim_meta(
        "p",
        "t",
        ["x"],
        12,
        blocking=False,
        claim_policy="token_budget",
        policy_options={"token_budget": 100, "step_end": 12},
    )
    assert meta.sample_ids == ids[8:]
