"""Controller crashes in the middle of claims: every sample delivered exactly once per task.

Claimer threads of a cursor task and of a leased task claim in rounds, one batch each
at once; in each round the controller is killed right after it journaled a claim and
before its answer left (the failpoint ``claim-answer-lost``), so every kill lands in
the window that used to lose a batch. Then they drain the partition. Before claim
request ids, such kills lost a cursor batch and the partition still reported done.

Which claim a kill lands on is what can differ between kills: a cursor claim (its
batch consumed by the replay) or a leased claim (its lease held), alone with a claim
of its own task or in one batch with the other task's. Each round names one of these
three crash points, so each is hit once, where twenty kills of four racing claimers
hit them by chance (200 s of CI; a kill and restart costs 10-30 s here). The second
and third kills land on a controller that already restarted, whose journal replays
the answered claims of the kills before (test_claim_identity.py checks a late ack
across two restarts on its own).
"""

import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import ray._private.state as ray_state
import torch
from polling import wait_until

from dataplane_client.wire import failpoints
from dataplane_client.wire.errors import ClaimTimeout

N = 1_000
BATCH = 16
# The claimers of each round; the first to reach the controller while armed crashes it.
ROUNDS = (
    ("cursor", "cursor"),
    ("leased", "leased"),
    ("cursor", "cursor", "leased", "leased"),
)
KILLS = len(ROUNDS)
ALL_CLAIMERS = ROUNDS[2]


def _claim_one(client, task: str, blocking: bool) -> list[str]:
    """A claim riding over a crash blocks (Ray retries it on the restarted controller);
    one draining the rest does not: every sample is committed by then, so finding none
    means the task is done, where a blocking claim would wait out its 60 s timeout."""
    try:
        meta = client.claim_meta("p", task, ["x"], BATCH, timeout_s=60.0, blocking=blocking)
    except ClaimTimeout:
        return []  # nothing left for this task
    if meta.size and task == "leased":
        assert client.ack(meta) == meta.size
    return list(meta.sample_ids)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_controller_crashes_mid_claim_lose_no_sample(service_factory):
    h = service_factory("claim-crashes", num_storage_units=2, admin_enabled=False)
    client = h.client()
    client.register_partition("p", ["x"], N, ["cursor", "leased"], task_leases={"leased": 120.0})
    for start in range(0, N, 500):
        ids = [f"s{i}" for i in range(start, start + 500)]
        client.put_samples(ids, "p", {"x": torch.arange(start, start + 500).reshape(-1, 1)})

    delivered: Counter = Counter()
    armed = Path(os.environ[failpoints.ENV]) / failpoints.CLAIM_ANSWER_LOST
    controller_id = h.controller._actor_id.hex()

    def claim_round(pool, tasks, blocking: bool = True) -> int:
        """Each claimer claims one batch at once (one claim_many, or a wait of its own)."""
        got = list(pool.map(lambda task: (task, _claim_one(client, task, blocking)), tasks))
        for task, ids in got:
            delivered.update((task, s) for s in ids)
        return sum(len(ids) for _, ids in got)

    with ThreadPoolExecutor(len(ALL_CLAIMERS)) as pool:
        try:
            for kill, tasks in enumerate(ROUNDS, start=1):
                armed.touch()
                claim_round(pool, tasks)
                assert not armed.exists(), f"round {kill}: no claim crashed the controller"
                wait_until(
                    lambda kill=kill: ray_state.actors(controller_id).get("NumRestarts", 0) >= kill,
                    120,
                    f"restart {kill}",
                )
        finally:
            armed.unlink(missing_ok=True)
        while claim_round(pool, ALL_CLAIMERS, blocking=False):  # the rest, without faults
            pass
    assert ray_state.actors(controller_id).get("NumRestarts", 0) == KILLS
    for task in ("cursor", "leased"):
        got = Counter({s: n for (t, s), n in delivered.items() if t == task})
        assert len(got) == N, f"{task}: {N - len(got)} samples never delivered"
        assert set(got.values()) == {1}, f"{task}: delivered twice: {got.most_common(3)}"
    assert client.check_consumption_status("p", ["cursor", "leased"])
