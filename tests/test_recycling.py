"""Recycled shared memory: a freed chunk is reused for later writes only once no reader sees it.

A unit hands a freed chunk to the next write of its size (its pages and the
writer's mapping of it are kept), which makes a same-node put one plain copy.
A reader's zero-copy tensors map a chunk copy-on-write, and such a mapping sees
later writes to pages it has not touched: so every read holds a lease on the
chunks it was told about, released when its last mapping goes (or its process
dies), and a leased chunk is closed instead of recycled. These tests read their
own bytes back while the memory around them is cleared and written again.
"""

import sys
import time

import pytest
import ray
import torch

from dataplane_client import DataPlaneConfig, connect, shm
from dataplane_server import start

ROWS = 8
ROW_FLOATS = 128 * 1024  # 512 KiB a row, 4 MiB a write: a chunk of its own, not a slab


def _rows(value: float) -> torch.Tensor:
    return torch.full((ROWS, ROW_FLOATS), value)


def _ids(tag: str) -> list[str]:
    return [f"{tag}{i}" for i in range(ROWS)]


def _unit(handle, what: str):
    return ray.get(handle.units[0].__ray_call__.remote(lambda self: getattr(self, what)))


def _recycled(handle) -> int:
    return ray.get(handle.units[0].recycled_chunks.remote())


def _wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(0.05)  # polling interval while observing the unit, not synchronisation


@pytest.fixture
def unit(ray_session):
    handle = start(DataPlaneConfig(name="dp-recycle", num_storage_units=1, admin_enabled=False))
    yield handle
    handle.shutdown()


def test_a_freed_chunk_nobody_reads_is_reused_and_the_writer_keeps_its_mapping(unit):
    client = unit.client()
    assert client._transport.shared == [True]
    client.register_partition("p", fields=["x"])
    for i in range(4):
        client.put_samples(_ids("a"), "p", {"x": _rows(i)})
        assert torch.equal(client.get_samples(_ids("a"), "p", ["x"])["x"], _rows(i))
        client.clear_samples(_ids("a"), "p")  # the tensors above are gone: leases released
    assert _recycled(unit) >= 3
    # The writes went through mappings this process kept, not one mapping per put.
    assert 0 < shm.write_maps.mapped_bytes() <= 3 * ROWS * ROW_FLOATS * 4


def test_a_reader_holding_tensors_sees_its_own_bytes_while_the_memory_is_cleared_and_reused(
    unit,
):
    client = unit.client()
    client.register_partition("p", fields=["x"])
    client.put_samples(_ids("held"), "p", {"x": _rows(1.0)})
    held = client.get_samples(_ids("held"), "p", ["x"])["x"]  # zero-copy: maps the chunk
    assert _unit(unit, "read_leases")  # the read holds a lease while its tensors live
    client.clear_samples(_ids("held"), "p")
    for i in range(6):  # writes of the same size: each would take a recycled chunk
        client.put_samples(_ids(f"new{i}-"), "p", {"x": _rows(100.0 + i)})
        client.clear_samples(_ids(f"new{i}-"), "p")
    assert torch.equal(held, _rows(1.0)), "a recycled chunk overwrote bytes a reader holds"
    del held
    _wait_until(lambda: not _unit(unit, "read_leases"), 30, "the lease to be released")


def reader_class():
    """A reader actor; this module travels by value (Ray workers cannot import tests)."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

    @ray.remote
    class Reader:
        def __init__(self, name: str, namespace: str):
            self.client = connect(name, namespace)
            self.held = None

        def hold(self, partition_id: str, ids: list[str]) -> float:
            self.held = self.client.get_samples(ids, partition_id, ["x"])["x"]
            return float(self.held[0, 0])

    return Reader


def test_the_leases_of_a_dead_reader_are_released_and_its_chunk_recycled(unit):
    client = unit.client()
    client.register_partition("p", fields=["x"])
    client.put_samples(_ids("r"), "p", {"x": _rows(5.0)})
    reader = reader_class().remote(unit.config.name, unit.config.namespace)
    assert ray.get(reader.hold.remote("p", _ids("r"))) == 5.0
    assert _unit(unit, "read_leases")
    ray.kill(reader)  # its mappings die with it; it never says so
    _wait_until(lambda: not _unit(unit, "read_leases"), 60, "the dead reader's lease to go")
    before = _recycled(unit)
    client.clear_samples(_ids("r"), "p")
    assert _recycled(unit) == before + 1
