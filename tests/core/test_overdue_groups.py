"""Group deadlines without Ray: a straggler never wedges a step (issue 38, item 2).

A GRPO group whose members have not all arrived ``group_deadline_s`` after its first
is dropped by a claim of whole groups (counted, journaled) or taken partial by a claim
that asks (``partial_groups``); a blocking claim's wait ends at the deadline. Time is
an injected clock, never a sleep.
"""

from __future__ import annotations

import math

import pytest
from keyspace_commits import commit

from dataplane_client.wire.errors import InvalidBatch
from dataplane_client.wire.messages import ClaimRequest, PartitionSpec
from dataplane_server.core import async_rl, claim_wait
from dataplane_server.core.claim_policies.base import ReadyRows
from dataplane_server.core.claim_policies.grpo_groups import GrpoGroups
from dataplane_server.core.journal import Journal
from dataplane_server.core.keyspace import Declaration, KeySpace, declare

DENSE_F32 = {"x": ("dense", "float32", ())}
DEADLINE = 30.0


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _space(clock, num_samples=None, tasks=("t",)):
    ks = KeySpace(clock)
    ks.unit_alive = [True]
    spec = PartitionSpec(
        "p", ["x"], num_samples, list(tasks), grpo_group_size=4, group_deadline_s=DEADLINE
    )
    ks.register("p", declare(spec))
    return ks, ks.partition("p")


def _put(ks, ids, group, write_id="w"):
    commit(ks, "p", ids, DENSE_F32, tags=[{"group_id": group}] * len(ids), write_id=write_id)


def _claim(ks, part, batch_size=8, *, partial_groups=False, partial_ok=False):
    options = {"partial_groups": True} if partial_groups else None
    policy = ks.claim_policy(part, options=options)
    removal = async_rl.expired_removal(ks, part, policy)  # what both shells do first
    if removal is not None:
        async_rl.apply_removal(ks, removal)
    return ks.claim(part, "t", ["x"], batch_size, partial_ok=partial_ok, policy=policy)


def test_a_blocking_claims_wait_ends_at_the_stragglers_deadline():
    """The wait computes its next wake-up from the earliest group deadline, as from a
    lease's expiry: it never sleeps its whole timeout while a straggler is overdue."""
    clock = Clock()
    ks, part = _space(clock, num_samples=8)
    _put(ks, ["a0", "a1", "a2", "a3"], "A")
    _put(ks, ["b0", "b1", "b2"], "B")  # b3 never arrives
    clock.now += 10.0
    policy = ks.claim_policy(part)
    request = ClaimRequest("p", "t", ["x"], 8, None, True, timeout_s=600.0)
    steps = claim_wait.waiting(ks, part, request, policy, lambda: _claim(ks, part))
    assert next(steps) == pytest.approx(DEADLINE - 10.0)  # not the 600 s timeout
    clock.now += DEADLINE  # the deadline passed: the retry drops B, A is the tail
    with pytest.raises(StopIteration) as done:
        next(steps)
    assert done.value.value.sample_ids == ["a0", "a1", "a2", "a3"]


def test_an_overdue_group_is_dropped_counted_and_its_late_member_starts_anew():
    clock = Clock()
    ks, part = _space(clock, num_samples=8)
    _put(ks, ["a0", "a1", "a2", "a3"], "A")
    _put(ks, ["b0", "b1", "b2"], "B")
    assert _claim(ks, part) is None  # before the deadline: B is waited for
    assert part.deadlines.groups == 0
    clock.now += DEADLINE
    assert _claim(ks, part).sample_ids == ["a0", "a1", "a2", "a3"]
    assert (part.deadlines.groups, part.deadlines.samples) == (1, 3)
    assert list(part.deadlines.recent) == ["b0", "b1", "b2"]
    assert all(sid not in part.row_of for sid in ("b0", "b1", "b2"))
    # The late member is not refused: its group id starts a new group, short of
    # members, handled alike at its own deadline (counted as a second dropped group).
    _put(ks, ["b3"], "B", write_id="late")
    assert _claim(ks, part, partial_ok=True) is None
    clock.now += DEADLINE - 1
    assert _claim(ks, part, partial_ok=True) is None
    assert part.deadlines.groups == 1
    clock.now += 1
    assert _claim(ks, part, partial_ok=True) is None
    assert (part.deadlines.groups, part.deadlines.samples) == (2, 4)
    assert list(part.deadlines.recent)[-1] == "b3"


def test_a_complete_group_or_one_a_task_took_is_never_dropped():
    clock = Clock()
    ks, part = _space(clock, tasks=("t", "u"))
    _put(ks, ["a0", "a1", "a2", "a3"], "A")
    _put(ks, ["b0", "b1", "b2"], "B")
    clock.now += DEADLINE
    # Task u took B partial: a whole-group claim of t leaves it for the clear.
    policy = ks.claim_policy(part, options={"partial_groups": True})
    taken = ks.claim(part, "u", ["x"], 8, partial_ok=False, policy=policy)
    assert taken.sample_ids == ["a0", "a1", "a2", "a3", "b0", "b1", "b2"]
    assert _claim(ks, part, 8, partial_ok=True).sample_ids == ["a0", "a1", "a2", "a3"]
    assert part.deadlines.groups == 0
    assert "b0" in part.row_of
    _put(ks, ["c0", "c1", "c2", "c3"], "C", write_id="c")
    clock.now += 2 * DEADLINE  # a complete group is never overdue
    assert _claim(ks, part, 4).sample_ids == ["c0", "c1", "c2", "c3"]
    assert part.deadlines.groups == 0


def test_partial_groups_hand_out_the_members_present_once():
    clock = Clock()
    ks, part = _space(clock)
    _put(ks, ["a0", "a1", "a2", "a3"], "A")
    _put(ks, ["b0", "b1", "b2"], "B")
    assert _claim(ks, part, partial_groups=True) is None  # B not overdue yet
    clock.now += DEADLINE
    meta = _claim(ks, part, partial_groups=True)
    # Two groups, the missing member counted toward the batch of 8.
    assert meta.sample_ids == ["a0", "a1", "a2", "a3", "b0", "b1", "b2"]
    assert _claim(ks, part, partial_groups=True, partial_ok=True) is None  # once
    assert part.deadlines.groups == 0  # taken, not dropped


def test_the_policy_takes_an_overdue_group_only_when_asked():
    ready = ReadyRows.of([1] * 7, group=[0, 0, 0, 0, 1, 1, 1], group_size=4, group_short=[0, 1])
    policy = GrpoGroups()
    assert policy.choose(ready, 8, {}).tolist() == [0, 1, 2, 3]
    assert policy.choose(ready, 8, {"partial_groups": True}).tolist() == list(range(7))
    assert policy.choose(ready, 4, {"partial_groups": True}).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"group_deadline_s": 0}, "group_deadline_s must be finite and > 0, got 0"),
        ({"group_deadline_s": -1.5}, r"got -1\.5"),
        ({"group_deadline_s": math.inf}, "got inf"),
        ({"group_deadline_s": math.nan}, "got nan"),
        ({"group_deadline_s": True}, "number of seconds, got True"),
        ({"group_deadline_s": "30"}, "number of seconds, got '30'"),
        ({"group_deadline_s": 30, "grpo_group_size": None}, "needs grpo_group_size"),
        ({"policy_options": {"partial_groups": 1}}, "partial_groups must be a bool, got 1"),
    ],
)
def test_a_bad_deadline_or_partial_groups_is_refused_naming_it(kwargs, match):
    args = {"grpo_group_size": 4, **kwargs}
    with pytest.raises(InvalidBatch, match=match):
        declare(PartitionSpec("p", ["x"], None, ["t"], **args))


def test_the_deadline_is_part_of_the_declaration_record():
    decl = declare(PartitionSpec("p", ["x"], None, ["t"], grpo_group_size=4, group_deadline_s=2))
    assert decl.group_deadline_s == 2.0
    assert Declaration.from_record(decl.to_record()) == decl


def test_an_expired_record_replays_the_drop_and_its_counts(tmp_path):
    journal = Journal(str(tmp_path))
    decl = declare(PartitionSpec("p", ["x"], None, ["t"], grpo_group_size=4, group_deadline_s=2))
    journal.append("register", "p", decl.to_record())
    journal.append("claim", "p", "t", ["b0"], None, 0, "r1", ["x"], None)
    journal.append("expired", "p", 1, ["b0", "b1", "b2"], [2, 2, 3])
    state = Journal(str(tmp_path)).load()["p"]
    assert state["groups"] == {"groups": 1, "samples": 3, "recent": ["b0", "b1", "b2"]}
    assert sorted(state["removed"]) == [["b0", 2], ["b1", 2], ["b2", 3]]
    assert state["tasks"]["t"]["consumed"] == []  # the claim of the dropped b0 no longer applies
