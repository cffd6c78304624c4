"""Kept read mappings: a same-node reader maps a unit's chunk once and copies out of it.

A get copies its rows out of this process's kept read-only mapping of each chunk
(``shm.read_maps``) into a buffer of its own, while it holds the unit's read lease.
So a steady-state get maps and faults nothing anew (a recycled chunk keeps its name
and its mapping), and the two hazards of sharing a mapping between gets cannot
happen: one caller's in-place write never shows in another get, and a chunk
recycled for a new write never shows through a tensor a reader still holds. A
chunk the unit closes is dropped from the kept mappings (its memory goes back).
"""

import pytest
import ray
import torch
from polling import wait_until

from dataplane_client.wire import shm
from dataplane_client.wire.messages import read_request, unpack_read_answer

ROWS = 8
ROW_FLOATS = 128 * 1024  # 512 KiB a row, 4 MiB a write: a chunk of its own, not a slab

pytestmark = pytest.mark.skipif(not shm.supported(), reason="no memfd shared memory here")


def _rows(value: float) -> torch.Tensor:
    return torch.full((ROWS, ROW_FLOATS), value)


def _ids(tag: str) -> list[str]:
    return [f"{tag}{i}" for i in range(ROWS)]


def _holdings(handle):
    return ray.get(handle.units[0].holdings.remote())


def _mappings(name_prefix: str, perms: str = "rw-p") -> set[int]:
    """Start addresses of this process's mappings (``perms``: a get's copy-on-write views
    by default; "" any) of chunks whose memfd names start with ``name_prefix`` (a
    chunk's own: ``"<name> (deleted)"``)."""
    found = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, mode, *rest = line.split(maxsplit=5)
            path = rest[3] if len(rest) == 4 else ""
            if mode.startswith(perms) and path.startswith(f"/memfd:{name_prefix}"):
                found.add(int(span.split("-")[0], 16))
    return found


@pytest.fixture
def client(unit):
    client = unit.client()
    assert client._transport.shared == [True]  # same node: the shared-memory path
    return client


def _no_read_leases(unit) -> None:
    """The gets' leases are back (each goes once its copy is done): freed chunks recycle."""
    wait_until(lambda: not _holdings(unit).read_leases, 30, "the read leases to be released")


def test_a_steady_state_get_reuses_the_kept_mapping_of_a_recycled_chunk(unit, client):
    client.register_partition("steady", fields=["x"])
    prefix = _holdings(unit).chunk_prefix
    recycled_before = ray.get(unit.units[0].recycled_chunks.remote())
    seen = []
    for i in range(6):
        client.put_samples(_ids("s"), "steady", {"x": _rows(i)})
        got = client.get_samples(_ids("s"), "steady", ["x"])["x"]
        assert torch.equal(got, _rows(i))  # a recycled chunk's new bytes, through the old mapping
        del got
        seen.append(_mappings(prefix))
        _no_read_leases(unit)
        client.clear_samples(_ids("s"), "steady")
    assert ray.get(unit.units[0].recycled_chunks.remote()) >= recycled_before + 4
    # The writer alternates between a chunk or two (its next put's is leased ahead); after
    # two rounds every get finds its chunk mapped: nothing mapped anew, the same addresses.
    assert seen[2], "a get left no kept copy-on-write mapping of the unit's chunk"
    assert seen[2:] == [seen[2]] * 4


def test_an_in_place_write_to_one_get_shows_in_no_other_get(client):
    client.register_partition("inplace", fields=["x"])
    client.put_samples(_ids("w"), "inplace", {"x": _rows(3.0)})
    first = client.get_samples(_ids("w"), "inplace", ["x"])["x"]  # the kept mapping, lent
    second = client.get_samples(_ids("w"), "inplace", ["x"])["x"]  # lent already: a fresh one
    first.mul_(-1)  # the caller owns its tensor
    second[0, 0] = 42.0
    assert torch.equal(second[1:], _rows(3.0)[1:]), "one get's in-place write showed in another"
    assert torch.equal(client.get_samples(_ids("w"), "inplace", ["x"])["x"], _rows(3.0))
    assert torch.equal(first, -_rows(3.0))  # a later get took nothing from a live tensor
    assert float(second[0, 0]) == 42.0
    del first, second  # the kept mapping is free again, with pages its caller wrote
    again = client.get_samples(_ids("w"), "inplace", ["x"])["x"]
    assert torch.equal(again, _rows(3.0)), "an earlier caller's in-place write showed in a get"
    rows = client.get_samples(_ids("w")[2:5], "inplace", ["x"])["x"]  # a slice: a gather
    assert torch.equal(rows, _rows(3.0)[2:5])


def test_a_chunk_recycled_for_new_writes_never_shows_through_a_held_tensor(unit, client):
    client.register_partition("held", fields=["x"])
    client.put_samples(_ids("h"), "held", {"x": _rows(1.0)})
    held = client.get_samples(_ids("h"), "held", ["x"])["x"]  # views the kept mapping
    client.clear_samples(_ids("h"), "held")
    for i in range(4):  # writes of the same size: each would take a recycled chunk
        client.put_samples(_ids(f"n{i}-"), "held", {"x": _rows(100.0 + i)})
        assert torch.equal(client.get_samples(_ids(f"n{i}-"), "held", ["x"])["x"], _rows(100 + i))
        client.clear_samples(_ids(f"n{i}-"), "held")
    assert torch.equal(held, _rows(1.0)), "a recycled chunk's new bytes reached a held tensor"
    assert _holdings(unit).read_leases  # the held tensor's lease kept its chunk from reuse
    del held
    _no_read_leases(unit)


def test_a_reader_drops_its_kept_mapping_of_a_chunk_the_unit_closed(unit, client):
    client.register_partition("closing", fields=["x"])
    client.put_samples(_ids("c"), "closing", {"x": _rows(7.0)})
    client.put_samples(_ids("d"), "closing", {"x": _rows(8.0)})  # another chunk
    assert torch.equal(client.get_samples(_ids("c"), "closing", ["x"])["x"], _rows(7.0))
    assert torch.equal(client.get_samples(_ids("c")[::2], "closing", ["x"])["x"], _rows(7.0)[::2])
    # A lease nobody releases (as a reader still copying would hold): freeing the chunk
    # now closes it instead of recycling it.
    located = unpack_read_answer(
        ray.get(unit.units[0].read_shm.remote(read_request("closing", _ids("c"), ["x"])))
    )["x"]
    (chunk,) = located.chunks
    this_chunk = f"{chunk.name} (deleted)"
    assert _mappings(this_chunk), "the get kept no copy-on-write mapping of its chunk"
    assert _mappings(this_chunk, "r--s"), "the gather kept no read-only mapping of its chunk"
    client.clear_samples(_ids("c"), "closing")
    # The next get's answer (no put in between: a put's answer says it too) names the
    # closed chunk: every kept mapping of it goes, and with them the memory they held.
    assert torch.equal(client.get_samples(_ids("d"), "closing", ["x"])["x"], _rows(8.0))
    assert not _mappings(this_chunk, ""), "a closed chunk is still mapped"
    ray.get(unit.units[0].release_reads.remote([located.lease]))
