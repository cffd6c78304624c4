"""build_data_plane_client: a NeMo-RL-style config mapping -> our client; one value switches it."""

import uuid

import pytest
import torch

from dataplane_client import DataPlaneClient, RayDataPlaneClient
from dataplane_client.wire.errors import ConfigError, ServiceUnavailable
from dataplane_server.core.inprocess import InProcessDataPlaneClient
from dataplane_server.launch.factory import (
    build_data_plane_client,
    service_config,
    shutdown_started,
)


def _name() -> str:
    return f"f-{uuid.uuid4().hex[:8]}"


def _round_trip(client: DataPlaneClient) -> list[float]:
    pid = _name()
    client.register_partition(pid, ["x"], 2, ["t"])
    client.put_samples(["a", "b"], pid, {"x": torch.tensor([1.0, 2.0])})
    meta = client.claim_meta(pid, "t", ["x"], 2)
    return sorted(client.get_data(meta)["x"].tolist())


@pytest.mark.parametrize(
    ("cfg", "needle"),
    [
        ({"enabled": False, "impl": "ray"}, "enabled"),
        ({"impl": "ray"}, "enabled"),
        ({"enabled": True, "impl": "redis"}, "'redis'"),
        ({"enabled": True}, "None"),
        ({"enabled": True, "impl": "ray", "num_storage_unit": 2}, "num_storage_unit"),
        ({"enabled": True, "impl": "ray", "storage_capacity": "lots"}, "storage_capacity"),
        ({"enabled": True, "impl": "ray", "service": {"admin_port": -1}}, "admin_port"),
        ("enabled", "mapping"),
    ],
)
def test_a_bad_config_is_a_value_error_naming_what_is_wrong(cfg, needle):
    with pytest.raises(ValueError, match=needle) as e:
        build_data_plane_client(cfg)
    assert isinstance(e.value, ConfigError)


def test_the_mapping_becomes_the_service_config():
    config = service_config(
        {
            "enabled": True,
            "impl": "transfer_queue",
            "name": "svc",
            "num_storage_units": 4,
            "storage_capacity": "8GiB",
            "service": {"admin_enabled": False},
        }
    )
    assert (config.name, config.num_storage_units) == ("svc", 4)
    assert config.unit_capacity_bytes == 2 << 30
    assert config.admin_enabled is False


def test_in_process_driver_and_workers_share_one_store():
    cfg = {"enabled": True, "impl": "in_process", "name": _name()}
    with pytest.raises(ServiceUnavailable, match="bootstrap=True"):
        build_data_plane_client(cfg, bootstrap=False)
    driver = build_data_plane_client(cfg)
    worker = build_data_plane_client(cfg, bootstrap=False)
    assert isinstance(driver, InProcessDataPlaneClient)
    assert worker is driver
    assert _round_trip(worker) == [1.0, 2.0]
    driver.close()
    with pytest.raises(ServiceUnavailable):
        build_data_plane_client(cfg, bootstrap=False)
    assert build_data_plane_client(cfg) is not driver


@pytest.mark.parametrize("impl", ["transfer_queue", "ray"])
def test_a_worker_connects_to_the_running_service(service, impl):
    cfg = {
        "enabled": True,
        "impl": impl,
        "name": service.config.name,
        "namespace": service.config.namespace,
    }
    client = build_data_plane_client(cfg, bootstrap=False)
    assert isinstance(client, RayDataPlaneClient)
    assert _round_trip(client) == [1.0, 2.0]
    with pytest.raises(ServiceUnavailable, match="no data-plane service"):
        build_data_plane_client({**cfg, "name": _name()}, bootstrap=False)


@pytest.mark.slow
def test_a_driver_starts_the_service_when_none_runs(ray_session):
    name = _name()
    cfg = {
        "enabled": True,
        "impl": "transfer_queue",
        "name": name,
        "namespace": name,
        "num_storage_units": 1,
        "storage_capacity": "64MiB",
        "service": {"admin_enabled": False, "metrics_enabled": False},
    }
    driver = build_data_plane_client(cfg)
    try:
        worker = build_data_plane_client(cfg, bootstrap=False)
        assert _round_trip(driver) == [1.0, 2.0]
        assert worker.service_info().units[0].capacity_bytes == 64 << 20
        # A second driver connects (starting again would clash on the actor name).
        assert isinstance(build_data_plane_client(cfg), RayDataPlaneClient)
    finally:
        assert shutdown_started(name)
    assert not shutdown_started(name)
    with pytest.raises(ServiceUnavailable):
        build_data_plane_client(cfg, bootstrap=False)


def test_the_package_exports_the_factory_and_the_twin():
    import dataplane_server
    from dataplane_server.core import inprocess
    from dataplane_server.launch import factory

    assert dataplane_server.build_data_plane_client is factory.build_data_plane_client
    assert dataplane_server.shutdown_started is factory.shutdown_started
    assert dataplane_server.InProcessDataPlaneClient is inprocess.InProcessDataPlaneClient
    with pytest.raises(AttributeError, match="no_such"):
        dataplane_server.no_such  # noqa: B018 - the attribute access is the test
