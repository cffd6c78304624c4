"""A same-node read of a small field gets its bytes in the unit's answer.

Mapping a unit's chunk costs the reader an open and an mmap per chunk, and the
unit a read lease that the reader releases with one more message when its
tensors go. For a field of at most ``INLINE_READ_BYTES`` the unit copies the
rows into its answer instead: no mapping, no lease, and what the reader gets is
its own, writable memory, as a mapped read's copy-on-write rows are.
"""

import threading
import time
import warnings

import ray
import torch

from dataplane_client.client import _run_sync
from dataplane_client.wire.encoded import EncodedField
from dataplane_client.wire.errors import SamplesNotFound
from dataplane_client.wire.messages import SharedRows, read_request, unpack_read_answer
from dataplane_server.core.unit.store import INLINE_READ_BYTES


def _read_leases(handle) -> int:
    return ray.get(handle.units[0].holdings.remote()).read_leases


def _rows(n: int, row_bytes: int, start: int = 0) -> torch.Tensor:
    ints = row_bytes // 4
    return torch.arange(start, start + n, dtype=torch.int32)[:, None].repeat(1, ints)


def test_a_small_field_comes_back_as_bytes_and_a_large_one_as_leased_chunks(unit):
    client = unit.client()
    client.register_partition("sizes", fields=["small", "large"])
    ids = [f"s{i}" for i in range(8)]
    row_bytes = INLINE_READ_BYTES // 8  # eight rows make exactly the inline limit
    small, large = _rows(8, row_bytes), _rows(8, row_bytes + 4, start=100)
    client.put_samples(ids, "sizes", {"small": small, "large": large})

    answer = unpack_read_answer(
        ray.get(unit.units[0].read_shm.remote(read_request("sizes", ids, ["small", "large"])))
    )
    assert isinstance(answer["small"], EncodedField)  # at the limit: inline
    assert isinstance(answer["large"], SharedRows)  # 32 bytes over it: mapped and leased
    ray.get(unit.units[0].release_reads.remote([answer["large"].lease]))

    got = client.get_samples(ids, "sizes", ["small", "large"])
    assert torch.equal(got["small"], small)
    assert torch.equal(got["large"], large)
    del got
    answer = unpack_read_answer(
        ray.get(unit.units[0].read_shm.remote(read_request("sizes", ids[:4], ["small"])))
    )
    assert isinstance(answer["small"], EncodedField)
    assert _read_leases(unit) == 0  # nothing to release for the inline read


def test_a_small_read_takes_no_lease_and_returns_writable_rows(unit):
    client = unit.client()
    client.register_partition("small", fields=["x"])
    ids = [f"k{i}" for i in range(4)]
    client.put_samples(ids, "small", {"x": _rows(4, 64)})
    plan = {0: ids}
    (result,) = _run_sync(client._transport.read_flow("small", plan, ["x"]))
    assert result["x"].values.flags.writeable  # the reader's own copy, not Ray's buffer
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when it wraps read-only memory
        got = client.get_samples(ids, "small", ["x"])["x"]
    assert _read_leases(unit) == 0
    got += 1  # changing what we got changes nothing stored
    assert torch.equal(client.get_samples(ids, "small", ["x"])["x"], _rows(4, 64))


def test_small_reads_racing_rewrites_and_clears_never_mix_samples(unit):
    """A writer rewrites the same four ids (each version's bytes in fresh or recycled
    memory, the old version's freed) and now and then clears them, while a reader reads
    them: every read is four whole rows of one version, each its own sample's."""
    writer, reader = unit.client(), unit.client()
    writer.register_partition("race", fields=["x"])
    ids = [f"r{i}" for i in range(4)]

    def version_rows(version: int) -> torch.Tensor:
        # Row i holds 1000 * i + version in every element: its sample and its version.
        rows = torch.arange(4, dtype=torch.int32)[:, None] * 1000 + version % 1000
        return rows.repeat(1, 256)

    stop = threading.Event()
    written = [0]

    def churn() -> None:
        while not stop.is_set():
            written[0] += 1
            writer.put_samples(ids, "race", {"x": version_rows(written[0])}, overwrite=True)
            if written[0] % 5 == 0:
                writer.clear_samples(ids, "race")

    thread = threading.Thread(target=churn)
    thread.start()
    reads = vanished = 0
    deadline = time.monotonic() + 120  # a bound on a hang, not a speed target
    try:
        while reads < 300 and time.monotonic() < deadline:
            try:
                got = reader.get_samples(ids, "race", ["x"])["x"]
            except SamplesNotFound:
                vanished += 1  # cleared before the read: a typed error, never bytes
                continue
            sample = got // 1000
            assert torch.equal(sample, torch.arange(4, dtype=torch.int32)[:, None].expand_as(got))
            assert (got == got[:, :1]).all(), "a row mixes bytes of two writes"
            assert (got % 1000 == got[0, 0] % 1000).all(), "a read mixes two writes' rows"
            reads += 1
    finally:
        stop.set()
        thread.join(timeout=60)
    assert reads >= 300, f"only {reads} reads in the deadline ({vanished} found nothing)"
    assert written[0] > 1
    assert _read_leases(unit) == 0
