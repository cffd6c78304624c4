"""A unit's open descriptors grow with the bytes it holds, never with the number of puts.

Small writes share slabs (one memfd each, no mapping in the unit), so 5,000
one-sample puts (8 MiB: two slabs filled) cost a handful of descriptors; running out
of descriptors is CapacityExceeded, never a raw OSError.
"""

import asyncio
import os

import psutil
import pytest
import ray
import torch
from unit_memory import memfd_bytes, memfds, open_fds, unit_pid

from dataplane_client import DataPlaneConfig
from dataplane_client.wire.errors import CapacityExceeded
from dataplane_server import start
from dataplane_server.core.unit.arena import SLAB_BYTES

# 5,000 puts of 64 tokens hold the bytes 20,000 of 16 did (two slabs, 3 memfds with the
# warm reserve) in a third of the time: the bound is on descriptors per byte, and 5,000
# puts are still 5,000 chances to leak one.
PUTS = 5_000
IN_FLIGHT = 200
TOKENS = 64


def one_sample(i: int) -> dict:
    """Five GRPO-like fields of one sample whose values encode ``i``."""
    tokens = torch.arange(TOKENS, dtype=torch.int64) + i
    return {
        "input_ids": tokens[None],
        "input_lengths": torch.tensor([TOKENS]),
        "token_mask": (tokens % 3 == 0)[None],
        "sample_mask": torch.tensor([float(i)]),
        "generation_logprobs": -tokens.float()[None],
    }


def _snapshot(handle):
    return ray.get(handle.units[0].metrics_snapshot.remote())


@pytest.mark.slow
def test_five_thousand_one_sample_puts_hold_a_bounded_number_of_descriptors(ray_session):
    handle = start(DataPlaneConfig(name="dp-fds", num_storage_units=1, admin_enabled=False))
    try:
        client = handle.client()
        client.register_partition("p", fields=[])
        pid = unit_pid(handle)
        fds_before = len(open_fds(pid))

        async def put_all():
            for first in range(0, PUTS, IN_FLIGHT):
                await asyncio.gather(
                    *[
                        client.put_samples_async([f"s{i}"], "p", one_sample(i))
                        for i in range(first, min(first + IN_FLIGHT, PUTS))
                    ]
                )

        asyncio.run(put_all())
        snap = _snapshot(handle)
        fds_after, blocks = len(open_fds(pid)), memfds(pid)
        print(
            f"unit fds: {fds_before} before, {fds_after} after {PUTS} one-sample five-field puts "
            f"({blocks} memfds: {snap.bytes / 2**20:.0f} MiB of slabs, "
            f"{snap.warm_reserve_bytes / 2**20:.0f} MiB warm reserve)"
        )
        assert snap.samples == PUTS
        # Every block is a slab: descriptors are bounded by the bytes held, not by puts.
        assert blocks * SLAB_BYTES <= snap.bytes + snap.warm_reserve_bytes
        assert fds_after - fds_before <= blocks + 16  # a little room for Ray's own sockets
        for i in (0, 1, PUTS // 2, PUTS - 1):
            got = client.get_samples([f"s{i}"], "p", list(one_sample(i)))
            assert all(torch.equal(got[k], v) for k, v in one_sample(i).items())

        client.clear_samples(None, "p")
        snap = _snapshot(handle)
        print(f"after clear: {len(open_fds(pid))} fds, {memfds(pid)} memfds, {snap.bytes} bytes")
        assert snap.bytes == 0
        assert memfd_bytes(pid) == snap.warm_reserve_bytes  # only the warm reserve is left
        assert len(open_fds(pid)) <= fds_before + memfds(pid) + 16
    finally:
        handle.shutdown()


def test_running_out_of_descriptors_is_capacity_exceeded(ray_session):
    handle = start(
        DataPlaneConfig(
            name="dp-emfile", num_storage_units=1, admin_enabled=False, unit_warm_reserve_bytes=0
        )
    )
    try:
        client = handle.client()
        client.register_partition("p", fields=["x"])
        unit = psutil.Process(unit_pid(handle))
        soft, hard = unit.rlimit(psutil.RLIMIT_NOFILE)
        big = torch.ones(1, 2 * SLAB_BYTES, dtype=torch.uint8)  # too big for a slab: a block each
        unit.rlimit(psutil.RLIMIT_NOFILE, (len(open_fds(unit.pid)) + 4, hard))
        try:

            def fill() -> None:
                for i in range(64):
                    client.put_samples([f"b{i}"], "p", {"x": big})

            with pytest.raises(CapacityExceeded, match="Too many open files") as e:
                fill()
            assert e.value.ids
            assert e.value.ids[0].startswith("b")
        finally:
            unit.rlimit(psutil.RLIMIT_NOFILE, (soft, hard))
        client.clear_samples(None, "p")
        client.register_partition("p", fields=["x"])
        client.put_samples(["after"], "p", {"x": big})  # the unit keeps serving
        assert torch.equal(client.get_samples(["after"], "p", ["x"])["x"], big)
    finally:
        handle.shutdown()


def test_a_reader_holding_many_zero_copy_tensors_holds_no_descriptors(client):
    client.register_partition("held", fields=["x"])
    ids = ["h0"]  # one row lives on one unit: a same-node get maps it, zero-copy
    rows = torch.arange(1024, dtype=torch.float32).reshape(1, 1024)
    client.put_samples(ids, "held", {"x": rows})
    fds_before = len(open_fds(os.getpid()))
    held = [client.get_samples(ids, "held", ["x"])["x"] for _ in range(500)]
    grown = len(open_fds(os.getpid())) - fds_before
    print(f"reader fds grew by {grown} while holding {len(held)} mapped tensors")
    assert grown < 20  # Python's mmap would keep one duplicate descriptor per tensor
    assert all(torch.equal(t, rows) for t in held)
    client.clear_samples(None, "held")
