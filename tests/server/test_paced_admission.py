"""Paced admission (issue 38 item 3): with ``StalenessSpec(pace=True)`` a slow sample is
trained before its window closes instead of going stale, on both clients.

The workload is deterministic and single-threaded: a straggler is started at version 0
beside three fast samples; the trainer trains ``BATCH`` samples per version and only a
full batch (as a blocking claim of ``BATCH`` would). Unpaced, the declared bound lets the
producer start two more fast samples at version 1, the trainer takes them, moves on to
version 2 and the straggler lands stale: dropped. Paced, admission has no room at version 1
while the straggler is outstanding, so the trainer's next batch has to wait for it.
"""

import uuid

import pytest
import torch

from dataplane_client import StalenessSpec
from dataplane_client.wire.errors import InvalidBatch

BATCH = 2
N = 1  # max staleness: the declared bound is (N + 1) x BATCH = 4


def _register(dp, pace):
    pid = f"paced-{uuid.uuid4().hex[:8]}"
    dp.register_partition(
        pid,
        ["x"],
        None,
        ["train"],
        staleness=StalenessSpec(max_staleness=N, admission_batch=BATCH, pace=pace),
    )
    return pid


def _produce(dp, pid, grant, ids):
    dp.put_samples(ids, pid, {"x": torch.zeros(len(ids))}, version=grant.version)
    assert dp.release_rollouts(grant)


def _train_if_full(dp, pid, version):
    """One step when a full batch is ready: claim it and publish the next version."""
    if dp.ready_depth(pid, ["train"], ["x"])["train"] < BATCH:
        return version, []
    meta = dp.claim_meta(pid, "train", ["x"], BATCH)
    dp.set_policy_version(pid, version + 1)
    return version + 1, list(meta.sample_ids)


def _run(dp, pace):
    """The scenario of the module docstring; returns (stale drops, trained ids, the
    admission limit describe showed at version 1)."""
    pid = _register(dp, pace)
    straggler = dp.admit_rollouts(pid, 1)
    fast = [dp.admit_rollouts(pid, 1) for _ in range(3)]
    assert straggler is not None
    assert all(g is not None for g in fast)
    version, trained = 0, []
    _produce(dp, pid, fast[0], ["a"])
    _produce(dp, pid, fast[1], ["b"])
    version, batch = _train_if_full(dp, pid, version)  # a, b at version 0
    trained += batch
    limit_at_1 = dp.describe_partition(pid).staleness.admission_limit
    more = [dp.admit_rollouts(pid, 1) for _ in range(2)]  # fast producers ask again
    _produce(dp, pid, fast[2], ["c"])
    for grant, sid in zip(more, ["d", "e"]):
        if grant is not None:
            _produce(dp, pid, grant, [sid])
    version, batch = _train_if_full(dp, pid, version)
    trained += batch
    _produce(dp, pid, straggler, ["slow"])  # lands now, generated at version 0
    dp.admit_rollouts(pid, 1)  # its producer asks again: admission first drops what is stale
    version, batch = _train_if_full(dp, pid, version)
    trained += batch
    st = dp.describe_partition(pid).staleness
    return st.dropped_stale.get("train", 0), trained, limit_at_1


def test_unpaced_admission_lets_the_straggler_go_stale(dp):
    dropped, trained, limit_at_1 = _run(dp, pace=False)
    assert limit_at_1 == (N + 1) * BATCH
    assert dropped == 1
    assert "slow" not in trained


def test_paced_admission_trains_the_straggler_and_drops_nothing(dp):
    dropped, trained, limit_at_1 = _run(dp, pace=True)
    assert limit_at_1 == BATCH  # the straggler's window closes after this version
    assert dropped == 0
    assert sorted(trained) == ["a", "b", "c", "slow"]


def test_paced_room_follows_the_straggler_and_the_trainers_batch(dp):
    pid = _register(dp, pace=True)
    straggler = dp.admit_rollouts(pid, 1)
    dp.set_policy_version(pid, 1)
    assert dp.admit_rollouts(pid, 2) is None  # 1 + 2 > (0 versions left + 1) x 2
    one = dp.admit_rollouts(pid, 1)
    assert one is not None
    _produce(dp, pid, straggler, ["slow"])
    _produce(dp, pid, one, ["fast"])
    dp.claim_meta(pid, "train", ["x"], BATCH)
    # This version's batch is taken: a sample started now is trained at the next version
    # at the latest, one batch.
    assert dp.describe_partition(pid).staleness.admission_limit == N * BATCH
    dp.set_policy_version(pid, 2)
    assert dp.describe_partition(pid).staleness.admission_limit == (N + 1) * BATCH
    assert dp.admit_rollouts(pid, 4) is not None


def test_pace_is_checked_by_name(dp):
    for spec, message in (
        (StalenessSpec(max_staleness=1, admission_batch=2, pace=1), "pace must be a bool"),
        (StalenessSpec(max_staleness=1, pace=True), "pace needs admission_batch"),
    ):
        with pytest.raises(InvalidBatch, match=message):
            dp.register_partition(f"bad-{uuid.uuid4().hex[:6]}", ["x"], staleness=spec)
