"""Async RL across faults: the bound and its state survive a controller restart and a
checkpoint; a producer that dies holding a grant gives it back after the grant's lease."""

import time

import pytest
import ray
import ray._private.state as ray_state
import torch

from dataplane_client import StalenessSpec

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]

SPEC = StalenessSpec(max_staleness=1, admission_batch=8)  # bound: 16 started, untrained


def _wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _restarts(h) -> int:
    info = ray_state.actors(h.controller._actor_id.hex())
    return int(info.get("NumRestarts", 0)) if info.get("State") == "ALIVE" else -1


def _put(c, ids, version):
    c.put_samples(
        ids,
        "p",
        {"x": torch.zeros(len(ids), 2)},
        tags=[{"weight_version": version} for _ in ids],
    )


def test_a_controller_killed_between_a_version_bump_and_a_claim_keeps_the_bound(
    service_factory,
):
    h = service_factory("async-restart", num_storage_units=1, admin_enabled=False)
    c = h.client()
    c.register_partition("p", ["x"], None, ["train"], staleness=SPEC)
    for v in range(3):
        _put(c, [f"v{v}-a", f"v{v}-b"], v)
    kept = c.admit_rollouts("p", 2)
    released = c.admit_rollouts("p", 1)
    assert c.release_rollouts(released)
    c.set_policy_version("p", 2)  # drops version 0
    ray.kill(h.controller, no_restart=False)
    _wait_until(lambda: _restarts(h) >= 1, 60, "the controller's restart")
    assert c.policy_version("p") == 2
    info = c.describe_partition("p").staleness
    assert info.dropped_stale == {"train": 2}
    assert (info.grants, info.granted_in_flight) == (1, 2)  # the released one stays released
    # The rebuilt key space (from the units) still bounds claims by the version.
    meta = c.claim_meta("p", "train", ["x"], 8, blocking=False)
    assert sorted(meta.sample_ids) == ["v1-a", "v1-b", "v2-a", "v2-b"]
    assert c.release_rollouts(kept)
    with pytest.raises(ValueError, match="below the current 2"):
        c.set_policy_version("p", 1)


def test_a_producer_killed_holding_a_grant_gives_it_back_after_its_lease(service_factory):
    h = service_factory("async-producer", num_storage_units=1, admin_enabled=False)
    c = h.client()
    c.register_partition(
        "p", ["x"], None, ["train"], staleness=StalenessSpec(max_staleness=0, admission_batch=2)
    )

    @ray.remote(num_cpus=0)
    class Producer:
        def __init__(self, name, namespace):
            from dataplane_client import connect

            self.c = connect(name, namespace)

        def start(self):
            return self.c.admit_rollouts("p", 2, lease_s=2.0) is not None

    producer = Producer.remote(h.config.name, h.config.namespace)
    assert ray.get(producer.start.remote())
    ray.kill(producer)
    assert c.admit_rollouts("p", 1) is None  # the dead producer's grant still counts
    started = time.monotonic()
    grant = c.admit_rollouts("p", 2, wait=True, timeout_s=30)
    assert grant is not None
    assert time.monotonic() - started < 25  # woken by the expiry, not by the timeout


def test_versions_and_drops_survive_a_checkpoint_and_restore(service_factory, tmp_path):
    src = service_factory("async-ckpt-src", num_storage_units=1, admin_enabled=False)
    dst = service_factory("async-ckpt-dst", num_storage_units=1, admin_enabled=False)
    c = src.client()
    c.register_partition("p", ["x"], None, ["train"], staleness=SPEC)
    _put(c, ["old"], 0)
    _put(c, ["new"], 3)
    c.set_policy_version("p", 3)
    path = c.checkpoint(str(tmp_path / "ck"))
    d = dst.client()
    assert d.restore(path) == 1
    assert d.policy_version("p") == 3
    assert d.describe_partition("p").staleness.dropped_stale == {"train": 1}
    _put(d, ["late"], 1)  # stale on arrival: the restored bound still holds
    assert d.claim_meta("p", "train", ["x"], 4, blocking=False).sample_ids == ["new"]
