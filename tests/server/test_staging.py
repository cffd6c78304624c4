"""Staged bytes that nobody commits are reclaimed: on the writer's death, and after a deadline.

A put stages bytes on the units, then commits. A writer that dies in between
must not keep its capacity reserved forever, and a commit that arrives after
its stage was reclaimed is a typed error with nothing made visible.
"""

import contextlib
import sys

import numpy as np
import pytest
import ray
import torch
from polling import wait_until
from unit_memory import memfd_bytes, unit_bytes, unit_pid

from dataplane_client import DataPlaneConfig, connect
from dataplane_client.codec.fields import encode_fields
from dataplane_client.wire import failpoints
from dataplane_client.wire.errors import (
    CapacityExceeded,
    Overloaded,
    RoutingUnstable,
    SamplesNotFound,
    StageReclaimed,
)
from dataplane_server import start

# Ray workers cannot import this test module by name: ship its classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

MiB = 1 << 20


def _stage_only(client, partition_id: str, write_id: str, ids: list[str], fields: dict) -> list:
    """Stage a put's bytes through the client's own transport and stop before the commit."""
    from dataplane_client.client import _run_sync

    encoded = encode_fields(fields, num_rows=len(ids))
    plan = {0: np.arange(len(ids))}
    return _run_sync(client._transport.stage_flow(partition_id, write_id, ids, encoded, plan))


@ray.remote
class Stager:
    """The doomed writer: it stages and never commits."""

    def __init__(self, name: str, namespace: str):
        self.client = connect(name, namespace)

    def stage(self, partition_id: str, ids: list[str], row_bytes: int) -> list:
        rows = torch.ones(len(ids), row_bytes, dtype=torch.uint8)
        results = _stage_only(self.client, partition_id, "doomed", ids, {"x": rows})
        return [repr(r) for r in results if isinstance(r, BaseException)]

    def same_node_path(self) -> list[bool]:
        return self.client._transport.shared


@pytest.fixture
def small_unit(ray_session):
    handle = start(
        DataPlaneConfig(
            name="dp-stage",
            num_storage_units=1,
            unit_capacity_bytes=8 * MiB,
            unit_warm_reserve_bytes=0,
            stage_ttl_s=600,  # far away: only the writer's death can reclaim in time
            admin_enabled=False,
        )
    )
    yield handle
    handle.shutdown()


def test_a_writer_killed_between_stage_and_commit_gives_its_capacity_back(small_unit):
    handle = small_unit
    client = handle.client()
    client.register_partition("p", fields=["x"])
    baseline = unit_bytes(handle)
    writer = Stager.remote(handle.config.name, handle.config.namespace)
    assert ray.get(writer.same_node_path.remote()) == [True]
    assert ray.get(writer.stage.remote("p", [f"d{i}" for i in range(6)], MiB)) == []
    assert unit_bytes(handle) >= baseline + 6 * MiB  # staged, invisible, holding capacity
    with pytest.raises(CapacityExceeded):
        client.put_samples(["late"], "p", {"x": torch.ones(1, 4 * MiB, dtype=torch.uint8)})

    ray.kill(writer)
    wait_until(lambda: unit_bytes(handle) == baseline, 30, "the dead writer's stage to go")
    assert memfd_bytes(unit_pid(handle)) == 0  # the chunk itself is gone, not just the count
    with pytest.raises(SamplesNotFound):
        client.get_samples(["d0"], "p", ["x"])

    # The unit fills to its capacity again.
    ids = [f"full{i}" for i in range(8)]
    client.put_samples(ids, "p", {"x": torch.full((8, MiB), 3, dtype=torch.uint8)})
    assert int(client.get_samples(ids, "p", ["x"])["x"].sum()) == 3 * 8 * MiB
    assert unit_bytes(handle) == 8 * MiB


@contextlib.contextmanager
def _one_unit(name: str, **config):
    """A service of one unit (no warm reserve, no admin endpoint) with partition "p" (field
    "x") registered: its handle and a client. ``config`` sets the rest."""
    handle = start(
        DataPlaneConfig(
            name=name, num_storage_units=1, unit_warm_reserve_bytes=0, admin_enabled=False, **config
        )
    )
    try:
        client = handle.client()
        client.register_partition("p", fields=["x"])
        yield handle, client
    finally:
        handle.shutdown()


def test_a_stage_past_its_deadline_is_reclaimed_and_a_late_publish_is_typed(ray_session):
    with _one_unit("dp-ttl", unit_capacity_bytes=8 * MiB, stage_ttl_s=0.5) as (handle, client):
        baseline = unit_bytes(handle)
        rows = torch.ones(2, 2 * MiB, dtype=torch.uint8)
        _stage_only(client, "p", "slow", ["a", "b"], {"x": rows})  # our process stays alive
        assert unit_bytes(handle) == baseline + 4 * MiB
        wait_until(lambda: unit_bytes(handle) == baseline, 30, "the stage's deadline")
        with pytest.raises(StageReclaimed, match="deadline") as late:  # typed, not a KeyError
            ray.get(handle.units[0].publish.remote("slow"))
        assert not isinstance(late.value, KeyError)
        assert late.value.queue == "commit"
        with pytest.raises(SamplesNotFound):
            client.get_samples(["a"], "p", ["x"])  # nothing of it is visible
        client.put_samples(["a", "b"], "p", {"x": rows})  # a prompt writer is unaffected
        assert torch.equal(client.get_samples(["a", "b"], "p", ["x"])["x"], rows)


def test_a_commit_queued_past_its_puts_deadline_fails_fast_and_costs_no_reclaimed_stage(
    ray_session,
):
    """The put's deadline runs from its admission: a commit that reaches the controller
    after it is refused before any work (Overloaded, queue "commit"), once, and the
    client discards its stage. Before, the stage expired on the unit while the commit
    queued, the commit found it gone, and the client staged again and again."""
    with _one_unit("dp-put-deadline", stage_ttl_s=1.0) as (handle, client):
        rows = torch.arange(8, dtype=torch.int64).reshape(2, 4)
        client.put_samples(["warm0", "warm1"], "p", {"x": rows})  # connected, codecs known
        failpoints.arm(failpoints.COMMIT_QUEUED, "1.5")  # > the 1 s deadline
        try:
            with pytest.raises(Overloaded, match="deadline") as late:
                client.put_samples(["a", "b"], "p", {"x": rows})
        finally:
            failpoints.disarm(failpoints.COMMIT_QUEUED)
        assert not isinstance(late.value, RoutingUnstable)
        assert late.value.queue == "commit"
        assert failpoints.fired(failpoints.COMMIT_QUEUED) == 1  # no second stage and commit
        with pytest.raises(SamplesNotFound):
            client.get_samples(["a"], "p", ["x"])
        unit = handle.units[0]
        wait_until(lambda: ray.get(unit.staged_write_ids.remote()) == [], 30, "the stage's discard")
        counters = ray.get(unit.metrics_snapshot.remote()).stats["counters"]
        assert counters.get("stages_reclaimed_total", 0) == 0  # discarded, never expired
        client.put_samples(["a", "b"], "p", {"x": rows})  # the retry, in time, succeeds
        assert torch.equal(client.get_samples(["a", "b"], "p", ["x"])["x"], rows)
