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

import pytest
import ray
import torch
from polling import wait_until
from unit_memory import unit_bytes

from dataplane_client import DataPlaneConfig, connect
from dataplane_client.wire import shm
from dataplane_server import start
from dataplane_server.core.unit.store import UnitHoldings

# Ray workers cannot import this test module by name: ship its classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

ROWS = 8
ROW_FLOATS = 128 * 1024  # 512 KiB a row, 4 MiB a write: a chunk of its own, not a slab


def _rows(value: float) -> torch.Tensor:
    return torch.full((ROWS, ROW_FLOATS), value)


def _ids(tag: str) -> list[str]:
    return [f"{tag}{i}" for i in range(ROWS)]


def _holdings(handle) -> UnitHoldings:
    return ray.get(handle.units[0].holdings.remote())


def _recycled(handle) -> int:
    return ray.get(handle.units[0].recycled_chunks.remote())


@pytest.fixture
def unit(ray_session):
    handle = start(DataPlaneConfig(name="dp-recycle", num_storage_units=1, admin_enabled=False))
    yield handle
    handle.shutdown()


def test_a_freed_chunk_nobody_reads_is_reused_and_the_writer_keeps_its_mapping(unit):
    client = unit.client()
    assert client._transport.shared == [True]
    client.register_partition("p", fields=["x"])
    for i in range(8):
        client.put_samples(_ids("a"), "p", {"x": _rows(i)})
        assert torch.equal(client.get_samples(_ids("a"), "p", ["x"])["x"], _rows(i))
        client.clear_samples(_ids("a"), "p")  # the tensors above are gone: leases released
    assert _recycled(unit) >= 6
    # Eight writes went through a few mappings this process kept, not one mapping per put
    # (counted for this unit's chunks only: other tests of this process map theirs).
    prefix = _holdings(unit).chunk_prefix
    assert 0 < shm.write_maps.mapped_bytes(prefix) <= 4 * ROWS * ROW_FLOATS * 4


def test_a_reader_holding_tensors_sees_its_own_bytes_while_the_memory_is_cleared_and_reused(
    unit,
):
    client = unit.client()
    client.register_partition("p", fields=["x"])
    client.put_samples(_ids("held"), "p", {"x": _rows(1.0)})
    held = client.get_samples(_ids("held"), "p", ["x"])["x"]  # zero-copy: maps the chunk
    assert _holdings(unit).read_leases  # the read holds a lease while its tensors live
    client.clear_samples(_ids("held"), "p")
    for i in range(6):  # writes of the same size: each would take a recycled chunk
        client.put_samples(_ids(f"new{i}-"), "p", {"x": _rows(100.0 + i)})
        client.clear_samples(_ids(f"new{i}-"), "p")
    assert torch.equal(held, _rows(1.0)), "a recycled chunk overwrote bytes a reader holds"
    del held
    wait_until(lambda: not _holdings(unit).read_leases, 30, "the lease to be released")


@ray.remote
class Reader:
    """A reader holding the tensors of its last read."""

    def __init__(self, name: str, namespace: str):
        self.client = connect(name, namespace)
        self.held = None

    def hold(self, partition_id: str, ids: list[str]) -> float:
        self.held = self.client.get_samples(ids, partition_id, ["x"])["x"]
        return float(self.held[0, 0])


def test_the_leases_of_a_dead_reader_are_released_and_its_chunk_recycled(unit):
    client = unit.client()
    client.register_partition("p", fields=["x"])
    client.put_samples(_ids("r"), "p", {"x": _rows(5.0)})
    reader = Reader.remote(unit.config.name, unit.config.namespace)
    assert ray.get(reader.hold.remote("p", _ids("r"))) == 5.0
    # Its second read names its process token by key (the first sent the token itself):
    # the lease that read takes ends with the process all the same.
    assert ray.get(reader.hold.remote("p", _ids("r"))) == 5.0
    assert _holdings(unit).read_leases
    ray.kill(reader)  # its mappings die with it; it never says so
    wait_until(lambda: not _holdings(unit).read_leases, 60, "the dead reader's lease to go")
    before = _recycled(unit)
    client.clear_samples(_ids("r"), "p")
    assert _recycled(unit) == before + 1


# ---- regions leased ahead to a writer for its next put --------------------------------


@ray.remote
class Writer:
    """A writer whose puts go through the region leased to it ahead."""

    def __init__(self, name: str, namespace: str):
        self.client = connect(name, namespace)

    def put(self, partition_id: str, ids: list[str], value: float) -> bool:
        self.client.put_samples(ids, partition_id, {"x": _rows(value)})
        return self.client._transport._leases[0] is not None  # holds one for its next put


def test_puts_through_leased_regions_store_every_write_and_hold_one_lease(unit):
    client = unit.client()
    client.register_partition("p", fields=["x"])
    for i in range(5):
        if i == 4:  # a lease is lent from ready memory, which the reserve refills behind
            # the puts: on a loaded box the last put could find none (seen in CI)
            wait_until(lambda: _holdings(unit).reserve_settled, 60, "the reserve refilled")
        client.put_samples(_ids(f"w{i}-"), "p", {"x": _rows(10.0 + i)})
        assert _holdings(unit).write_leases <= 1  # the next one, never a pile
    assert client._transport._leases[0] is not None
    for i in range(5):
        assert torch.equal(client.get_samples(_ids(f"w{i}-"), "p", ["x"])["x"], _rows(10.0 + i))


def test_the_region_leased_to_a_dead_writer_is_reclaimed(unit):
    client = unit.client()
    client.register_partition("p", fields=["x"])
    # A region is leased only from memory the unit has ready: one write of this size
    # first, then wait until the reserve has made room for two more (it does so after a
    # miss, in the background), so the writer's first put leaves it holding a lease.
    write = ROWS * ROW_FLOATS * 4
    client.put_samples(_ids("w"), "p", {"x": _rows(1.0)})
    client.clear_samples(_ids("w"), "p")
    wait_until(
        lambda: _holdings(unit).reserve_bytes >= 2 * write,
        60,
        "the unit's reserve to make the chunks it asked for",
    )
    baseline = unit_bytes(unit)
    writer = Writer.remote(unit.config.name, unit.config.namespace)
    assert ray.get(writer.put.remote("p", _ids("d"), 3.0))
    assert ray.get(writer.put.remote("p", _ids("e"), 4.0))  # the second through the lease
    assert _holdings(unit).write_leases
    ray.kill(writer)
    wait_until(lambda: not _holdings(unit).write_leases, 60, "the dead writer's lease to go")
    assert torch.equal(client.get_samples(_ids("e"), "p", ["x"])["x"], _rows(4.0))
    client.clear_samples([*_ids("d"), *_ids("e")], "p")
    assert unit_bytes(unit) == baseline  # nothing of the writer's is held any more


def test_a_lease_gives_way_to_a_write_that_needs_the_room(ray_session):
    write = ROWS * ROW_FLOATS * 4
    handle = start(
        DataPlaneConfig(
            name="dp-lease-room",
            num_storage_units=1,
            unit_capacity_bytes=2 * write,
            admin_enabled=False,
        )
    )
    try:
        client = handle.client()
        client.register_partition("p", fields=["x"])
        writer = Writer.remote(handle.config.name, handle.config.namespace)
        ray.get(writer.put.remote("p", _ids("a"), 1.0))
        # Prime the reserve with a chunk of the write's size so the next answer grants a lease.
        client.put_samples(_ids("tmp"), "p", {"x": _rows(9.0)})
        client.clear_samples(_ids("tmp"), "p")
        assert ray.get(writer.put.remote("p", _ids("b"), 2.0)) or True
        client.clear_samples(_ids("b"), "p")
        # Whatever the writer holds ahead, a write that fits the data gets the room.
        client.put_samples(_ids("c"), "p", {"x": _rows(3.0)})
        assert torch.equal(client.get_samples(_ids("c"), "p", ["x"])["x"], _rows(3.0))
        assert torch.equal(client.get_samples(_ids("a"), "p", ["x"])["x"], _rows(1.0))
        ray.kill(writer)
    finally:
        handle.shutdown()
