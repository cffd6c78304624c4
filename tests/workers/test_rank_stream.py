"""Per-rank streaming pull (``policy_workers/rank_stream.py``), without Ray.

Every DP rank's leader (and its siblings) runs as a thread over one in-process store;
the rounds' all-gather and the leader-to-siblings share are thread barriers, standing
in for the process-group collectives the workers use (``tests/workers/
test_policy_workers.py`` runs them on real gloo groups). On long-tailed lengths:

- each sample goes to exactly one rank, once, and each step takes exactly its quota;
- GRPO groups stay whole, in one micro-batch;
- after every step the DP ranks' token totals differ by at most
  ``max(token_budget, longest item)`` (the stated bound; the figures measured are
  well inside it), and the pacing rule keeps that bound after every round whatever
  order the store serves the claims in (hypothesis);
- siblings get their leader's micro-batches;
- a step whose samples are still coming waits for them; none coming is
  ``ClaimTimeout`` on every rank; a partition's declared end ends the step early.
"""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dataplane_client.wire.errors import ClaimTimeout, InvalidBatch, UnknownTask
from dataplane_server.core.claim_policies import PartitionTraits, ReadyRows, get
from dataplane_server.core.inprocess import InProcessDataPlaneClient
from policy_workers.rank_stream import (
    RankStream,
    StreamAborted,
    StreamStep,
    claim_options,
    round_budget,
    tokens_of,
)


class Collectives:
    """All-gather over ``world`` threads and a share per replica of ``siblings`` threads,
    with barriers: what ``world_gather`` and ``replica_share`` do over process groups."""

    def __init__(self, dp: int, siblings: int):
        self.world = threading.Barrier(dp * siblings)
        self.replicas = [threading.Barrier(siblings) for _ in range(dp)]
        self.slots: list = [None] * (dp * siblings)
        self.headers: list = [None] * dp

    def gather(self, rank: int):
        def gather(values):
            self.slots[rank] = list(values)
            self.world.wait()
            out = [list(v) for v in self.slots]
            self.world.wait()
            return out

        return gather

    def share(self, dp_rank: int, leader: bool):
        def share(header):
            if leader:
                self.headers[dp_rank] = header
            self.replicas[dp_rank].wait()
            out = self.headers[dp_rank]
            self.replicas[dp_rank].wait()
            return out

        return share


def run_step(client, step: StreamStep, dp: int, siblings: int = 1, sleep=None, errors=None):
    """Every rank's metas of one streamed step: ``{(dp_rank, sibling): [meta, ...]}``;
    the first error any rank raised is raised (``errors``: a dict, each rank's error
    kept there instead). ``client``: one for every leader, or a function of the DP rank."""
    coll = Collectives(dp, siblings)
    got: dict = {}
    raised: dict = {} if errors is None else errors

    def rank(d: int, s: int) -> None:
        leader_client = client(d) if callable(client) else client
        stream = RankStream(
            leader_client if s == 0 else None,
            step,
            dp_rank=d,
            is_leader=s == 0,
            gather=coll.gather(d * siblings + s),
            share=coll.share(d, s == 0),
            **({"sleep": sleep} if sleep else {}),
        )
        try:
            got[d, s] = list(stream.metas())
        except Exception as e:  # noqa: BLE001 - handed to the test thread
            raised[d, s] = e

    threads = [
        threading.Thread(target=rank, args=(d, s)) for d in range(dp) for s in range(siblings)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if raised and errors is None:
        raise next(iter(raised.values()))
    return got


def _partition(client, lengths, *, group_size=None, num_samples=None, pid="p"):
    client.register_partition(
        pid, ["input_ids"], num_samples, ["train"], grpo_group_size=group_size
    )
    ids = [f"s{i}" for i in range(len(lengths))]
    tags = None if group_size is None else [{"group_id": i // group_size} for i in range(len(ids))]
    client.put_samples(
        ids, pid, {"input_ids": [torch.zeros(n, dtype=torch.long) for n in lengths]}, tags=tags
    )
    return ids


def _long_tail(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(x) for x in np.clip(rng.lognormal(4.0, 1.0, n), 4, 1500)]


@pytest.mark.parametrize(("group_size", "siblings"), [(None, 1), (4, 2)])
def test_every_sample_once_groups_whole_and_ranks_within_one_budget(group_size, siblings):
    dp, steps, step_samples, budget = 4, 3, 64, 1024
    lengths = _long_tail(steps * step_samples, seed=7)
    client = InProcessDataPlaneClient()
    ids = _partition(client, lengths, group_size=group_size)
    length_of = dict(zip(ids, lengths))
    step = StreamStep("p", "train", ("input_ids",), step_samples, budget, report_ids=True)
    seen: list[str] = []
    spreads = []
    for _ in range(steps):
        got = run_step(client, step, dp, siblings)
        # siblings received exactly their leader's micro-batches
        for d in range(dp):
            for s in range(1, siblings):
                assert [m.sample_ids for m in got[d, s]] == [m.sample_ids for m in got[d, 0]]
        step_ids = [i for d in range(dp) for m in got[d, 0] for i in m.sample_ids]
        assert len(step_ids) == step_samples  # exactly the step's quota
        seen += step_ids
        totals = [sum(tokens_of(m) for m in got[d, 0]) for d in range(dp)]
        assert totals == [
            sum(length_of[i] for m in got[d, 0] for i in m.sample_ids) for d in range(dp)
        ]
        items = [length_of[i] for i in step_ids]
        if group_size:
            for d in range(dp):
                for m in got[d, 0]:  # groups whole, in one micro-batch
                    groups = {int(i[1:]) // group_size for i in m.sample_ids}
                    assert sorted(m.sample_ids) == sorted(
                        f"s{g * group_size + k}" for g in groups for k in range(group_size)
                    )
            items = [
                sum(lengths[g * group_size : (g + 1) * group_size])
                for g in range(len(lengths) // group_size)
            ]
        bound = max(budget, max(items))
        assert max(totals) - min(totals) <= bound, (totals, bound)
        spreads.append((max(totals) - min(totals)) / (sum(totals) / dp))
        for d in range(dp):  # each micro-batch within the budget, or one item alone
            for m in got[d, 0]:
                assert tokens_of(m) <= budget or len(m) == (group_size or 1)
    assert sorted(seen) == sorted(ids)  # every sample exactly once over all steps
    assert len(set(seen)) == len(seen)
    print(f"spread of per-rank tokens / mean per step: {[round(s, 3) for s in spreads]}")


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 300), min_size=1, max_size=80),
    dp=st.integers(1, 5),
    budget=st.integers(1, 400),
    seed=st.integers(0, 2**16),
)
def test_the_pacing_rule_keeps_ranks_within_one_budget_after_every_round(lengths, dp, budget, seed):
    """The proof in rank_stream's docstring, checked: each round a budget of at most
    ``budget`` (random), claims served one at a time in a random order, each by the real
    policy over what is left."""
    policy = get("token_budget")
    rng = random.Random(seed)
    left = list(lengths)
    totals = [0] * dp
    bound = max(budget, max(lengths))
    rounds = 0
    while left:
        rounds += 1
        assert rounds <= 2 * len(lengths) + 2  # the smallest rank always takes something
        before = list(totals)
        this_round = rng.randint(1, budget)
        for rank in rng.sample(range(dp), dp):
            options = claim_options(before, before[rank], this_round)
            if options is None:
                continue
            checked = policy.check_options(options, PartitionTraits())
            chosen = policy.choose(ReadyRows.of(left), len(left), checked).tolist()
            totals[rank] += sum(left[i] for i in chosen)
            left = [x for i, x in enumerate(left) if i not in set(chosen)]
        assert max(totals) - min(totals) <= bound, (totals, bound)


def test_the_round_budget_tapers_to_the_rest_of_the_step_per_rank():
    assert round_budget(800, 64, 0, 0, 4) == 100  # nothing taken yet: a probe
    assert round_budget(800, 64, 16, 1600, 4) == 800  # rest 48 x 100 / 4 = 1200 > 800
    assert round_budget(800, 64, 48, 4800, 4) == 400  # rest 16 x 100 / 4
    assert round_budget(800, 64, 63, 6300, 4) == 100  # never under 800 / 8
    assert round_budget(800, 64, 64, 6400, 4) == 800


def test_a_step_waits_for_samples_still_coming_and_times_out_when_none_come():
    client = InProcessDataPlaneClient()
    client.register_partition("p", ["input_ids"], None, ["train"])
    step = StreamStep("p", "train", ("input_ids",), 6, 100, timeout_s=30)

    def later():
        for i in range(6):
            threading.Event().wait(0.02)
            client.put_samples([f"s{i}"], "p", {"input_ids": [torch.zeros(3, dtype=torch.long)]})

    producer = threading.Thread(target=later)
    producer.start()
    got = run_step(client, step, dp=2)
    producer.join()
    assert sorted(i for metas in got.values() for m in metas for i in m.sample_ids) == [
        f"s{i}" for i in range(6)
    ]
    quick = StreamStep("p", "train", ("input_ids",), 4, 100, timeout_s=0.2)
    with pytest.raises(ClaimTimeout, match="no rank got a sample"):
        run_step(client, quick, dp=2)


def test_a_leaders_failing_store_call_ends_the_step_on_every_rank():
    """The failing replica raises its leader's error (siblings too); every other rank
    StreamAborted naming it, at the same round: nobody is left waiting in a collective."""
    store = InProcessDataPlaneClient()
    _partition(store, [5] * 16)

    class Failing:
        def __getattr__(self, name):
            return getattr(store, name)

        def claim_meta(self, *args, **kwargs):
            raise InvalidBatch("this leader's claims fail")

    step = StreamStep("p", "train", ("input_ids",), 16, 12)
    errors: dict = {}
    run_step(lambda d: Failing() if d == 1 else store, step, dp=2, siblings=2, errors=errors)
    assert sorted(errors) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(isinstance(errors[1, s], InvalidBatch) for s in (0, 1))
    assert all(isinstance(errors[0, s], StreamAborted) for s in (0, 1))
    assert "DP rank(s) [1]" in str(errors[0, 0])
    errors.clear()  # an unknown task fails at the start (reading what the task has taken)
    run_step(store, StreamStep("p", "nope", ("input_ids",), 4, 12), dp=2, siblings=2, errors=errors)
    assert isinstance(errors[0, 0], UnknownTask)
    assert isinstance(errors[0, 1], StreamAborted)


def test_a_partitions_declared_end_ends_the_step():
    client = InProcessDataPlaneClient()
    _partition(client, [5] * 10, num_samples=10)
    step = StreamStep("p", "train", ("input_ids",), 8, 12)
    first = run_step(client, step, dp=3)
    second = run_step(client, step, dp=3)
    assert sum(len(m) for metas in first.values() for m in metas) == 8
    assert sum(len(m) for metas in second.values() for m in metas) == 2


def test_a_bad_step_is_invalid_batch_naming_it():
    for kwargs, message in [
        ({"step_samples": 0}, "step_samples"),
        ({"token_budget": True}, "token_budget"),
        ({"max_micro_batch": 0}, "max_micro_batch"),
        ({"fields": ()}, "fields"),
        ({"timeout_s": 0}, "timeout_s"),
    ]:
        args = {
            "partition_id": "p",
            "task_name": "t",
            "fields": ("input_ids",),
            "step_samples": 4,
            "token_budget": 10,
            **kwargs,
        }
        with pytest.raises(InvalidBatch, match=message):
            StreamStep(**args)
    with pytest.raises(InvalidBatch, match="leader needs a data-plane client"):
        RankStream(None, StreamStep("p", "t", ("x",), 1, 1), dp_rank=0, is_leader=True)
