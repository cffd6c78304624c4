"""What a resumed ``dataplane demo --async`` run takes from its restored store
(``policy_workers/async_resume.py``), on the in-process client (no Ray): the samples
claimed after the checkpoint's step come back, those of logged prompts go, a group cut
short is generated again, and the producers get exactly the prompts neither trained
nor stored. The whole run, killed and resumed: ``tests/e2e/test_chaos_resume.py``."""

from __future__ import annotations

import pytest
import torch

from dataplane_client import StalenessSpec
from dataplane_client.wire.errors import SamplesNotFound
from dataplane_server.core.inprocess import InProcessDataPlaneClient
from policy_workers.async_resume import AsyncLedger, resume_partition
from policy_workers.rollout import group_sample_ids

PID, TASK, G = "demo-async", "train", 2


def _put_group(c, prompt: int, members: int = G) -> None:
    ids = group_sample_ids(PID, prompt, G)[:members]
    tags = [{"group_id": f"prompt{prompt}", "prompt": prompt}] * members
    c.put_samples(ids, PID, {"rewards": torch.zeros(members)}, tags=tags)


def _held(c, prompt: int) -> bool:
    try:
        c.get_samples(group_sample_ids(PID, prompt, G), PID, ["rewards"])
    except SamplesNotFound:
        return False
    return True


def test_a_resumed_run_gets_back_what_it_claimed_after_its_step_and_generates_the_rest():
    c = InProcessDataPlaneClient()
    c.register_partition(PID, ["rewards"], None, [TASK], grpo_group_size=G)
    for prompt in range(5):
        _put_group(c, prompt)
    _put_group(c, 5, members=1)  # a group cut short by the kill
    step0 = c.claim_meta(PID, TASK, ["rewards"], 2 * G)
    assert sorted({t["prompt"] for t in step0.tags}) == [0, 1]
    c.commit_step(PID, TASK, 1)  # the step-1 checkpoint: prompts 0 and 1 trained
    after = c.claim_meta(PID, TASK, ["rewards"], G)  # then killed before the next save
    assert [t["prompt"] for t in after.tags] == [2, 2]

    ledger = AsyncLedger(dataset=8, checkpointing=True, trained={0: [0, 1]})
    remaining, handed_back = resume_partition(c, PID, TASK, 1, ledger, G)

    assert remaining == [5, 6, 7]  # 5 cut short, 6 and 7 never written
    assert handed_back == G  # prompt 2's group, claimed after the mark
    assert [_held(c, p) for p in range(6)] == [False, False, True, True, True, False]
    with pytest.raises(SamplesNotFound):  # the remnant went: prompt 5 is put whole again
        c.get_samples(group_sample_ids(PID, 5, G)[:1], PID, ["rewards"])
    batch = c.claim_meta(PID, TASK, ["rewards"], 3 * G, blocking=False)
    assert sorted({t["prompt"] for t in batch.tags}) == [2, 3, 4]


def test_a_ledger_clears_trained_batches_only_once_a_save_is_complete():
    c = InProcessDataPlaneClient()
    c.register_partition(PID, ["rewards"], None, [TASK], grpo_group_size=G)
    _put_group(c, 0)
    _put_group(c, 1)
    saving = AsyncLedger(dataset=2, checkpointing=True)
    saving.finish_step(c, 0, c.claim_meta(PID, TASK, ["rewards"], G))
    assert saving.trained == {0: [0]}
    assert _held(c, 0)
    assert saving.manifest_entry() == {"trained_prompts": {"0": [0]}}
    saving.saved(c, PID)
    assert not _held(c, 0)
    plain = AsyncLedger(dataset=2, checkpointing=False)  # no --checkpoint-dir: at once
    plain.finish_step(c, 1, c.claim_meta(PID, TASK, ["rewards"], G))
    assert not _held(c, 1)


def test_partial_rollouts_a_kill_interrupted_are_cleared_and_generated_again():
    """With --partial-rollouts a checkpoint may hold groups in progress (started by
    ``append_tokens``), or finished and not yet given their rewards: their actors are gone,
    so the resume clears them and hands their prompts to the producers; a whole group
    (finished, rewarded) stays to be claimed. Before, the in-progress sample's missing
    rewards made the resume raise FieldNotProduced."""
    c = InProcessDataPlaneClient()
    spec = StalenessSpec(max_staleness={TASK: 1})
    c.register_partition(
        PID, ["input_ids", "rewards"], None, [TASK], grpo_group_size=G, staleness=spec
    )

    def start(prompt: int) -> list[str]:
        ids = group_sample_ids(PID, prompt, G)
        tags = [{"group_id": f"prompt{prompt}", "prompt": prompt}] * G
        tokens = {"input_ids": [torch.arange(4), torch.arange(3)]}
        c.append_tokens(ids, PID, tokens, 0, tags=tags, start=True)
        return ids

    start(0)  # in progress at the kill
    finished = start(1)  # finished, its rewards not yet put at the kill
    c.append_tokens(
        finished, PID, {"input_ids": [torch.arange(1), torch.arange(2)]}, 0, finish=True
    )
    whole = start(2)  # finished and rewarded: claimable
    c.append_tokens(whole, PID, {"input_ids": [torch.arange(1), torch.arange(2)]}, 0, finish=True)
    c.put_samples(whole, PID, {"rewards": torch.ones(G)})
    assert c.describe_partition(PID).staleness.partial_in_progress == G

    c.commit_step(PID, TASK, 1)  # the step-1 checkpoint, before any group was claimed
    ledger = AsyncLedger(dataset=4, checkpointing=True)
    remaining, _ = resume_partition(c, PID, TASK, 1, ledger, G)

    assert remaining == [0, 1, 3]  # the two interrupted, and 3 never started
    for prompt in (0, 1):
        with pytest.raises(SamplesNotFound):
            c.get_samples(group_sample_ids(PID, prompt, G)[:1], PID, ["input_ids"])
    assert c.describe_partition(PID).staleness.partial_in_progress == 0  # admission room back
    start(0)  # its ids start again cleanly, as the producers will
    batch = c.claim_meta(PID, TASK, ["input_ids", "rewards"], 2 * G, blocking=False)
    assert {t["prompt"] for t in batch.tags} == {2}
