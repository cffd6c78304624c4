"""Async RL across faults: the bound and its state survive a controller restart and a
checkpoint; a producer that dies holding a grant gives it back after the grant's lease;
a checkpoint restored into a fresh service brings back no grant."""

import time

import pytest
import ray
import ray._private.state as ray_state
import torch
from polling import wait_until

from dataplane_client import StalenessSpec
from dataplane_client.wire.errors import CapacityExceeded

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]

SPEC = StalenessSpec(max_staleness=1, admission_batch=8)  # bound: 16 started, untrained


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
    wait_until(lambda: _restarts(h) >= 1, 60, "the controller's restart")
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


def test_a_restore_brings_back_no_grant_and_counts_only_what_the_checkpoint_holds(
    service_factory, tmp_path
):
    """The saved service's writers cannot release their grants in the new service: held,
    they shut the window (until their lease ran out) and the version's over-sampling cap
    (for good), and a resumed run could never generate the groups it lacks."""
    src = service_factory("async-grants-src", num_storage_units=1, admin_enabled=False)
    dst = service_factory("async-grants-dst", num_storage_units=1, admin_enabled=False)
    c = src.client()
    spec = StalenessSpec(max_staleness=0, admission_batch=4, oversample_ratio=1)
    c.register_partition("p", ["x"], None, ["train"], staleness=spec)
    put = c.admit_rollouts("p", 2)
    _put(c, ["a", "b"], 0)
    assert c.release_rollouts(put)
    c.admit_rollouts("p", 2)  # its writer dies before putting anything
    assert c.admit_rollouts("p", 1) is None  # the window (4) is full
    d = dst.client()
    assert d.restore(c.checkpoint(str(tmp_path / "ck"))) == 2
    assert d.describe_partition("p").staleness.grants == 0
    assert d.admit_rollouts("p", 2) is not None  # the lost group's room, at once
    assert d.admit_rollouts("p", 1) is None  # "a" and "b" still count: 2 + 2 of 4


@pytest.mark.parametrize("evict", [True, False], ids=["evict_stale", "no_eviction"])
def test_a_full_unit_evicts_the_oldest_unclaimed_version_only_when_opted_in(service_factory, evict):
    h = service_factory(
        "async-evict", num_storage_units=1, admin_enabled=False, unit_capacity_bytes=1 << 20
    )
    c = h.client()
    spec = StalenessSpec(max_staleness=5, evict_stale=evict)
    c.register_partition("p", ["x"], None, ["train"], 2, staleness=spec)

    def put_group(name, version):
        c.put_samples(
            [f"{name}-0", f"{name}-1"],
            "p",
            {"x": torch.zeros(2, 96 * 1024, dtype=torch.uint8)},
            tags=[{"weight_version": version, "group_id": name}] * 2,
        )

    for i in range(4):  # 4 groups x 192 KiB of a 1 MiB unit
        put_group(f"g{i}", i // 2)
    claimed = c.claim_meta("p", "train", ["x"], 2)  # g0 (version 0) is claimed: it stays
    assert claimed.sample_ids == ["g0-0", "g0-1"]
    if not evict:
        put_group("g4", 2)  # 5 x 192 KiB still fit in 1 MiB
        with pytest.raises(CapacityExceeded):
            put_group("g5", 2)
        assert c.describe_partition("p").staleness.evicted == 0
        return
    for i in range(4, 12):
        put_group(f"g{i}", 2)
    info = c.describe_partition("p").staleness
    assert info.evicted >= 2
    evicted = set(info.recently_dropped)
    assert "g0-0" not in evicted  # claimed: never evicted
    assert {"g1-0", "g1-1"} <= evicted  # the oldest unclaimed version went first
    assert all(s.split("-")[1] in "01" for s in evicted)
    groups = {s.split("-")[0] for s in evicted}
    assert all({f"{g}-0", f"{g}-1"} <= evicted for g in groups)  # whole groups only
