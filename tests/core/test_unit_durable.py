"""A durable storage unit without Ray: chunk files and a row log a new process re-attaches.

Each test runs a ``UnitStore`` over a state directory, drops it without closing (as a
killed process leaves its files), and opens a second store on the same directory: what
was committed must be there, byte for byte, at the same commit order and tags; what was
cleared, undone or never committed must not, and its files must be gone.
"""

import asyncio
import dataclasses
import os

import numpy as np
import pytest
import torch
from polling import wait_until

from dataplane_client.codec.fields import decode_field, encode_field
from dataplane_client.wire import shm
from dataplane_server.core.recovery_messages import SampleMeta
from dataplane_server.core.unit import row_log
from dataplane_server.core.unit.chunk_files import ChunkFiles
from dataplane_server.core.unit.row_log import RowLog
from dataplane_server.core.unit.store import UnitStore

pytestmark = pytest.mark.skipif(not shm.supported(), reason="no shared memory files here")
MiB = 1 << 20


def _open(directory, sync="none", reserve=0) -> UnitStore:
    """A unit process started on ``directory`` (nothing is closed when a test drops it)."""
    return UnitStore(
        0,
        256 * MiB,
        put_wait_timeout_s=0.0,
        use_shm=True,
        warm_reserve_bytes=reserve,
        stage_ttl_s=30.0,
        files=ChunkFiles(
            os.path.join(directory, "chunks"), prefault=sync == "none", recycle=sync == "none"
        ),
        log=RowLog(os.path.join(directory, "index"), sync, interval_s=3600),
    )


def _put(store, pid, wid, ids, value, seq, tags=None) -> None:
    encoded = {"x": encode_field("x", value)}
    asyncio.run(store.stage(pid, wid, ids, encoded))
    assert store.publish(wid, SampleMeta(seq=seq, tags=tags or {}))


def _read(store, pid, ids) -> torch.Tensor:
    return decode_field(store.read(pid, ids, ["x"])["x"])


def _rows(n, start=0, width=256) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.int32)[:, None].repeat(1, width)


def _files(directory) -> set[str]:
    return set(os.listdir(os.path.join(directory, "chunks")))


def test_a_new_process_finds_every_committed_sample_its_order_tags_and_bytes(tmp_path):
    d = str(tmp_path)
    first = _open(d)
    _put(first, "p", "w1", ["a", "b"], _rows(2), seq=1, tags={"a": {"group_id": "g"}})
    _put(first, "r", "w2", ["c"], _rows(1, 7, width=1 << 18), seq=2)  # a block of its own
    _put(first, "q", "w3", ["a"], _rows(1, 9), seq=3)
    before = first.recovery_view()
    second = _open(d)  # the first is dropped as a SIGKILL leaves it: nothing closed
    after = second.recovery_view()
    assert after.partitions == before.partitions
    assert torch.equal(_read(second, "p", ["a", "b"]), _rows(2))
    assert torch.equal(_read(second, "r", ["c"]), _rows(1, 7, width=1 << 18))
    assert torch.equal(_read(second, "q", ["a"]), _rows(1, 9))
    assert second.partitions["p"].group_slots == {"g": {second.partitions["p"].slot_of["a"]}}
    assert not second.publish("w2")  # a retried commit of a write published before: no-op
    # A same-node reader maps the re-attached file itself.
    rows = second.read_shm("r", ["c"], ["x"])["x"]
    mapped = shm.map_for_read(rows.chunks[0], int(rows.starts[0]), int(rows.ends[0]))
    assert torch.equal(
        decode_field(dataclasses.replace(rows.header, values=mapped)), _rows(1, 7, width=1 << 18)
    )


def test_cleared_undone_and_uncommitted_samples_stay_gone_and_their_files_are_removed(tmp_path):
    d = str(tmp_path)
    first = _open(d)
    _put(first, "p", "w1", ["a"], _rows(1, width=1 << 18), seq=1)
    _put(first, "p", "w2", ["b"], _rows(1, 2, width=1 << 18), seq=2)
    _put(first, "p", "w3", ["c"], _rows(1, 3, width=1 << 18), seq=3)
    _put(first, "gone", "w4", ["z"], _rows(1), seq=4)
    first.clear("p", ["a"])
    first.unpublish("p", "w2")
    first.clear("gone", None)
    asyncio.run(first.stage("p", "never", ["d"], {"x": encode_field("x", _rows(1, width=1 << 18))}))
    second = _open(d)
    assert list(second.partitions) == ["p"]
    assert sorted(second.partitions["p"].slot_of) == ["c"]
    assert torch.equal(_read(second, "p", ["c"]), _rows(1, 3, width=1 << 18))
    assert "w2" not in second.published
    assert "w1" in second.published
    # Only the file still holding "c" is left: "a"'s was freed, "never" was never committed.
    assert _files(d) == {second.arena.file_of(b)[0] for b in second.arena.blocks}
    assert len(second.arena.blocks) == 1


def test_a_reattached_block_is_sealed_and_block_ids_are_never_reused(tmp_path):
    d = str(tmp_path)
    first = _open(d)
    _put(first, "p", "w1", ["a"], _rows(1), seq=1)  # a slab with room left
    old = set(first.arena.blocks)
    second = _open(d)
    _put(second, "p", "w2", ["b"], _rows(1, 5), seq=2)
    slab = second.partitions["p"].columns["x"].chunk[second.partitions["p"].slot_of["b"]]
    assert int(slab) not in old  # a dead writer may still copy into the old slab's room
    assert torch.equal(_read(second, "p", ["a", "b"]), torch.cat([_rows(1), _rows(1, 5)]))


def test_a_compacted_index_and_a_torn_last_record_restore_what_was_whole(tmp_path, monkeypatch):
    d = str(tmp_path)
    monkeypatch.setattr(row_log, "_COMPACT_MIN_BYTES", 2048)
    first = _open(d)
    for i in range(40):  # several compactions on the way
        _put(first, "p", f"w{i}", [f"s{i}"], _rows(1, i), seq=i + 1)
    first.clear("p", ["s0"])
    logs = [n for n in os.listdir(os.path.join(d, "index")) if n.startswith("log.")]
    assert len(logs) == 1
    assert logs != ["log.0"]
    with open(os.path.join(d, "index", logs[0]), "ab") as f:
        f.write(b"\x40\x00\x00\x00torn")  # the process died inside a write
    second = _open(d)
    assert sorted(second.partitions["p"].slot_of) == sorted(f"s{i}" for i in range(1, 40))
    assert torch.equal(_read(second, "p", ["s39"]), _rows(1, 39))
    _put(second, "p", "after", ["t"], _rows(1, 99), seq=50)  # appends after the cut tail
    third = _open(d)
    assert torch.equal(_read(third, "p", ["t"]), _rows(1, 99))


def test_after_a_machine_crash_interval_replay_stops_where_the_last_flush_did(tmp_path):
    d = str(tmp_path)
    first = _open(d, sync="interval")
    _put(first, "p", "w1", ["a"], _rows(1), seq=1)
    first.log.flush()
    _put(first, "p", "w2", ["b"], _rows(1, 2), seq=2)  # not flushed when the machine dies
    same_boot = _open(d, sync="interval")  # a process death: the page cache kept it all
    assert sorted(same_boot.partitions["p"].slot_of) == ["a", "b"]
    same_boot.log.close()
    third = _open(d, sync="interval")
    _put(third, "p", "w3", ["c"], _rows(1, 3), seq=3)
    third.log.flush()
    _put(third, "p", "w4", ["e"], _rows(1, 4), seq=4)
    with open(os.path.join(d, "index", "boot_id"), "w") as f:
        f.write("another boot")
    rebooted = _open(d, sync="interval")
    assert sorted(rebooted.partitions["p"].slot_of) == ["a", "b", "c"]


def test_commit_sync_flushes_a_writes_bytes_and_record_before_publish_returns(
    tmp_path, monkeypatch
):
    d = str(tmp_path)
    store = _open(d, sync="commit")
    synced: list[int] = []
    monkeypatch.setattr(os, "fdatasync", synced.append)  # the order of flushes is the point
    monkeypatch.setattr(os, "fsync", synced.append)
    _put(store, "p", "w1", ["a"], _rows(1), seq=1)
    monkeypatch.undo()
    chunk_fd = store.arena.blocks[int(store.partitions["p"].columns["x"].chunk[0])].store.fd
    assert synced
    assert synced[0] == chunk_fd
    assert synced[-1] == store.log._fd
    assert np.array_equal(_read(_open(d, sync="commit"), "p", ["a"]).numpy(), _rows(1).numpy())


@pytest.mark.parametrize("sync", ["none", "commit"])
def test_a_freed_file_is_recycled_only_where_its_record_is_as_durable_as_new_bytes(tmp_path, sync):
    """``process`` (sync none): a cleared sample's file serves the next write of its size,
    and a restart reads that write's bytes under its own id, the cleared one gone.
    ``machine`` (commit): the file is removed, never reused."""
    d = str(tmp_path)
    first = _open(d, sync=sync, reserve=8 * MiB)
    _put(first, "p", "w1", ["a"], _rows(1, 1, width=1 << 18), seq=1)
    (old,) = _files(d) & {first.arena.file_of(b)[0] for b in first.arena.blocks}
    # The reserve makes chunks ahead in a thread: one finished after the clear would be
    # the latest back and serve the next write instead of the recycled file.
    wait_until(lambda: first.reserve.settled, 30, "the warm reserve to settle")
    first.clear("p", ["a"])
    _put(first, "p", "w2", ["b"], _rows(1, 2, width=1 << 18), seq=2)
    (new,) = {first.arena.file_of(b)[0] for b in first.arena.blocks}
    assert (new == old) == (sync == "none")
    assert (old in _files(d)) == (sync == "none")
    second = _open(d, sync=sync)
    assert sorted(second.partitions["p"].slot_of) == ["b"]
    assert torch.equal(_read(second, "p", ["b"]), _rows(1, 2, width=1 << 18))
