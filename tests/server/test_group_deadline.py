"""A straggler never wedges a step (issue 38, item 2), on both clients: a GRPO group one
of whose members never arrives is dropped at its partition's ``group_deadline_s`` by a
claim of whole groups (counted, its ids listed) or taken partial by a claim that asks;
a blocking claim returns within the deadline plus a margin; the drop survives a
controller restart.
"""

from __future__ import annotations

import time

import pytest
import ray
import ray._private.state as ray_state
import torch
from polling import wait_until

DEADLINE_S = 0.5
MARGIN_S = 20.0  # a loaded 2-core machine: the claim's own timeout is the measurement


def _put(c, ids, group, pid="p"):
    c.put_samples(ids, pid, {"x": torch.zeros(len(ids), 2)}, tags=[{"group_id": group}] * len(ids))


def _straggling_step(c, pid="p", num_samples=8):
    """Group A whole, group B short of its last member (which never comes)."""
    c.register_partition(
        pid, ["x"], num_samples, ["t"], grpo_group_size=4, group_deadline_s=DEADLINE_S
    )
    _put(c, ["a0", "a1", "a2", "a3"], "A", pid)
    _put(c, ["b0", "b1", "b2"], "B", pid)


def test_a_blocking_claim_returns_when_a_member_never_arrives(dp):
    _straggling_step(dp)
    began = time.monotonic()
    # Without the deadline this waits for b3 until its timeout (ClaimTimeout).
    meta = dp.claim_meta("p", "t", ["x"], 8, timeout_s=DEADLINE_S + MARGIN_S)
    assert time.monotonic() - began < DEADLINE_S + MARGIN_S
    assert meta.sample_ids == ["a0", "a1", "a2", "a3"]  # the step goes on with A
    groups = dp.describe_partition("p").groups
    assert (groups.dropped_groups, groups.dropped_samples) == (1, 3)
    assert groups.recently_dropped == ["b0", "b1", "b2"]
    assert dp.describe_partition("p").num_samples == 4  # B's members are gone


def test_a_late_member_starts_its_group_anew_and_is_dropped_at_its_own_deadline(dp):
    _straggling_step(dp)
    dp.claim_meta("p", "t", ["x"], 8, timeout_s=DEADLINE_S + MARGIN_S)
    _put(dp, ["b3"], "B")  # accepted, not refused: group ids are reused after a clear

    def dropped_twice() -> bool:
        dp.claim_meta("p", "t", ["x"], 4, blocking=False)  # a claim applies the rule
        return dp.describe_partition("p").groups.dropped_groups == 2

    wait_until(dropped_twice, MARGIN_S, "the late member's group to be dropped")
    groups = dp.describe_partition("p").groups
    assert (groups.dropped_samples, groups.recently_dropped[-1]) == (4, "b3")


def test_partial_groups_hand_out_the_members_present_once(dp):
    _straggling_step(dp, num_samples=None)
    meta = dp.claim_meta(
        "p",
        "t",
        ["x"],
        8,
        timeout_s=DEADLINE_S + MARGIN_S,
        policy_options={"partial_groups": True},
    )
    assert meta.sample_ids == ["a0", "a1", "a2", "a3", "b0", "b1", "b2"]
    again = dp.claim_meta(
        "p", "t", ["x"], 8, blocking=False, policy_options={"partial_groups": True}
    )
    assert again.sample_ids == []
    assert dp.describe_partition("p").groups.dropped_groups == 0  # taken, not dropped


def _restarts(h) -> int:
    info = ray_state.actors(h.controller._actor_id.hex())
    return int(info.get("NumRestarts", 0)) if info.get("State") == "ALIVE" else -1


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_a_drop_at_the_deadline_survives_a_controller_restart(service_factory):
    h = service_factory("deadline", num_storage_units=1, admin_enabled=False)
    c = h.client()
    _straggling_step(c)
    assert c.claim_meta("p", "t", ["x"], 8, timeout_s=DEADLINE_S + MARGIN_S).size == 4
    before = c.describe_partition("p")
    assert before.groups.dropped_groups == 1
    counters = ray.get(h.controller.metrics_snapshot.remote()).stats["counters"]
    assert counters["expired_groups_dropped_total"] == 1  # exported as a Prometheus counter
    assert counters["expired_group_samples_dropped_total"] == 3
    restarts = _restarts(h)
    ray.kill(h.controller, no_restart=False)
    wait_until(lambda: _restarts(h) > restarts, 60, "the controller's restart")
    after = c.describe_partition("p")
    assert after.groups == before.groups  # counts and ids replayed
    assert after.num_samples == 4  # B's members stay dropped
    assert c.claim_meta("p", "t", ["x"], 8, blocking=False).sample_ids == []  # A consumed
