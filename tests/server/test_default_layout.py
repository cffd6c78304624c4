"""The configuration a user gets from ``start()`` is the fast layout: one unit per alive node.

Two units on one node would turn every same-node get into a gather of both;
with one, a get of contiguous rows maps the unit's shared memory, zero-copy.
An explicit unit count still means that many units.
"""

import pytest
import torch

from dataplane_client import DataPlaneConfig
from dataplane_server import start


def _mapped_from_unit_memory(t: torch.Tensor) -> bool:
    """Whether the tensor's bytes lie in a mapping of a unit's memfd (no copy was made)."""
    addr = t.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, *rest = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= addr < hi:
                return len(rest) == 5 and rest[4].startswith("/memfd:dataplane-")
    return False


@pytest.fixture(scope="module")
def default_service(ray_session):
    # Only what makes it a separate service in the test session; everything else default.
    # Shared by the module's tests: one counts its units, the other writes its own partition.
    handle = start(DataPlaneConfig(name="dp-default-layout", admin_enabled=False))
    yield handle
    handle.shutdown()


def test_the_default_config_starts_one_unit_per_alive_node(default_service, ray_session):
    alive = [n for n in ray_session.nodes() if n.get("Alive")]
    assert DataPlaneConfig().num_storage_units == 0
    assert len(default_service.units) == len(alive) == 1


def test_a_default_same_node_get_is_zero_copy(default_service):
    client = default_service.client()
    assert client._transport.shared == [True]
    client.register_partition("p", fields=["x"])
    rows = torch.arange(64 * 1024, dtype=torch.float32).reshape(64, 1024)
    client.put_samples([f"s{i}" for i in range(64)], "p", {"x": rows})
    got = client.get_samples([f"s{i}" for i in range(64)], "p", ["x"])["x"]
    assert torch.equal(got, rows)
    assert _mapped_from_unit_memory(got)


def test_an_explicit_unit_count_still_starts_that_many(ray_session):
    handle = start(DataPlaneConfig(name="dp-two-units", num_storage_units=2, admin_enabled=False))
    try:
        assert len(handle.units) == 2
    finally:
        handle.shutdown()
