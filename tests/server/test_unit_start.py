"""A storage unit slow to start is slow, not lost.

Found in CI on a loaded machine: a fresh service's controller pinged its units
once, gave each 5 s, and took a unit whose process was still starting for dead,
for good: the service began with no live unit and the first put raised
``SamplesLost: no storage unit is alive``. (A restarted controller would, the same
way, have declared a slow unit's samples lost.) Here every unit's constructor is
held past those 5 s by the ``UNIT_START`` failpoint (the delay a busy node gives).
"""

from __future__ import annotations

import uuid

import pytest
import torch

from dataplane_client.wire import failpoints
from dataplane_client.wire.config import DataPlaneConfig
from dataplane_server import start

UNIT_START_DELAY_S = 7.0  # past the 5 s ordinary ping the first answer once got


@pytest.fixture
def slow_starting_units(ray_session):
    failpoints.arm(failpoints.UNIT_START, str(UNIT_START_DELAY_S))
    try:
        handle = start(
            DataPlaneConfig(
                name=f"slowstart-{uuid.uuid4().hex[:6]}",
                num_storage_units=2,
                admin_enabled=False,
                unit_warm_reserve_bytes=0,
            )
        )
    finally:
        failpoints.disarm(failpoints.UNIT_START)
    yield handle
    handle.shutdown()


def test_units_slow_to_start_are_served_not_lost(slow_starting_units):
    assert failpoints.fired(failpoints.UNIT_START) == 2  # both units were slow
    client = slow_starting_units.client()
    assert [u.alive for u in client.service_info().units] == [True, True]
    client.register_partition("p", ["x"], None, [])
    ids = [f"s{i}" for i in range(16)]
    client.put_samples(ids, "p", {"x": torch.arange(16.0)})
    assert client.get_samples(ids, "p", ["x"])["x"].tolist() == list(range(16))
