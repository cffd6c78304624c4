"""A policy worker killed during a logprob pass driven from a KVBatchMeta (real Ray, gloo).

DP=2: rank 1 stops inside its forward (it announces that in a file) while rank 0
finishes its own slice (it announces that too). The test then kills rank 1 with
``ray.kill`` and checks what the trainer sees and what the store keeps:

- the pass raises ``PolicyWorkerLost`` (a data-plane error and a ConnectionError,
  never Ray's ActorDiedError), within a bounded time, and so does every later
  call on that policy;
- no sample got ``prev_logprobs``, not even rank 0's slice (workers wait for
  each other before writing back): nothing is half-written;
- the claim was leased and never acknowledged, so the task has not consumed the
  samples; once the lease runs out they are handed out again, all of them, and a
  new policy runs the pass over them: logprobs equal a direct computation.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
import torch
from polling import wait_until

from dataplane_client.batching.materialize import materialize
from dataplane_client.wire.errors import FieldNotProduced
from policy_workers.config import ModelConfig, PolicyConfig
from policy_workers.errors import PolicyWorkerLost
from policy_workers.model import build_hf_model, reference_logprobs
from policy_workers.tq_policy import TQPolicy
from policy_workers.worker import PolicyWorker

# Ray workers cannot import this test module by name: ship its classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

VICTIM = 1
LENGTHS = [6, 11, 4, 9, 13, 5, 8, 10]
LEASE_S = 4.0
MODEL = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, seed=5)
LOST_WITHIN_S = 30.0  # kill -> typed error; the survivor is never waited on
PID = "pfault"


class StallingWorker(PolicyWorker):
    """Rank ``VICTIM`` writes the file ``cfg.extra["stall_marker"]`` inside its forward and
    then stalls there (bounded) until the test kills it."""

    def get_logprobs(self, data, micro_batch_size=None):
        marker = self.cfg.extra.get("stall_marker")
        if marker and self.rank == VICTIM:
            with open(marker, "w") as f:
                f.write(str(os.getpid()))
            threading.Event().wait(120)  # a bound in case the kill never comes
            raise RuntimeError("the stalled worker was never killed")
        return super().get_logprobs(data, micro_batch_size)

    def _wait_for_every_rank(self):
        """Say when a surviving rank has its result and waits for the others."""
        marker = self.cfg.extra.get("stall_marker")
        if marker:
            with open(f"{marker}.rank{self.rank}-waiting", "w"):
                pass
        super()._wait_for_every_rank()


def _policy(handle, **extra) -> TQPolicy:
    cfg = PolicyConfig(
        dp=2,
        model=MODEL,
        data_plane=handle.config,
        num_cpus_per_worker=0.5,
        collective_timeout_s=120,
        extra=extra,
    )
    return TQPolicy(cfg, worker_cls=StallingWorker)


def _produced(client, field: str) -> int:
    fields = client.describe_partition(PID).fields
    return next((f.produced for f in fields if f.name == field), 0)


@pytest.mark.slow
def test_a_worker_killed_mid_logprob_pass_is_typed_and_leaves_samples_redeliverable(
    service_factory, tmp_path
):
    handle = service_factory("pfault", num_storage_units=1)
    client = handle.client()
    ids = [f"s{i}" for i in range(len(LENGTHS))]
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(1, MODEL.vocab_size, (n,), generator=g) for n in LENGTHS]
    client.register_partition(
        PID, ["input_ids"], len(ids), ["train"], task_leases={"train": LEASE_S}
    )
    client.put_samples(ids, PID, {"input_ids": rows})
    meta = client.claim_meta(PID, "train", ["input_ids"], len(ids))
    claimed_at = time.monotonic()

    marker = tmp_path / "stalled"
    policy = _policy(handle, stall_marker=str(marker))
    try:
        with ThreadPoolExecutor(1) as pool:
            pass_ = pool.submit(policy.get_logprobs_from_meta, meta)
            wait_until(marker.exists, 120, "rank 1 to enter its forward")
            # Kill once rank 0 is done with its slice: waiting for the other ranks, or
            # (as before that wait existed) already written back.
            waiting = tmp_path / "stalled.rank0-waiting"
            wait_until(
                lambda: waiting.exists() or _produced(client, "prev_logprobs") > 0,
                120,
                "rank 0 to finish its slice",
            )
            killed_at = time.monotonic()
            ray.kill(policy.worker_group.workers[VICTIM])
            with pytest.raises(PolicyWorkerLost) as lost:
                pass_.result(timeout=120)
            elapsed = time.monotonic() - killed_at
        print(f"\nkill -> PolicyWorkerLost in {elapsed:.2f}s: {lost.value}")
        assert elapsed < LOST_WITHIN_S
        assert isinstance(lost.value, ConnectionError)
        assert "rank 1" in str(lost.value)
        assert not isinstance(lost.value, ray.exceptions.RayError)
        # the policy is unusable now, and says so at once instead of calling dead actors
        with pytest.raises(PolicyWorkerLost):
            policy.get_logprobs_from_meta(meta)
    finally:
        policy.shutdown()

    # nothing half-written: rank 0 finished its slice but wrote none of it
    with pytest.raises(FieldNotProduced) as missing:
        client.get_samples(ids, PID, ["prev_logprobs"])
    assert sorted(missing.value.ids) == sorted(ids)
    # leased and never acknowledged: not consumed; handed out again once the lease ran out
    assert not client.check_consumption_status(PID, ["train"])
    again = client.claim_meta(PID, "train", ["input_ids"], len(ids), timeout_s=LEASE_S + 60)
    assert time.monotonic() - claimed_at >= LEASE_S
    assert sorted(again.sample_ids) == sorted(ids)

    # a new policy (no stall) runs the pass; the results are the direct computation's
    fresh = _policy(handle)
    try:
        fresh.get_logprobs_from_meta(again)
    finally:
        fresh.shutdown()
    got = materialize(client.get_data(again, ["input_ids", "prev_logprobs"]))
    lengths = torch.tensor(again.sequence_lengths)
    with torch.no_grad():
        want = reference_logprobs(build_hf_model(MODEL).eval(), got["input_ids"], lengths)
    assert float((want - got["prev_logprobs"]).abs().max()) <= 1e-5
    assert client.ack(again) == len(ids)
    assert client.check_consumption_status(PID, ["train"])
