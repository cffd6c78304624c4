"""A trainer resumed from its step-k checkpoint gets back exactly the samples it claimed
after step k, and none it trained into a step <= k (``commit_step`` / ``rewind_to_step``,
``core/steps.py``): on both clients, in both task modes (consumed at claim, leased until
ack), across a controller restart and a checkpoint restore.

The problem (NeMo-RL #3599, 675 of 736 prompts skipped across one save/restore): the
store counts every claimed sample consumed, so a trainer restored to step k never sees
what it claimed in steps k+1.. again.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
import ray
import ray._private.state as ray_state
import torch
from polling import wait_until

from dataplane_client.wire.errors import InvalidBatch, UnknownTask

BATCH = 4
STEPS = 5


def _pid() -> str:
    return f"steps-{uuid.uuid4().hex[:8]}"


def _filled(c, *, leased: bool = False, n: int = BATCH * STEPS) -> str:
    pid = _pid()
    leases = {"train": 60.0} if leased else None
    c.register_partition(pid, ["x"], None, ["train", "eval"], task_leases=leases)
    ids = [f"s{i:02d}" for i in range(n)]
    c.put_samples(ids, pid, {"x": torch.arange(n, dtype=torch.float32)})
    return pid


def _train(c, pid: str, first: int, last: int, *, leased: bool = False, commit_until: int = -1):
    """Steps ``first..last`` of a trainer: claim a batch (ack it if leased), save (commit)
    the steps up to ``commit_until``. Returns the ids claimed per step."""
    claimed = {}
    for step in range(first, last + 1):
        meta = c.claim_meta(pid, "train", ["x"], BATCH, blocking=False)
        assert meta.size == BATCH
        if leased:
            c.ack(meta)
        claimed[step] = meta.sample_ids
        if step <= commit_until:
            c.commit_step(pid, "train", step)
    return claimed


def _rest(c, pid: str) -> list[str]:
    meta = c.claim_meta(pid, "train", ["x"], BATCH * STEPS, blocking=False)
    return sorted(meta.sample_ids)


@pytest.mark.parametrize("leased", [False, True], ids=["consumed-at-claim", "leased"])
def test_a_run_resumed_from_step_k_gets_back_exactly_what_it_claimed_after_k(dp, leased):
    pid = _filled(dp, leased=leased)
    assert dp.consumption_detail(pid, ["train"])[0].committed_step is None
    claimed = _train(dp, pid, 0, 3, leased=leased, commit_until=1)  # saved steps 0 and 1
    assert dp.consumption_detail(pid, ["train"])[0].committed_step == 1
    # The trainer dies after step 3; its last checkpoint is step 1.
    after = sorted(claimed[2] + claimed[3])
    assert dp.rewind_to_step(pid, "train", 1) == len(after)
    # Steps 2.. again: the samples of steps 2 and 3 and the one batch never claimed.
    never = sorted(
        set(f"s{i:02d}" for i in range(BATCH * STEPS))
        - {s for ids in claimed.values() for s in ids}
    )
    assert _rest(dp, pid) == sorted(after + never)
    (detail,) = dp.consumption_detail(pid, ["train"])
    assert (detail.consumed if not leased else detail.consumed + detail.leased) == BATCH * STEPS
    # Another task's consumption is its own: untouched.
    assert dp.claim_meta(pid, "eval", ["x"], BATCH * STEPS, blocking=False).size == BATCH * STEPS


def test_rewinding_forgets_later_steps_and_a_resumed_run_commits_them_again(dp):
    pid = _filled(dp)
    claimed = _train(dp, pid, 0, 3, commit_until=3)  # saved every step
    assert dp.rewind_to_step(pid, "train", 1) == 2 * BATCH
    with pytest.raises(
        InvalidBatch, match=r"no committed step 3 to rewind to \(committed: \[0, 1\]\)"
    ):
        dp.rewind_to_step(pid, "train", 3)
    again = _train(dp, pid, 2, 3, commit_until=3)  # the resumed run: steps 2, 3 again
    assert sorted(again[2] + again[3]) == sorted(claimed[2] + claimed[3])
    assert dp.rewind_to_step(pid, "train", 3) == 0  # nothing claimed since step 3's save
    assert dp.rewind_to_step(pid, "train", None) == 4 * BATCH  # before the first step


def test_steps_move_forward_and_the_last_again_is_a_no_op(dp):
    pid = _filled(dp)
    _train(dp, pid, 0, 1, commit_until=1)
    dp.commit_step(pid, "train", 1)  # a retry of the last commit
    dp.claim_meta(pid, "train", ["x"], BATCH, blocking=False)  # step 2's claim
    dp.commit_step(pid, "train", 1)  # again: the mark stays before step 2's claim
    assert dp.rewind_to_step(pid, "train", 1) == BATCH
    with pytest.raises(
        InvalidBatch, match="step 0 of task 'train' is below its last committed step 1"
    ):
        dp.commit_step(pid, "train", 0)
    for bad, message in [
        (-1, "step must be >= 0"),
        (1.0, "step must be an int"),
        (True, "step must be an int"),
    ]:
        with pytest.raises(InvalidBatch, match=message):
            dp.commit_step(pid, "train", bad)
        with pytest.raises(InvalidBatch, match=message):
            dp.rewind_to_step(pid, "train", bad)
    with pytest.raises(UnknownTask):
        dp.commit_step(pid, "nope", 2)


def test_a_reset_forgets_the_steps(dp):
    pid = _filled(dp)
    _train(dp, pid, 0, 1, commit_until=1)
    dp.reset_consumption(pid, "train")
    with pytest.raises(InvalidBatch, match=r"committed: none"):
        dp.rewind_to_step(pid, "train", 0)
    _train(dp, pid, 0, 0, commit_until=0)
    assert dp.rewind_to_step(pid, "train", 0) == 0


def test_the_awaitable_twins(dp):
    pid = _filled(dp)

    async def steps() -> int:
        await dp.claim_meta_async(pid, "train", ["x"], BATCH, blocking=False)
        await dp.commit_step_async(pid, "train", 0)
        await dp.claim_meta_async(pid, "train", ["x"], BATCH, blocking=False)
        return await dp.rewind_to_step_async(pid, "train", 0)

    assert asyncio.run(steps()) == BATCH


# ---- durable: the marks and stamps survive a controller restart and a checkpoint -------
@pytest.fixture(scope="module")
def steps_service(module_services):
    return module_services("steps", num_storage_units=1, admin_enabled=False)


def _restart(h) -> None:
    """Kill the controller; Ray brings it back, and it rebuilds from its journal."""
    info = ray_state.actors(h.controller._actor_id.hex())
    before = int(info.get("NumRestarts", 0))
    ray.kill(h.controller, no_restart=False)

    def restarted() -> bool:
        now = ray_state.actors(h.controller._actor_id.hex())
        return now.get("State") == "ALIVE" and int(now.get("NumRestarts", 0)) > before

    wait_until(restarted, 60, "the controller's restart")


def test_a_controller_restart_keeps_the_steps_and_what_each_claimed(steps_service):
    c = steps_service.client()
    pid = _filled(c)
    claimed = _train(c, pid, 0, 3, commit_until=1)
    _restart(steps_service)  # replays the claims, the two commits: the same marks
    assert c.rewind_to_step(pid, "train", 1) == 2 * BATCH
    _restart(steps_service)  # ... and the rewind
    assert _rest(c, pid) == sorted(claimed[2] + claimed[3] + [f"s{i}" for i in range(16, 20)])


def test_a_checkpoint_restored_elsewhere_keeps_the_steps(steps_service, module_services, tmp_path):
    c = steps_service.client()
    pid = _filled(c)
    claimed = _train(c, pid, 0, 2, commit_until=0)
    path = c.checkpoint(str(tmp_path / "ck"))
    other = module_services("steps-restored", num_storage_units=1, admin_enabled=False).client()
    other.restore(path)
    assert other.rewind_to_step(pid, "train", 0) == 2 * BATCH
    assert _rest(other, pid) == sorted(claimed[1] + claimed[2] + [f"s{i}" for i in range(12, 20)])
