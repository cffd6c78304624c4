"""Health follows the controller: gRPC health and ``dataplane_up`` on a real service.

Each test starts its own small service (admin and metrics on free loopback ports)
and kills part of it: the controller for good, the controller with a Ray restart,
or a storage unit. The shared session service is never touched.
"""

from __future__ import annotations

import functools
import re
import threading
import urllib.request

import grpc
import pytest
import ray
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from polling import wait_until
from prometheus_client.parser import text_string_to_metric_families

from dataplane_server.admin.health_watch import HealthWatch
from dataplane_server.admin_pb import admin_pb2, admin_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
ADMIN_SERVICE = "dataplane.admin.v1.AdminService"


def _scrape(address: str) -> dict[str, float]:
    """{'name{label=value,...}': value} of one /metrics scrape."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


@pytest.fixture
def fresh(service_factory):
    """Services of their own, with the admin endpoint, two units each."""
    return functools.partial(service_factory, "health", num_storage_units=2)


class Health:
    """A gRPC health client of one service's admin endpoint."""

    def __init__(self, address: str):
        self.channel = grpc.insecure_channel(address)
        self.stub = health_pb2_grpc.HealthStub(self.channel)

    def status(self, service: str = "") -> int:
        req = health_pb2.HealthCheckRequest(service=service)
        return self.stub.Check(req, timeout=10).status

    def close(self) -> None:
        self.channel.close()


def test_a_controller_gone_for_good_is_not_serving_and_down(fresh):
    h = fresh()
    probe = Health(h.admin_address)
    try:
        wait_until(lambda: probe.status() == SERVING, 30, "health SERVING at start")
        assert _scrape(h.metrics_address)["dataplane_up{}"] == 1
        ray.kill(h.controller, no_restart=True)
        wait_until(lambda: probe.status() == NOT_SERVING, 30, "health NOT_SERVING")
        assert probe.status(ADMIN_SERVICE) == NOT_SERVING
        assert _scrape(h.metrics_address)["dataplane_up{}"] == 0
    finally:
        probe.close()


def test_health_follows_a_controller_restart(fresh):
    h = fresh()
    probe = Health(h.admin_address)
    try:
        wait_until(lambda: probe.status() == SERVING, 30, "health SERVING at start")
        ray.kill(h.controller, no_restart=False)  # Ray restarts it; it rebuilds its key space
        restarted = threading.Event()

        def controller_back() -> None:
            ray.get(h.controller.service_info.remote(), timeout=120)  # served once rebuilt
            restarted.set()

        waiter = threading.Thread(target=controller_back, daemon=True)
        waiter.start()

        def back_and_serving() -> bool:
            return restarted.is_set() and probe.status() == SERVING

        wait_until(back_and_serving, 120, "SERVING after the controller restarted")
        waiter.join(timeout=10)
        metrics = _scrape(h.metrics_address)
        assert metrics["dataplane_up{}"] == 1
        assert metrics["dataplane_controller_restarts_total{}"] >= 1
        # NOT_SERVING while it is down is proven by the gone-for-good test above; here a
        # restart may finish within one probe round, so only "back to SERVING" is asserted.
    finally:
        probe.close()


def test_a_dead_unit_shows_in_service_info_watch_and_metrics(fresh):
    h = fresh()
    channel = grpc.insecure_channel(h.admin_address)
    stub = admin_pb2_grpc.AdminServiceStub(channel)
    try:

        def units_alive() -> list[bool]:
            info = stub.GetServiceInfo(admin_pb2.GetServiceInfoRequest(), timeout=30)
            return [u.alive for u in info.units]

        assert units_alive() == [True, True]
        ray.kill(h.units[1], no_restart=True)
        wait_until(lambda: units_alive() == [True, False], 30, "unit 1 reported dead")
        [snap] = stub.WatchStats(admin_pb2.WatchStatsRequest(count=1), timeout=30)
        assert [u.alive for u in snap.units] == [True, False]
        metrics = _scrape(h.metrics_address)
        up = {
            re.search(r"unit=(\d+)", k).group(1): v
            for k, v in metrics.items()
            if k.startswith("dataplane_unit_up{")
        }
        assert up == {"0": 1, "1": 0}
        assert metrics["dataplane_units_lost_total{}"] == 1
        assert metrics["dataplane_up{}"] == 1  # the service keeps serving without the unit
        assert Health(h.admin_address).status() == SERVING
    finally:
        channel.close()


def test_a_drain_wins_over_a_ready_controller():
    servicer = health.HealthServicer()
    ready = threading.Event()
    watch = HealthWatch(
        servicer, lambda _timeout_s: ready.is_set(), services=("", ADMIN_SERVICE), interval_s=3600
    )

    def status() -> int:
        request = health_pb2.HealthCheckRequest(service=ADMIN_SERVICE)
        return servicer.Check(request, None).status

    watch.start()
    try:
        assert status() == NOT_SERVING  # the probe said "not ready"
        ready.set()
        assert watch.check()
        assert status() == SERVING
        watch.drain()
        assert status() == NOT_SERVING
        assert watch.check()  # the controller still answers ...
        assert status() == NOT_SERVING  # ... but a drained service stays out of rotation
    finally:
        watch.stop()
