"""A storage unit's logic without Ray (``UnitStore``), in one process, no cluster.

What the actor tests used to reach into a running unit for is asserted here
directly on the store: staging and publish, capacity waits, read leases and
recycling, write leases (granted from the warm reserve, replaced, staged into,
reclaimed at their deadline, for room, or when their writer dies), the sweeper's
rules for dead writers' stages, the warm reserve settling, checkpoints, previews.
Owners are plain strings here: the actor shell passes Ray object refs, and only it
can tell that a process died (``owners_died`` is what it calls then).
"""

import asyncio
import dataclasses
import errno
import os
import pickle
import shutil
import time

import numpy as np
import pytest
import torch
from polling import wait_until

from dataplane_client.codec.fields import DTYPES, decode_field, encode_field
from dataplane_client.wire import shm
from dataplane_client.wire.encoded import EncodedField
from dataplane_client.wire.errors import (
    CapacityExceeded,
    CheckpointError,
    CorruptPayload,
    FieldNotProduced,
    InvalidBatch,
    Overloaded,
    SamplesNotFound,
    SchemaConflict,
    StageReclaimed,
)
from dataplane_client.wire.messages import SharedRows
from dataplane_client.wire.put_deadline import STAGE_GRACE_S
from dataplane_server.core.recovery_messages import SampleMeta
from dataplane_server.core.unit import checkpoint as unit_checkpoint
from dataplane_server.core.unit.preview import first_elements
from dataplane_server.core.unit.store import INLINE_READ_BYTES, UnitStore

MiB = 1 << 20
needs_shm = pytest.mark.skipif(not shm.supported(), reason="no memfd shared memory here")


@pytest.fixture
def stores():
    """``make(**options)``: a fresh store; every one made is closed after the test."""
    made = []

    def make(**options) -> UnitStore:
        settings = {
            "index": 0,
            "capacity_bytes": 256 * MiB,
            "use_shm": False,
            "put_wait_timeout_s": 0.0,
            "warm_reserve_bytes": 0,
            "stage_ttl_s": 30.0,
            **options,
        }
        made.append(UnitStore(**settings))
        return made[-1]

    yield make
    for store in made:
        store.close()


def _rows(n: int, row_bytes: int, start: int = 0) -> torch.Tensor:
    """``n`` int32 rows of ``row_bytes``, row i full of ``start + i``."""
    return torch.arange(start, start + n, dtype=torch.int32)[:, None].repeat(1, row_bytes // 4)


def _ids(tag: str, n: int) -> list[str]:
    return [f"{tag}{i}" for i in range(n)]


def _stage(store, pid, wid, ids, fields, owner=None) -> int:
    encoded = {name: encode_field(name, value) for name, value in fields.items()}
    return asyncio.run(store.stage(pid, wid, ids, encoded, owner))


def _put(store, pid, wid, ids, fields, meta=None) -> None:
    _stage(store, pid, wid, ids, fields)
    assert store.publish(wid, meta)


def _read(store, pid, ids, name):
    return decode_field(store.read(pid, ids, [name])[name])


def _mapped(rows: SharedRows) -> torch.Tensor:
    """What a same-node reader maps for these rows (as the client does), decoded."""
    parts = [
        shm.map_for_read(rows.chunks[c], int(s), int(e))
        for c, s, e in zip(rows.which, rows.starts, rows.ends)
    ]
    values = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
    return decode_field(dataclasses.replace(rows.header, values=values))


def _counter(store, name: str) -> float:
    return store.stats.snapshot()["counters"].get(name, 0)


# ---- staging and publish --------------------------------------------------------------


def test_a_staged_write_is_invisible_until_published_and_a_retried_publish_is_a_no_op(stores):
    store = stores()
    ids = _ids("s", 4)
    assert _stage(store, "p", "w1", ids, {"x": _rows(4, 64)}) == 4 * 64
    assert store.staged_write_ids() == ["w1"]
    with pytest.raises(SamplesNotFound) as e:
        store.read("p", ids, ["x"])
    assert e.value.ids == ids
    assert store.publish("w1", SampleMeta(seq=3))
    assert torch.equal(_read(store, "p", ids, "x"), _rows(4, 64))
    assert store.publish("w1") is False  # a retried commit
    assert store.staged_write_ids() == []
    assert store.recovery_view().partitions["p"].seq == [3, 3, 3, 3]
    with pytest.raises(SamplesNotFound, match="never staged"):
        store.publish("w-unknown")


def test_a_discarded_stage_frees_its_memory_and_cannot_be_published(stores):
    store = stores()
    _stage(store, "p", "w", _ids("s", 2), {"x": _rows(2, 2 * MiB)})
    assert store.used_bytes >= 4 * MiB
    store.discard("w")
    assert store.used_bytes == 0
    with pytest.raises(SamplesNotFound, match="w"):
        store.publish("w")


def test_reads_name_the_missing_samples_and_fields_and_a_schema_change_is_refused(stores):
    store = stores()
    _put(store, "p", "w1", ["a", "b"], {"x": _rows(2, 8)})
    _put(store, "p", "w2", ["c"], {"y": _rows(1, 8)})
    with pytest.raises(SamplesNotFound) as missing:
        store.read("p", ["a", "zz"], ["x"])
    assert missing.value.ids == ["zz"]
    with pytest.raises(FieldNotProduced) as absent:
        store.read("p", ["a", "c"], ["x"])
    assert (absent.value.ids, absent.value.fields) == (["c"], ["x"])
    with pytest.raises(SchemaConflict) as conflict:
        _stage(store, "p", "w3", ["d"], {"x": torch.zeros(1, 3, dtype=torch.float64)})
    assert conflict.value.fields == ["x"]
    assert store.stats.snapshot()["errors"]["SchemaConflict"] == 1


def test_clearing_returns_the_bytes_and_the_slots_are_reused(stores):
    store = stores()
    _put(store, "p", "w1", _ids("a", 4), {"x": _rows(4, 1024)})
    assert store.partition_bytes() == {"p": 4096}
    assert store.clear("p", ["a1", "a2"]) == 2048
    assert store.partition_bytes() == {"p": 2048}
    _put(store, "p", "w2", ["b0", "b1"], {"x": _rows(2, 1024, start=7)})
    assert store.partitions["p"].next_slot == 4  # the freed slots, not fresh ones
    assert torch.equal(_read(store, "p", ["a0", "b1"], "x")[:, 0], torch.tensor([0, 8]))
    assert store.clear("p", None) > 0
    assert store.partitions == {}
    assert store.used_bytes == 0
    assert store.clear("p", None) == 0  # clearing what is gone is a no-op


# ---- capacity ---------------------------------------------------------------------------


def test_a_write_that_does_not_fit_is_refused_at_once_without_a_wait(stores):
    store = stores(capacity_bytes=4 * MiB)
    _put(store, "p", "w1", _ids("a", 2), {"x": _rows(2, MiB + MiB // 2)})
    with pytest.raises(CapacityExceeded) as e:
        _stage(store, "p", "w2", _ids("b", 2), {"x": _rows(2, MiB + MiB // 2)})
    assert e.value.ids == _ids("b", 2)


def test_a_waiting_write_proceeds_when_a_clear_frees_room_and_gives_up_at_its_timeout(stores):
    store = stores(capacity_bytes=4 * MiB, put_wait_timeout_s=30)
    _put(store, "p", "w1", _ids("a", 2), {"x": _rows(2, MiB + MiB // 2)})
    encoded = {"x": encode_field("x", _rows(2, MiB + MiB // 2, start=5))}

    async def wait_then_clear() -> int:
        waiting = asyncio.create_task(store.stage("p", "w2", _ids("b", 2), encoded))
        while not _counter(store, "put_waits_total"):  # the write is waiting for room
            assert not waiting.done(), waiting.exception()
            await asyncio.sleep(0)
        store.clear("p", _ids("a", 2))
        return await asyncio.wait_for(waiting, 30)

    assert asyncio.run(wait_then_clear()) == encoded["x"].nbytes
    assert store.publish("w2")
    assert torch.equal(_read(store, "p", _ids("b", 2), "x"), _rows(2, MiB + MiB // 2, start=5))

    store.put_wait_timeout_s = 0.05  # nothing frees room now: the wait ends in an error
    with pytest.raises(CapacityExceeded, match="after waiting") as e:
        _stage(store, "p", "w3", _ids("c", 2), {"x": _rows(2, MiB + MiB // 2)})
    assert e.value.ids == _ids("c", 2)
    assert store._room_waiters == []  # a timed-out wait leaves nothing behind


# ---- read leases --------------------------------------------------------------------------


@needs_shm
def test_a_read_lease_keeps_a_freed_chunk_from_reuse_until_released(stores):
    store = stores(use_shm=True, warm_reserve_bytes=64 * MiB)
    big = _rows(4, MiB)  # 4 MiB: mapped and leased; a chunk of its own
    _put(store, "p", "w1", _ids("a", 4), {"x": big})
    answer = store.read_shm("p", _ids("a", 4), ["x"], owner="reader")
    rows = answer["x"]
    assert isinstance(rows, SharedRows)
    assert store.holdings().read_leases == 1
    assert torch.equal(_mapped(rows), big)
    store.clear("p", _ids("a", 4))
    assert store.recycled_chunks() == 0  # leased while freed: closed, not recycled
    store.release_reads([rows.lease])
    assert store.holdings().read_leases == 0

    _put(store, "p", "w2", _ids("b", 4), {"x": big})
    store.release_reads([store.read_shm("p", _ids("b", 4), ["x"])["x"].lease])
    store.clear("p", _ids("b", 4))
    assert store.recycled_chunks() == 1  # released before freeing: kept warm for a write


@needs_shm
def test_a_small_field_comes_back_inline_with_no_lease(stores):
    store = stores(use_shm=True)
    small = _rows(8, INLINE_READ_BYTES // 8)  # exactly the limit
    _put(
        store,
        "p",
        "w",
        _ids("s", 8),
        {"small": small, "large": _rows(8, 4 + INLINE_READ_BYTES // 8)},
    )
    answer = store.read_shm("p", _ids("s", 8), ["small"])
    assert isinstance(answer["small"], EncodedField)
    assert torch.equal(decode_field(answer["small"]), small)
    assert store.holdings().read_leases == 0
    assert isinstance(store.read_shm("p", _ids("s", 8), ["large"])["large"], SharedRows)


@needs_shm
def test_a_read_answer_sends_row_offsets_in_the_narrowest_dtype(stores):
    """Ray ships an answer of up to 100 KiB inline, a larger one through its object store
    (about 2 ms more): 1,024 rows of 4 fields at int64 offsets were just over."""
    store = stores(use_shm=True)
    fields = {f"f{i}": _rows(1024, 256, start=i) for i in range(4)}
    _put(store, "p", "w", _ids("a", 1024), fields)
    answer = store.read_shm("p", _ids("a", 1024), list(fields), owner="reader")
    for name, rows in answer.items():
        assert rows.which.dtype == np.uint8
        assert rows.starts.dtype.itemsize <= 4
        assert rows.ends.dtype.itemsize <= 4
        assert torch.equal(_mapped(rows), fields[name])
    assert len(pickle.dumps(answer)) < 48 * 1024
    store.release_reads([answer["f0"].lease])


@needs_shm
def test_a_dead_readers_leases_are_released(stores):
    store = stores(use_shm=True)
    _put(store, "p", "w", _ids("a", 2), {"x": _rows(2, MiB)})
    store.read_shm("p", _ids("a", 2), ["x"], owner="reader-1")
    store.read_shm("p", _ids("a", 2), ["x"], owner="reader-2")
    assert store.watched_owners() == {"reader-1", "reader-2"}
    store.owners_died({"reader-1"})
    assert store.holdings().read_leases == 1
    assert store.watched_owners() == {"reader-2"}


def test_a_cross_node_read_of_rows_back_to_back_is_a_view_leased_until_it_is_gone(stores):
    store = stores()
    _put(store, "p", "w", _ids("a", 4), {"x": _rows(4, 2 * MiB)})
    (block,) = store.arena.blocks
    got = store.read("p", _ids("a", 4), ["x"])["x"]
    assert store.arena.blocks[block].readers == 1  # Ray copies the view after read returns
    assert torch.equal(decode_field(got), _rows(4, 2 * MiB))
    del got
    assert store.arena.blocks[block].readers == 0


# ---- write leases and the warm reserve ----------------------------------------------------


def _alloc(store, pid, wid, ids, value, owner, lease=None):
    """A same-node put as the client makes it: stage headers, copy into the region."""
    enc = encode_field("x", value)
    header = dataclasses.replace(enc, values=None)
    if lease is None:
        answer = asyncio.run(store.alloc_shm(pid, wid, ids, {"x": header}, owner))
    else:
        answer = asyncio.run(store.stage_leased(pid, wid, ids, {"x": header}, owner, lease))
    if answer is not None:
        region = answer.regions["x"]
        shm.map_for_write(region.chunk, region.offset, region.nbytes)[:] = enc.values
    return answer


def _warmed(stores, write: int, **options) -> UnitStore:
    """A store whose reserve holds two ready chunks of ``write`` bytes (a miss asks for them)."""
    store = stores(use_shm=True, warm_reserve_bytes=64 * MiB, **options)
    _put(store, "warm-up", "w0", _ids("warm", 4), {"x": _rows(4, write // 4)})
    store.clear("warm-up", None)  # its chunk is recycled into the reserve too
    _ready(store, 2 * write)
    return store


def _ready(store, nbytes: int) -> None:
    wait_until(
        lambda: store.holdings().reserve_settled and store.holdings().reserve_bytes >= nbytes,
        30,
        f"the reserve to hold {nbytes} bytes",
    )


@needs_shm
def test_a_write_lease_carries_the_writers_next_put_and_is_one_per_writer(stores):
    write = 4 * MiB  # a chunk of its own: only such writes get leases
    store = _warmed(stores, write)
    first = _alloc(store, "p", "w1", _ids("a", 4), _rows(4, MiB), owner="writer")
    assert first.next_lease is not None  # from a ready chunk: nothing made on the put's path
    assert store.holdings().write_leases == 1
    assert store.publish("w1")

    lease = first.next_lease
    _ready(store, write)
    second = _alloc(store, "p", "w2", _ids("b", 4), _rows(4, MiB, 10), "writer", lease.lease)
    assert second.regions["x"].chunk == lease.region.chunk  # staged into the leased region
    assert second.next_lease is not None  # and the lease for the put after it
    assert store.holdings().write_leases == 1
    assert store.publish("w2")

    reclaimed = _counter(store, "write_leases_reclaimed_total")
    _alloc(store, "p", "w3", _ids("c", 4), _rows(4, MiB, 20), owner="writer")  # not leased
    assert _counter(store, "write_leases_reclaimed_total") == reclaimed + 1  # the old one went
    assert store.holdings().write_leases <= 1  # never a pile
    assert store.publish("w3")
    gone = second.next_lease.lease
    assert _alloc(store, "p", "w4", _ids("d", 4), _rows(4, MiB), "writer", gone) is None
    for tag, start in [("a", 0), ("b", 10), ("c", 20)]:
        assert torch.equal(_read(store, "p", _ids(tag, 4), "x"), _rows(4, MiB, start))


def _leased(store, owner: str) -> None:
    answer = _alloc(store, "p", f"w-{owner}", _ids(owner, 4), _rows(4, MiB), owner)
    store.publish(f"w-{owner}")
    store.clear("p", _ids(owner, 4))
    assert answer.next_lease is not None
    assert store.holdings().write_leases == 1


@needs_shm
def test_a_dead_writers_write_lease_is_reclaimed(stores):
    store = _warmed(stores, 4 * MiB)
    _leased(store, "dies")
    assert store.watched_owners() == {"dies"}
    store.owners_died({"dies"})
    assert store.holdings().write_leases == 0
    assert store.used_bytes == 0
    assert store.recycled_chunks() >= 2  # not tainted: nobody copies into it any more


@needs_shm
def test_a_write_lease_gives_way_to_a_write_that_needs_the_room(stores):
    store = _warmed(stores, 4 * MiB, capacity_bytes=12 * MiB)
    _leased(store, "writer")
    _put(store, "q", "big", _ids("big", 2), {"x": _rows(2, 5 * MiB)})  # 10 MiB + the lease's 4
    assert store.holdings().write_leases == 0
    assert torch.equal(_read(store, "q", _ids("big", 2), "x"), _rows(2, 5 * MiB))


@needs_shm
def test_a_write_lease_past_its_deadline_is_reclaimed(stores):
    store = _warmed(stores, 4 * MiB, stage_ttl_s=0.0)  # every deadline passes at once
    _leased(store, "writer")
    store.reclaim_expired()
    assert store.holdings().write_leases == 0
    assert store.used_bytes == 0


@needs_shm
def test_the_warm_reserve_settles_within_its_limit_and_counts_as_kept_ready(stores):
    limit = 16 * MiB
    store = stores(use_shm=True, warm_reserve_bytes=limit)
    _put(store, "p", "w", _ids("a", 4), {"x": _rows(4, MiB)})  # a miss: two chunks asked for
    store.clear("p", None)
    wait_until(lambda: store.holdings().reserve_settled, 30, "the reserve to settle")
    held = store.holdings()
    assert 2 * 4 * MiB <= held.reserve_bytes <= limit
    snap = store.metrics_snapshot("node", "127.0.0.1")
    assert snap.warm_reserve_bytes == held.reserve_bytes + held.write_lease_chunk_bytes
    assert snap.bytes == 0
    assert snap.samples == 0


# ---- what the sweeper reclaims ------------------------------------------------------------


def test_a_dead_writers_unpinned_stage_is_reclaimed_and_a_pinned_one_kept(stores):
    store = stores()
    _stage(store, "p", "lost", ["a"], {"x": _rows(1, 8)}, owner="writer")
    _stage(store, "p", "pinned", ["b"], {"x": _rows(1, 8)}, owner="writer")
    store.prepare("pinned", SampleMeta(seq=1), staged_units=[0, 1])
    assert store.recovery_view().pinned["pinned"].staged_units == [0, 1]
    assert store.watched_owners() == {"writer"}  # for the unpinned stage
    store.owners_died({"writer"})
    assert store.staged_write_ids() == ["pinned"]
    with pytest.raises(StageReclaimed, match="writer's process died"):
        store.publish("lost")
    assert store.publish("pinned")
    assert _counter(store, "stages_reclaimed_total") == 1


def test_a_stage_past_its_deadline_is_reclaimed_and_a_late_publish_says_why(stores):
    store = stores(stage_ttl_s=0.0)
    _stage(store, "p", "w", ["a"], {"x": _rows(1, 8)})
    store.reclaim_expired()
    assert store.staged_write_ids() == []
    assert store.used_bytes == 0
    with pytest.raises(StageReclaimed, match="deadline passed") as late:
        store.publish("w")
    assert not isinstance(late.value, KeyError)  # a put's late commit is no "not found"


# ---- a put's deadline, from its admission (put_deadline) -----------------------------------


def _stage_by(store, wid, ids, rows, expires_at):
    encoded = {"x": encode_field("x", rows)}
    return asyncio.run(store.stage("p", wid, ids, encoded, None, expires_at))


def test_a_stage_arriving_after_its_puts_deadline_is_refused_before_anything_is_allocated(
    stores,
):
    store = stores()
    with pytest.raises(Overloaded, match="deadline passed") as late:
        _stage_by(store, "w", ["a"], _rows(1, MiB), time.time() - 1.0)
    assert late.value.queue == "stage"
    assert store.staged_write_ids() == []
    assert store.used_bytes == 0


def test_a_stage_is_kept_until_its_puts_deadline_plus_the_grace_never_past_the_ttl(stores):
    store = stores(stage_ttl_s=30.0)
    _stage_by(store, "soon", ["a"], _rows(1, 8), time.time() + 1.0)
    _stage_by(store, "far", ["b"], _rows(1, 8), time.time() + 3600.0)  # a client can't pin
    _stage_by(store, "none", ["c"], _rows(1, 8), None)  # an older client: the unit's own ttl
    left = {w: store.staged[w].deadline - time.monotonic() for w in ("soon", "far", "none")}
    assert 0 < left["soon"] <= 1.0 + STAGE_GRACE_S
    assert left["soon"] > STAGE_GRACE_S - 0.5  # kept past the deadline, for a late publish
    assert 30.0 < left["far"] <= 30.0 + STAGE_GRACE_S
    assert 29.0 < left["none"] <= 30.0


def test_a_wait_for_room_ends_at_the_puts_deadline_with_nothing_staged(stores):
    store = stores(capacity_bytes=2 * MiB, put_wait_timeout_s=120.0)
    _put(store, "p", "full", ["f0", "f1"], {"x": _rows(2, MiB)})
    t0 = time.monotonic()
    with pytest.raises(Overloaded, match="waited for room") as late:
        _stage_by(store, "w", ["a"], _rows(1, MiB), time.time() + 0.3)
    assert time.monotonic() - t0 < 30  # the put's deadline ended it, not the 120 s wait
    assert late.value.queue == "stage"
    assert store.staged_write_ids() == []


def test_a_publish_refuses_a_schema_another_write_published_since_its_stage(stores):
    """Two first writes of x staged before either is published (stage compares published
    columns only): the later publish or prepare is refused, publishing nothing."""
    store = stores()
    _stage(store, "p", "f32", ["a"], {"x": torch.zeros(1, 4)})
    _stage(store, "p", "i64", ["b"], {"x": torch.zeros(1, 4, dtype=torch.int64)})
    _stage(store, "p", "i64-multi", ["c"], {"x": torch.zeros(1, 4, dtype=torch.int64)})
    assert store.publish("f32")
    with pytest.raises(SchemaConflict) as refused:
        store.publish("i64")
    assert refused.value.fields == ["x"]
    with pytest.raises(SchemaConflict):
        store.prepare("i64-multi", SampleMeta(seq=2), staged_units=[0, 1])
    assert sorted(store.partitions["p"].slot_of) == ["a"]
    assert store.partitions["p"].columns["x"].schema == encode_field("x", torch.zeros(1, 4)).schema


def test_unpublish_drops_only_the_cells_its_write_filled(stores):
    """A write-back of y onto a (which holds x), also creating b, undone by write id: a
    keeps x, b is forgotten, y's column and its schema go, the memory comes back, and
    the write id is no longer published (a retried commit publishes anew)."""
    store = stores()
    _put(store, "p", "x", ["a"], {"x": _rows(1, 64)})
    used = store.used_bytes
    _put(store, "p", "wb", ["a", "b"], {"y": _rows(2, 1024)}, SampleMeta(seq=2))
    assert store.unpublish("p", "wb") == 2 * 1024
    assert torch.equal(_read(store, "p", ["a"], "x"), _rows(1, 64))
    assert sorted(store.partitions["p"].slot_of) == ["a"]
    assert "y" not in store.partitions["p"].columns
    assert store.used_bytes == used
    assert "wb" not in store.recovery_view().published
    _put(store, "p", "y64", ["a"], {"y": torch.zeros(1, 2, dtype=torch.float64)})
    assert store.unpublish("p", "wb") == 0  # once only: the write is no longer remembered


def test_unpublish_leaves_a_newer_writes_bytes_and_replaced_cells(stores):
    """Cells another write filled since (here: after a clear) are not this write's; cells
    this write replaced (overwrite) keep its bytes (the old ones were freed at publish)."""
    store = stores()
    _put(store, "p", "old", ["a", "b"], {"x": _rows(2, 8)})
    _put(store, "p", "w", ["a", "b", "c"], {"x": _rows(3, 8, start=10)})  # overwrites a, b
    store.clear("p", ["c"])
    _put(store, "p", "newer", ["c"], {"x": _rows(1, 8, start=20)})
    assert store.unpublish("p", "w") == 0
    assert torch.equal(_read(store, "p", ["a", "b", "c"], "x")[:, 0], torch.tensor([10, 11, 20]))


def test_unpublish_of_some_samples_keeps_the_rest_and_the_write_published(stores):
    """A commit applied while a clear took some of its samples: only theirs are undone."""
    store = stores()
    _put(store, "p", "w", ["a", "b"], {"x": _rows(2, 8)})
    assert store.unpublish("p", "w", ["b"]) == 8
    assert torch.equal(_read(store, "p", ["a"], "x"), _rows(1, 8))
    assert sorted(store.partitions["p"].slot_of) == ["a"]
    assert "w" in store.recovery_view().published
    store.clear("p", ["a"])
    _put(store, "p", "w2", ["c"], {"x": _rows(1, 8)})
    assert store.unpublish("p", "w2") == 8
    assert "p" not in store.partitions  # nothing left of it: the partition goes


# ---- checkpoints, recovery, previews ------------------------------------------------------


def _checkpoint(store, directory, cut, parent=None, checkpoint_id="c1"):
    """Pin ``store`` now and write the rows ``cut`` names (what a controller's save does)."""
    store.pin_checkpoint(checkpoint_id)
    directory.mkdir()
    parent_files = None if parent is None else parent[1].files
    return asyncio.run(
        store.write_checkpoint(
            checkpoint_id,
            str(directory),
            cut,
            None if parent is None else str(parent[0]),
            parent_files,
        )
    )


def test_a_checkpoint_loads_into_a_fresh_store_with_its_bytes_and_commit_metadata(stores, tmp_path):
    store = stores()
    jagged = [torch.arange(n, dtype=torch.float32) for n in (3, 1, 4)]
    _put(store, "p", "w1", ["a", "b", "c"], {"x": jagged}, SampleMeta(1, {"a": 3}, {"b": {"g": 1}}))
    _put(store, "q", "w2", ["d", "e"], {"y": _rows(2, 16)}, SampleMeta(2))
    ck = tmp_path / "ck"
    dumped = _checkpoint(store, ck, {"p": ["a", "b", "c"], "q": ["d"]})  # "e": a second copy

    fresh = stores()
    assert fresh.load(str(ck), dumped.files) == 4
    assert fresh.recovery_view().partitions["p"] == store.recovery_view().partitions["p"]
    q = fresh.recovery_view().partitions["q"]
    assert (q.sample_ids, q.seq) == (["d"], [2])  # what the cut does not name is not in it
    got = _read(fresh, "p", ["a", "b", "c"], "x")
    assert [t.tolist() for t in got.unbind()] == [t.tolist() for t in jagged]
    assert torch.equal(_read(fresh, "q", ["d"], "y"), _rows(1, 16))
    with pytest.raises(InvalidBatch, match="already holds partition"):
        fresh.load(str(ck), dumped.files)

    path = ck / dumped.files[1].name  # the data segment
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # one bit pattern changed, the size kept
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptPayload, match="does not match"):
        stores().load(str(ck), dumped.files)


def test_a_pinned_cut_is_written_as_it_was_while_the_store_changes(stores, tmp_path):
    """After the pin, a clear, a re-put of the same id, an overwrite and a new sample change
    nothing the checkpoint writes: the cleared sample's bytes stay held (not freed, not
    reused) until the write, and are let go after it."""
    store = stores()
    _put(store, "p", "w1", _ids("s", 4), {"x": _rows(4, 4096)}, SampleMeta(1))
    store.pin_checkpoint("c1")
    assert store.clear("p", None) == 4 * 4096
    assert store.used_bytes > 0  # the cleared bytes are held: not freed, not reused
    _put(store, "p", "w2", ["s0", "new"], {"x": _rows(2, 4096, start=100)}, SampleMeta(2))
    _stage(store, "p", "w3", ["s0"], {"x": _rows(1, 4096, start=200)})
    assert store.publish("w3", SampleMeta(3))  # s0 overwritten in place of its cell
    ck = tmp_path / "ck"
    ck.mkdir()
    dumped = asyncio.run(store.write_checkpoint("c1", str(ck), {"p": _ids("s", 4)}))
    assert dumped.samples == 4
    fresh = stores()
    assert fresh.load(str(ck), dumped.files) == 4
    assert torch.equal(_read(fresh, "p", _ids("s", 4), "x"), _rows(4, 4096))  # as pinned
    assert fresh.recovery_view().partitions["p"].seq == [1, 1, 1, 1]
    assert store.checkpoint_pins.held == 0
    store.clear("p", None)
    assert store.used_bytes == 0  # the pin's references are gone with it


def test_an_incremental_checkpoint_writes_only_new_values_and_outlives_its_parent(stores, tmp_path):
    store = stores()
    _put(store, "p", "w1", _ids("s", 8), {"x": _rows(8, 4096)}, SampleMeta(1))
    first = _checkpoint(store, tmp_path / "a", {"p": _ids("s", 8)})
    assert (first.written - first.files[0].nbytes, first.linked) == (8 * 4096, 0)
    _put(store, "p", "w2", _ids("t", 2), {"x": _rows(2, 4096, start=8)}, SampleMeta(2))
    store.clear("p", ["s7"])
    cut = {"p": _ids("s", 7) + _ids("t", 2)}
    second = _checkpoint(store, tmp_path / "b", cut, (tmp_path / "a", first), "c2")
    index_bytes = second.files[0].nbytes
    assert second.written - index_bytes == 2 * 4096  # only the new rows' bytes
    assert second.linked == 8 * 4096
    inherited = second.files[2].name
    assert os.stat(tmp_path / "a" / inherited).st_ino == os.stat(tmp_path / "b" / inherited).st_ino
    shutil.rmtree(tmp_path / "a")  # deleting the parent leaves the child whole
    fresh = stores()
    assert fresh.load(str(tmp_path / "b"), second.files) == 9
    got = _read(fresh, "p", cut["p"], "x")
    assert torch.equal(got, torch.cat([_rows(7, 4096), _rows(2, 4096, start=8)]))


def test_a_cut_pinned_and_never_written_is_released_after_its_ttl(stores, tmp_path):
    """A controller that dies between the pin and the write leaves the unit holding the
    cut's blocks; the unit's sweeper lets them go once the pin is older than
    ``UNWRITTEN_PIN_TTL_S`` and no copy of it started. A late write is then typed."""
    store = stores()
    _put(store, "p", "w1", _ids("s", 4), {"x": _rows(4, 4096)}, SampleMeta(1))
    store.pin_checkpoint("c1")
    pinned_at = time.monotonic()
    store.clear("p", None)
    assert store.used_bytes > 0  # held by the pin
    pins = store.checkpoint_pins
    assert pins.release_unwritten(store, now=pinned_at + 1) == []  # young: a write may come
    ttl = unit_checkpoint.UNWRITTEN_PIN_TTL_S
    assert pins.release_unwritten(store, now=pinned_at + ttl + 1) == ["c1"]
    assert (pins.held, store.used_bytes) == (0, 0)
    (tmp_path / "ck").mkdir()
    with pytest.raises(CheckpointError, match="holds no cut of checkpoint c1"):
        asyncio.run(store.write_checkpoint("c1", str(tmp_path / "ck"), {"p": _ids("s", 4)}))


def test_a_cut_being_copied_is_never_released_as_stale(stores, tmp_path):
    """The ttl counts only until the copy starts: a long, paced copy keeps its pin, and a
    new checkpoint's pin leaves it alone too (the copy releases it when done)."""
    store = stores()
    _put(store, "p", "w1", _ids("s", 4), {"x": _rows(4, 4096)}, SampleMeta(1))
    store.pin_checkpoint("c1")
    (tmp_path / "ck").mkdir()
    pins = store.checkpoint_pins

    async def race():
        copy = asyncio.create_task(
            store.write_checkpoint("c1", str(tmp_path / "ck"), {"p": _ids("s", 4)})
        )
        await asyncio.sleep(0)  # one turn of the loop: the copy has started (it is awaited)
        assert pins.release_unwritten(store, now=time.monotonic() + 1e6) == []
        store.pin_checkpoint("c2")  # the next checkpoint pins while c1 is still copied
        assert pins.held == 2
        return await copy

    dumped = asyncio.run(race())
    assert dumped.samples == 4
    assert pins.held == 1  # c1 released by its copy; c2 waits for its own write
    assert stores().load(str(tmp_path / "ck"), dumped.files) == 4


def test_a_paced_copy_rests_in_proportion_to_the_cpu_it_used():
    """At share s, work that cost t seconds of the thread's CPU is followed by a rest of
    t * (1/s - 1), so the copy is busy at most s of its wall time; share 1 never rests."""
    cpu, rests = [0.0], []

    def rest(seconds):
        rests.append(seconds)
        cpu[0] += 0.001  # a rest costs a little CPU of its own, never counted as the copy's

    pace = unit_checkpoint.CopyPace(0.25, cpu_clock=lambda: cpu[0], rest=rest)
    for busy in (0.02, 0.0, 0.1):
        cpu[0] += busy
        pace.after_batch()
    assert rests == pytest.approx([0.06, 0.3])  # 3x each batch's CPU; none after an idle one
    assert (pace.busy_s, pace.rested_s) == pytest.approx((0.12, 0.36))
    cpu[0] += 0.5  # bookkeeping between batches (keys, parent lookups): not the copy's
    pace.start()
    cpu[0] += 0.01
    pace.after_batch()
    assert rests[-1] == pytest.approx(0.03)  # only the batch's own CPU is paced
    full = unit_checkpoint.CopyPace(1.0, cpu_clock=lambda: cpu[0], rest=rest)
    cpu[0] += 5.0
    full.after_batch()
    assert len(rests) == 3  # share 1 added none
    for share in (0, -0.5, 1.5):
        with pytest.raises(InvalidBatch, match="copy share"):
            unit_checkpoint.CopyPace(share)


def test_a_paced_checkpoint_writes_the_same_bytes_as_one_at_full_speed(
    stores, tmp_path, monkeypatch
):
    """Three batches (20 MiB) at share 0.5 rest after each, and write byte for byte what
    share 1 writes: the pace changes when bytes are written, never which."""
    paces = []

    class Recorded(unit_checkpoint.CopyPace):
        def __init__(self, share, **kw):
            super().__init__(share, **kw)
            paces.append(self)

    monkeypatch.setattr(unit_checkpoint, "CopyPace", Recorded)
    store = stores()
    _put(store, "p", "w1", _ids("s", 20), {"x": _rows(20, 1 << 20)}, SampleMeta(1))
    dumped = {}
    for share, name in ((1.0, "full"), (0.5, "paced")):
        store.pin_checkpoint(name)
        (tmp_path / name).mkdir()
        dumped[share] = asyncio.run(
            store.write_checkpoint(
                name, str(tmp_path / name), {"p": _ids("s", 20)}, None, None, share
            )
        )
    full, paced = paces
    assert full.rested_s == 0
    assert paced.rested_s > 0
    assert paced.rested_s == pytest.approx(paced.busy_s, rel=0.05)  # share 0.5: as long as busy
    data = [
        (tmp_path / n / d.files[1].name).read_bytes()
        for n, d in zip(("full", "paced"), dumped.values())
    ]
    assert len(data[0]) == 20 << 20
    assert data[0] == data[1]
    assert stores().load(str(tmp_path / "paced"), dumped[0.5].files) == 20


def test_a_parent_segment_is_copied_where_the_filesystem_refuses_a_link(
    stores, tmp_path, monkeypatch
):
    """Across filesystems (EXDEV) the parent's segment is copied, not linked: the same
    bytes, counted as copied, and the child restores whole with its parent deleted."""
    store = stores()
    _put(store, "p", "w1", _ids("s", 3), {"x": _rows(3, 5000)}, SampleMeta(1))
    first = _checkpoint(store, tmp_path / "a", {"p": _ids("s", 3)})
    _put(store, "p", "w2", ["t"], {"x": _rows(1, 5000, start=3)}, SampleMeta(2))

    def no_link(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link", src)

    monkeypatch.setattr(unit_checkpoint.os, "link", no_link)
    cut = {"p": [*_ids("s", 3), "t"]}
    second = _checkpoint(store, tmp_path / "b", cut, (tmp_path / "a", first), "c2")
    assert second.linked == 0
    inherited = second.files[2].name
    assert (tmp_path / "b" / inherited).read_bytes() == (tmp_path / "a" / inherited).read_bytes()
    assert second.written - second.files[0].nbytes == 5000 + 3 * 5000  # new, then copied
    shutil.rmtree(tmp_path / "a")
    fresh = stores()
    assert fresh.load(str(tmp_path / "b"), second.files) == 4
    assert torch.equal(
        _read(fresh, "p", cut["p"], "x"), torch.cat([_rows(3, 5000), _rows(1, 5000, start=3)])
    )


def test_a_parent_from_another_process_of_the_unit_is_not_referenced(stores, tmp_path):
    """Block ids name bytes only within one process: a restarted unit copies everything."""
    _put(old := stores(), "p", "w1", _ids("s", 2), {"x": _rows(2, 4096)}, SampleMeta(1))
    first = _checkpoint(old, tmp_path / "a", {"p": _ids("s", 2)})
    _put(new := stores(), "p", "w1", _ids("s", 2), {"x": _rows(2, 4096)}, SampleMeta(1))
    second = _checkpoint(new, tmp_path / "b", {"p": _ids("s", 2)}, (tmp_path / "a", first))
    assert (second.written - second.files[0].nbytes, second.linked) == (2 * 4096, 0)
    assert len(second.files) == 2  # its index and its own segment


def test_a_preview_shows_each_field_of_one_sample(stores):
    store = stores()
    encoded = {
        "dense": encode_field("dense", torch.tensor([[1.5, 2.5], [3.5, 4.5]])),
        "jagged": encode_field("jagged", [torch.arange(3), torch.arange(5)]),
        "obj": encode_field("obj", [{"k": 1}, "two"], objects_allowed=True),
    }
    asyncio.run(store.stage("p", "w", ["a", "b"], encoded))
    store.publish("w")
    shown = store.preview("p", "b", None, max_elems=4)
    assert shown["dense"] == {
        "dtype": "float32",
        "layout": "dense",
        "shape": [2],
        "values": [3.5, 4.5],
    }
    assert shown["jagged"]["shape"] == [5]
    assert shown["jagged"]["values"] == [0, 1, 2, 3]
    assert shown["obj"]["values"] == ["two"]
    assert list(store.preview("p", "a", ["dense"], 1)) == ["dense"]
    with pytest.raises(SamplesNotFound):
        store.preview("p", "zz", None, 4)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_a_preview_shows_every_dtype_as_torch_reads_it_without_importing_it(dtype):
    # What torch shows for the same bytes: floats widened to float32, the rest as stored.
    values = (torch.randn(6) * 50).to(DTYPES[dtype])
    want = values.float().tolist() if values.dtype.is_floating_point else values.tolist()
    raw = values.view(torch.uint8).numpy()  # the bytes as a unit holds them
    assert first_elements(raw, dtype, 4) == want[:4]
    assert first_elements(raw, dtype, 100) == want
