"""Policy checkpoints: save_checkpoint / load_checkpoint on a DP=2 x TP=2 policy (real Ray, gloo).

- A policy trains one step, saves weights and optimizer state, trains a second
  step. A fresh policy loads the checkpoint and trains the same second step: the
  loss, the grad norm and every rank's parameters (TP head shards included)
  are bit for bit those of the first policy. The step saved is returned.
- Refusals, each a typed error naming what is wrong, and none changes any
  rank's state: no directory (or one whose save never finished: no manifest),
  one flipped byte in the last rank's file (the other ranks had already read
  theirs), optimizer state from another save, a policy of another layout and
  model config, a save over an existing directory.
- A worker killed while ranks write their files: ``PolicyWorkerLost``, and no
  directory of the final name exists (nothing that could load).
"""

from __future__ import annotations

import json
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
import torch

from dataplane_client.batching.batched_data_dict import BatchedDataDict
from policy_workers.config import ModelConfig, OptimizerConfig, PolicyConfig
from policy_workers.errors import (
    CheckpointCorrupt,
    CheckpointMismatch,
    CheckpointNotFound,
    PolicyCheckpointError,
    PolicyWorkerLost,
)
from policy_workers.tq_policy import TQPolicy
from policy_workers.worker import PolicyWorker

# Ray workers cannot import this test module by name: ship its classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

LENGTHS = [5, 9, 3, 12, 7, 6, 10, 4]
N = len(LENGTHS)
MODEL = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, seed=9)
CFG = dict(
    model=MODEL,
    optimizer=OptimizerConfig(name="adamw", lr=1e-2, eps=1e-6, max_grad_norm=0.5),
    train_global_batch_size=N,
    train_micro_batch_size=2,
    num_cpus_per_worker=0.5,
    collective_timeout_s=120,
)


def _batch(seed: int) -> BatchedDataDict:
    g = torch.Generator().manual_seed(seed)

    def pad(rows):
        return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)

    return BatchedDataDict(
        {
            "input_ids": pad(
                [torch.randint(1, MODEL.vocab_size, (n,), generator=g) for n in LENGTHS]
            ),
            "input_lengths": torch.tensor(LENGTHS),
            "token_mask": pad([torch.cat([torch.zeros(2), torch.ones(n - 2)]) for n in LENGTHS]),
            "sample_mask": torch.ones(N),
            "advantages": pad([torch.randn(n, generator=g) for n in LENGTHS]),
            "prev_logprobs": pad([-torch.rand(n, generator=g) - 3.0 for n in LENGTHS]),
        }
    )


def _params(policy: TQPolicy) -> list[dict[str, torch.Tensor]]:
    return policy.run_on_all_workers("get_parameters")


def _digests(policy: TQPolicy) -> list[str]:
    return policy.run_on_all_workers("parameters_digest")


def _assert_bitwise_equal(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for rank, (x, y) in enumerate(zip(a, b)):
        assert x.keys() == y.keys()
        for name in x:
            assert torch.equal(x[name], y[name]), f"rank {rank} {name}"


@pytest.fixture(scope="module")
def saved(ray_session, tmp_path_factory):
    """A policy after one step, its checkpoint, and what its second step gave."""
    root = tmp_path_factory.mktemp("policy-ckpt")
    policy = TQPolicy(PolicyConfig(dp=2, tp=2, **CFG))
    try:
        policy.train(_batch(1))
        policy.save_checkpoint(str(root / "weights"), str(root / "optimizer"), step=1)
        policy.save_checkpoint(str(root / "other-weights"), str(root / "other-optimizer"))
        second = policy.train(_batch(2))
        after = _params(policy)
    finally:
        policy.shutdown()
    return {"root": root, "second": second, "after": after}


@pytest.fixture(scope="module")
def fresh(ray_session):
    policy = TQPolicy(PolicyConfig(dp=2, tp=2, **CFG))
    yield policy
    policy.shutdown()


@pytest.mark.slow
def test_a_fresh_policy_loaded_from_a_checkpoint_continues_bit_for_bit(saved, fresh):
    root = saved["root"]
    manifest = json.loads((root / "weights" / "manifest.json").read_text())
    assert manifest["layout"] == {"pp": 1, "dp": 2, "cp": 1, "tp": 2}
    assert [f["rank"] for f in manifest["files"]] == [0, 1, 2, 3]
    assert not list(root.glob("*.tmp-*"))  # every temporary directory was renamed

    assert fresh.load_checkpoint(str(root / "weights"), str(root / "optimizer")) == 1
    second = fresh.train(_batch(2))
    assert second["loss"] == saved["second"]["loss"]
    assert second["grad_norm"] == saved["second"]["grad_norm"]
    _assert_bitwise_equal(_params(fresh), saved["after"])
    # the head is split over TP: the two TP ranks of a DP rank saved different rows
    p = saved["after"]
    assert not torch.equal(p[0]["head_weight"], p[1]["head_weight"])


@pytest.mark.slow
def test_a_bad_checkpoint_is_a_typed_error_and_changes_no_rank(saved, fresh, tmp_path):
    root = saved["root"]
    before = _digests(fresh)

    with pytest.raises(CheckpointNotFound, match="no policy weights checkpoint"):
        fresh.load_checkpoint(str(tmp_path / "nothing"))
    unfinished = tmp_path / "unfinished"
    shutil.copytree(root / "weights", unfinished)
    (unfinished / "manifest.json").unlink()
    with pytest.raises(CheckpointNotFound, match="never finished"):
        fresh.load_checkpoint(str(unfinished))

    damaged = tmp_path / "damaged"
    shutil.copytree(root / "weights", damaged)
    last = damaged / "rank-00003.pt"
    data = bytearray(last.read_bytes())
    data[len(data) // 2] ^= 0x01
    last.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match="rank-00003.pt does not match its manifest"):
        fresh.load_checkpoint(str(damaged))

    with pytest.raises(CheckpointMismatch, match="not saved with the weights"):
        fresh.load_checkpoint(str(root / "weights"), str(root / "other-optimizer"))
    with pytest.raises(CheckpointMismatch, match="holds the policy's 'optimizer'"):
        fresh.load_checkpoint(str(root / "optimizer"))
    with pytest.raises(PolicyCheckpointError, match="exists; choose a new one"):
        fresh.save_checkpoint(str(root / "weights"))

    assert _digests(fresh) == before  # no rank loaded anything


@pytest.mark.slow
def test_a_checkpoint_of_another_layout_or_model_is_refused(saved, ray_session):
    other = dict(CFG, model=ModelConfig(vocab_size=64, hidden_size=24, intermediate_size=32))
    policy = TQPolicy(PolicyConfig(dp=1, tp=1, **other))
    try:
        with pytest.raises(CheckpointMismatch) as e:
            policy.load_checkpoint(str(saved["root"] / "weights"))
    finally:
        policy.shutdown()
    message = str(e.value)
    assert "layout.dp: 2 saved, 1 here" in message
    assert "layout.tp: 2 saved, 1 here" in message
    assert "model.hidden_size: 16 saved, 24 here" in message
    assert "model.seed: 9 saved, 1234 here" in message


class StallingSaveWorker(PolicyWorker):
    """Rank 1 announces (a file) that it is saving, then stalls until killed (bounded)."""

    def save_checkpoint_shard(self, tmp, part):
        marker = self.cfg.extra["stall_marker"]
        if self.rank == 1:
            with open(marker, "w"):
                pass
            threading.Event().wait(120)
        return super().save_checkpoint_shard(tmp, part)


@pytest.mark.slow
def test_a_worker_killed_mid_save_leaves_no_checkpoint(ray_session, tmp_path):
    marker = tmp_path / "saving"
    cfg = PolicyConfig(dp=2, tp=1, extra={"stall_marker": str(marker)}, **CFG)
    policy = TQPolicy(cfg, worker_cls=StallingSaveWorker)
    target = tmp_path / "weights"
    try:
        with ThreadPoolExecutor(1) as pool:
            save = pool.submit(policy.save_checkpoint, str(target))
            deadline = time.monotonic() + 120
            while not marker.exists():  # poll the observable state, with a deadline
                assert time.monotonic() < deadline, "rank 1 never started saving"
                time.sleep(0.05)
            ray.kill(policy.worker_group.workers[1])
            with pytest.raises(PolicyWorkerLost):
                save.result(timeout=120)
    finally:
        policy.shutdown()
    assert not target.exists()
    assert not list(tmp_path.glob("weights.tmp-*"))  # the temporary directory was removed
