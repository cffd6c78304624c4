"""20 controller crashes in the middle of claims: every sample delivered exactly once per task.

Four claimer threads (two of a cursor task, two of a leased task) claim in
rounds, one batch each at once; in each of 20 rounds the controller is killed
right after it journaled a claim and before its answer left (the failpoint
``claim-answer-lost``), so every kill lands in the window that used to lose a
batch. Then they drain the partition. Before claim request ids, about 15% of such kills lost a cursor batch
and the partition still reported done.
"""

import os
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import ray._private.state as ray_state
import torch

from dataplane_client import failpoints
from dataplane_client.errors import ClaimTimeout

N = 1_000
BATCH = 16
KILLS = 20


def _wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _claim_one(client, task: str) -> list[str]:
    try:
        meta = client.claim_meta("p", task, ["x"], BATCH, timeout_s=60.0)
    except ClaimTimeout:
        return []  # nothing left for this task
    if task == "leased":
        assert client.ack(meta) == meta.size
    return list(meta.sample_ids)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_twenty_controller_crashes_mid_claim_lose_no_sample(service_factory):
    h = service_factory("claim-crashes", num_storage_units=2, admin_enabled=False)
    client = h.client()
    client.register_partition("p", ["x"], N, ["cursor", "leased"], task_leases={"leased": 120.0})
    for start in range(0, N, 500):
        ids = [f"s{i}" for i in range(start, start + 500)]
        client.put_samples(ids, "p", {"x": torch.arange(start, start + 500).reshape(-1, 1)})

    delivered: Counter = Counter()
    tasks = ["cursor", "cursor", "leased", "leased"]
    armed = Path(os.environ[failpoints.ENV]) / failpoints.CLAIM_ANSWER_LOST
    controller_id = h.controller._actor_id.hex()

    def claim_round(pool) -> int:
        """Each claimer claims one batch at once (one claim_many, or a wait of its own)."""
        got = list(pool.map(lambda task: (task, _claim_one(client, task)), tasks))
        for task, ids in got:
            delivered.update((task, s) for s in ids)
        return sum(len(ids) for _, ids in got)

    with ThreadPoolExecutor(len(tasks)) as pool:
        try:
            for kill in range(1, KILLS + 1):
                armed.touch()
                claim_round(pool)
                assert not armed.exists(), f"round {kill}: no claim crashed the controller"
                _wait_until(
                    lambda kill=kill: ray_state.actors(controller_id).get("NumRestarts", 0) >= kill,
                    120,
                    f"restart {kill}",
                )
        finally:
            armed.unlink(missing_ok=True)
        while claim_round(pool):  # the rest, without faults
            pass
    assert ray_state.actors(controller_id).get("NumRestarts", 0) == KILLS
    for task in ("cursor", "leased"):
        got = Counter({s: n for (t, s), n in delivered.items() if t == task})
        assert len(got) == N, f"{task}: {N - len(got)} samples never delivered"
        assert set(got.values()) == {1}, f"{task}: delivered twice: {got.most_common(3)}"
    assert client.check_consumption_status("p", ["cursor", "leased"])
