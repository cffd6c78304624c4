"""Durable storage units on a real local Ray: a unit process killed with SIGKILL restarts
(Ray's max_restarts) and re-attaches its chunk files and row index, with no replicas.

Each test asserts that every committed sample reads back bit for bit, that cursors,
leases and grants are as they were, and that no unit is ever declared lost: alone,
under writes, and with the controller restarted before or after the unit.
"""

from __future__ import annotations

import functools
import os
import signal

import pytest
import ray
import torch
from polling import wait_until
from ray_writers import values, writer_class

import dataplane_client.client as client_module
from dataplane_client.wire.config import DataPlaneConfig
from dataplane_client.wire.errors import ConfigError
from dataplane_server.core.unit import durable_layout

WIDTH = 4096  # 16 KiB rows: same-node puts copy into the unit's files themselves


def _values(ids: list[str]) -> torch.Tensor:
    """Each sample's row is a pure function of its id, so any mix-up is visible."""
    return values(ids, WIDTH)


@pytest.fixture
def durable(service_factory, tmp_path):
    """A service of its own at durability ``process`` with its state under ``tmp_path``
    (its files on RAM removed after the test)."""
    settings = {"durability": "process", "state_dir": str(tmp_path / "state")}
    yield functools.partial(service_factory, "durable", admin_enabled=False, **settings)
    durable_layout.remove_state(DataPlaneConfig(**settings))


def _unit_pid(h, index: int) -> int | None:
    """The unit's process id; None while Ray restarts it."""
    try:
        return ray.get(h.units[index].ping.remote(), timeout=120).pid
    except ray.exceptions.RayActorError:
        return None


def _sigkill_unit(h, index: int) -> None:
    """SIGKILL the unit's process; return once Ray's restart of it answers."""
    old = _unit_pid(h, index)
    assert old is not None
    os.kill(old, signal.SIGKILL)
    wait_until(lambda: _unit_pid(h, index) not in (old, None), 120, "the unit's restart")


def _restart_controller(h) -> None:
    ray.kill(h.controller, no_restart=False)
    wait_until(
        lambda: client_module._actor_state(h.controller._actor_id.hex())[1] == "ALIVE",
        120,
        "the controller's restart",
    )


def _prepared(h):
    """A partition with samples, task ``t`` half consumed, a lease held on ``u``."""
    c = h.client()
    c.register_partition("p", ["x"], None, ["t", "u"], task_leases={"u": 600.0})
    ids = [f"pre-{i}" for i in range(24)]
    c.put_samples(ids, "p", {"x": _values(ids)})
    first = c.claim_meta("p", "t", ["x"], 10)
    held = c.claim_meta("p", "u", ["x"], 3)
    return c, ids, first, held


def _check_kept(c, ids, first, held) -> None:
    """Every sample bit for bit; ``t`` resumes after ``first``; ``u``'s lease still held."""
    assert torch.equal(c.get_samples(ids, "p", ["x"])["x"], _values(ids))
    rest = c.claim_meta("p", "t", ["x"], 100_000, blocking=False).sample_ids
    assert sorted(rest) == sorted(set(ids) - set(first.sample_ids))
    again = c.claim_meta("p", "u", ["x"], 100_000, blocking=False).sample_ids
    assert not set(again) & set(held.sample_ids)  # leased, not handed out again
    assert c.ack(held) == len(held.sample_ids)
    assert all(u.alive for u in c.service_info().units)


def test_a_killed_unit_restarts_with_every_sample_cursor_and_lease(durable):
    h = durable(num_storage_units=1)
    c, ids, first, held = _prepared(h)
    _sigkill_unit(h, 0)
    _check_kept(c, ids, first, held)
    c.put_samples(["after"], "p", {"x": _values(["after"])})  # and it takes writes again
    assert torch.equal(c.get_samples(["after"], "p", ["x"])["x"], _values(["after"]))


@pytest.mark.parametrize("order", ["unit_then_controller", "controller_then_unit"])
def test_a_unit_and_the_controller_restarted_in_either_order_lose_nothing(durable, order):
    h = durable(num_storage_units=1)
    c, ids, first, held = _prepared(h)
    if order == "unit_then_controller":
        _sigkill_unit(h, 0)
        _restart_controller(h)
    else:
        _restart_controller(h)
        _sigkill_unit(h, 0)
    _check_kept(c, ids, first, held)


@pytest.mark.slow
def test_a_unit_killed_under_writes_loses_no_committed_sample(durable):
    h = durable(num_storage_units=1)
    c, ids, first, held = _prepared(h)
    writer = writer_class().remote(h.config.name, h.config.namespace)
    run = writer.write.remote("p", 60, 8, WIDTH, attempts=50)
    wait_until(lambda: ray.get(writer.progress.remote()) >= 80, 180, "writes under way")
    _sigkill_unit(h, 0)
    done, untyped = ray.get(run, timeout=600)
    assert untyped == []
    assert len(done) == 480  # every put went in, across the restart
    _check_kept(c, [*ids, *done], first, held)


def test_a_durable_level_without_a_state_dir_or_machine_on_ram_is_refused(ray_session):
    from dataplane_server import start

    with pytest.raises(ConfigError, match="needs state_dir"):
        DataPlaneConfig(durability="process")
    if os.path.isdir("/dev/shm"):
        with pytest.raises(ConfigError, match="on a disk") as e:
            start(DataPlaneConfig(durability="machine", state_dir="/dev/shm/dp-refused"))
        assert "tmpfs" in str(e.value)
        assert not os.path.exists("/dev/shm/dp-refused")  # refused before anything is made


def test_the_level_and_state_dir_show_in_service_info_the_admin_api_describe_and_metrics(durable):
    import urllib.request

    import grpc

    from dataplane_server.admin_pb import admin_pb2, admin_pb2_grpc

    h = durable(num_storage_units=1, admin_enabled=True)
    state_dir = h.config.state_dir
    info = h.client().service_info()
    assert (info.durability, info.state_dir) == ("process", state_dir)
    with grpc.insecure_channel(h.admin_address) as ch:
        got = admin_pb2_grpc.AdminServiceStub(ch).GetServiceInfo(
            admin_pb2.GetServiceInfoRequest(), timeout=60
        )
    assert (got.durability, got.state_dir) == ("process", state_dir)
    h.client().register_partition("shown", ["x"])
    with grpc.insecure_channel(h.admin_address) as ch:
        described = admin_pb2_grpc.AdminServiceStub(ch).DescribePartition(
            admin_pb2.DescribePartitionRequest(partition_id="shown"), timeout=60
        )
    assert described.durability == "process"
    assert not described.HasField("checkpointed_samples")  # no checkpoint saved yet
    with urllib.request.urlopen(f"http://{h.metrics_address}/metrics", timeout=60) as r:
        text = r.read().decode()
    assert f'dataplane_durability_info{{level="process",state_dir="{state_dir}"}} 1.0' in text
