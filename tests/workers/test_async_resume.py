"""What a resumed ``dataplane demo --async`` run takes from its restored store
(``policy_workers/async_resume.py``), on the in-process client (no Ray): the samples
claimed after the checkpoint's step come back, those of logged prompts go, a group cut
short is generated again, and the producers get exactly the prompts neither trained
nor stored. The whole run, killed and resumed: ``tests/e2e/test_chaos_resume.py``."""

from __future__ import annotations

import pytest
import torch

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
