"""A durable unit's row index on file: what a restarted unit re-attaches (no Ray).

Beside its chunk files (unit/chunk_files.py) a durable unit keeps, per partition,
where each sample's bytes lie and what a controller rebuilds from (commit order,
lengths, tags, generations), so a new process of the unit finds every committed
sample where the old one left it. Two files:

- ``snapshot``: the whole index at one moment (the partitions' columns as they are
  in memory, numpy arrays pickled whole), with the generation of the log after it;
- ``log.<gen>``: records appended since, one per change, each the *state after* it
  of the rows it touched (a publish: the rows' cells; a clear: the ids gone). A
  record is applied by setting rows, so replay is a few array assignments per
  write, not a re-run of the verbs. Each record carries its length and a CRC; a
  torn tail (the process died inside a write) is cut off.

A record is appended before the blocks it stops naming are freed (their files
removed), so the index never names a removed file. The log is compacted into a new
snapshot once it outgrows the last one: the new log generation starts first, the
snapshot names it, and only then the old log goes.

Sync policy (``sync``): ``none`` (durability ``process``: the files are on RAM and
survive any process death with no flush), ``commit`` (``machine``: a record's
chunks, then the record, are flushed to disk before the publish returns) and
``interval`` (``machine``: a background thread flushes every ``interval_s``, then
writes down how far the log was flushed; after a machine crash, found by the boot
id changing, replay stops there, so no record names bytes that never reached disk).
"""

from __future__ import annotations

import itertools
import os
import pickle
import struct
import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from dataplane_client.wire import shm
from dataplane_client.wire.atomic_dir import sync_dir
from dataplane_server.core.unit.partition import UnitPartition

SYNC_POLICIES = ("none", "commit", "interval")
_HEADER = struct.Struct("<II")  # record length, CRC32 of the record
_COMPACT_MIN_BYTES = 64 << 20  # the log is compacted once past this and the last snapshot
_PUBLISHED_REMEMBERED = 65536  # as the store: write ids a retried commit finds published


@dataclass
class Restored:
    """What a new process of a durable unit starts from."""

    partitions: dict[str, UnitPartition] = field(default_factory=dict)
    published: OrderedDict = field(default_factory=OrderedDict)
    blocks: dict[int, tuple[str, int]] = field(default_factory=dict)  # id -> (file, size)
    next_block: int = 0  # every block id an earlier process used is below it


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _write_atomically(path: str, data: bytes, sync: bool) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        if sync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if sync:
        sync_dir(os.path.dirname(path))


class RowLog:
    def __init__(self, directory: str, sync: str = "none", interval_s: float = 1.0):
        if sync not in SYNC_POLICIES:
            raise ValueError(f"sync policy {sync!r}: expected one of {SYNC_POLICIES}")
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.sync = sync
        self.interval_s = float(interval_s)
        self._fd = -1
        self._gen = 0
        self._end = 0  # bytes of the current log
        self._snapshot_bytes = 0
        self._named: set[int] = set()  # blocks whose file the snapshot or log names
        self._max_block = -1
        self._dirty: dict[str, int] = {}  # interval: chunk name -> a dup of its descriptor
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.replayed_records = 0  # records the last restore applied (tests observe it)

    # ---- restart ------------------------------------------------------------------
    def restore(self) -> Restored:
        """The index as the last process left it; from then on records go to the log."""
        state = Restored()
        snap = os.path.join(self.directory, "snapshot")
        if os.path.exists(snap):
            with open(snap, "rb") as f:
                raw = f.read()
            self._snapshot_bytes = len(raw)
            loaded = pickle.loads(raw)
            self._gen = loaded.pop("gen")
            state = Restored(**loaded)
        log = self._log_path(self._gen)
        limit = self._replay_limit()
        self._end = self._replay(log, state, limit)
        for name in os.listdir(self.directory):  # logs of older generations: compacted
            if name.startswith("log.") and name != os.path.basename(log):
                os.unlink(os.path.join(self.directory, name))
        self._fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        os.ftruncate(self._fd, self._end)  # a torn or unflushed tail goes
        os.lseek(self._fd, self._end, os.SEEK_SET)
        _write_atomically(os.path.join(self.directory, "boot_id"), _boot_id().encode(), False)
        self._named = set(state.blocks)
        self._max_block = max(state.next_block - 1, max(state.blocks, default=-1))
        state.next_block = self._max_block + 1
        if self.sync == "interval":
            self._thread = threading.Thread(target=self._flush_every, daemon=True)
            self._thread.start()
        return state

    def _log_path(self, gen: int) -> str:
        return os.path.join(self.directory, f"log.{gen}")

    def _replay_limit(self) -> int | None:
        """Where replay stops: after a machine crash under ``interval``, at the last flush."""
        if self.sync != "interval":
            return None
        try:
            with open(os.path.join(self.directory, "boot_id")) as f:
                same_boot = f.read().strip() == _boot_id()
        except OSError:
            return None  # a fresh directory
        if same_boot:
            return None  # a process died: the page cache kept every record
        try:
            with open(os.path.join(self.directory, "synced")) as f:
                gen, end = (int(x) for x in f.read().split())
        except (OSError, ValueError):
            return 0
        return end if gen == self._gen else 0

    def _replay(self, path: str, state: Restored, limit: int | None) -> int:
        """Apply the log's whole records (up to ``limit`` bytes); the bytes applied."""
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return 0
        if limit is not None:
            data = data[:limit]
        pos = 0
        touched: set[str] = set()
        while pos + _HEADER.size <= len(data):
            n, crc = _HEADER.unpack_from(data, pos)
            body = data[pos + _HEADER.size : pos + _HEADER.size + n]
            if len(body) < n or zlib.crc32(body) != crc:
                break  # torn: the process died inside this write
            _apply(state, pickle.loads(body), touched)
            self.replayed_records += 1
            pos += _HEADER.size + n
        for pid in touched:
            _settle(state.partitions, pid)
        return pos

    # ---- records ------------------------------------------------------------------
    def rows(
        self,
        partition_id: str,
        part: UnitPartition | None,
        sample_ids: list[str],
        files: dict[int, shm.MemFd],
        published: str | None = None,
    ) -> None:
        """The rows of ``sample_ids`` as they are now (those no longer held: gone);
        ``files``: the chunks of the blocks they point into; ``published``: the write id
        this publish makes a no-op to retry."""
        rec: dict = {"pid": partition_id, "wid": published}
        if part is None:
            rec["gone"] = list(sample_ids)
        else:
            slots = np.fromiter(
                map(part.slot_of.get, sample_ids, itertools.repeat(-1)),
                dtype=np.int64,
                count=len(sample_ids),
            )
            held = slots >= 0
            rec["gone"] = list(itertools.compress(sample_ids, (~held).tolist()))
            rec["ids"] = list(itertools.compress(sample_ids, held.tolist()))
            slots = slots[held]
            part.grow_meta()
            rec["slots"], rec["seq"] = slots, part.seq[slots]
            rec["seq_len"], rec["gen"] = part.seq_len[slots], part.gen[slots]
            rec["tags"] = {s: part.tags[s] for s in slots.tolist() if s in part.tags}
            cols = {}
            for name, col in part.columns.items():
                col.ensure(part.next_slot)
                cols[name] = (
                    col.schema,
                    col.shared,
                    col.chunk[slots],
                    col.offset[slots],
                    col.nbytes[slots],
                    col.length[slots],
                )
            rec["cols"] = cols
        new = {b: c for b, c in files.items() if b not in self._named}
        rec["blocks"] = {b: (c.name, c.size) for b, c in new.items()}
        self._named.update(new)
        self._max_block = max(self._max_block, max(files, default=-1))
        self._append(rec, list(files.values()))

    def drop(self, partition_id: str, sample_ids: list[str] | None) -> None:
        """Samples forgotten (None: the whole partition)."""
        self._append({"pid": partition_id, "drop": sample_ids, "wid": None}, [])

    def unpublished(self, write_id: str) -> None:
        self._append({"unpublished": write_id}, [])

    def _append(self, rec: dict, chunks: list[shm.MemFd]) -> None:
        body = pickle.dumps(rec, protocol=5)
        if self.sync == "commit":  # the bytes reach the disk before the record naming them
            for chunk in chunks:
                os.fdatasync(chunk.fd)
        with self._lock:
            if self.sync == "interval":
                for chunk in chunks:
                    if chunk.name not in self._dirty:
                        self._dirty[chunk.name] = os.dup(chunk.fd)
            os.write(self._fd, _HEADER.pack(len(body), zlib.crc32(body)) + body)
            self._end += _HEADER.size + len(body)
        if self.sync == "commit":
            os.fsync(self._fd)

    # ---- flushing (interval) ----------------------------------------------------------
    def _flush_every(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.flush()

    def flush(self) -> None:
        """Chunks first, then the log; then note how far the log is safe after a crash."""
        if self.sync == "none":
            return
        with self._lock:
            dirty, self._dirty = self._dirty, {}
            gen, end = self._gen, self._end
            log = os.dup(self._fd)
        try:
            for fd in dirty.values():
                try:
                    os.fdatasync(fd)
                finally:
                    os.close(fd)
            os.fsync(log)
        finally:
            os.close(log)
        _write_atomically(os.path.join(self.directory, "synced"), f"{gen} {end}".encode(), True)

    # ---- compaction -----------------------------------------------------------------
    def due(self) -> bool:
        return self._end > max(_COMPACT_MIN_BYTES, self._snapshot_bytes)

    def compact(
        self,
        partitions: dict[str, UnitPartition],
        published: OrderedDict,
        files: dict[int, shm.MemFd],
    ) -> None:
        """Write the whole index as the new snapshot and start an empty log after it."""
        machine = self.sync != "none"
        if machine:
            self.flush()  # every chunk the snapshot names is on disk first
            for chunk in files.values():
                os.fdatasync(chunk.fd)
        gen = self._gen + 1
        fd = os.open(self._log_path(gen), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC)
        raw = pickle.dumps(
            {
                "gen": gen,
                "partitions": partitions,
                "published": published,
                "blocks": {b: (c.name, c.size) for b, c in files.items()},
                "next_block": self._max_block + 1,
            },
            protocol=5,
        )
        _write_atomically(os.path.join(self.directory, "snapshot"), raw, machine)
        with self._lock:
            old, self._fd, self._gen, self._end = self._fd, fd, gen, 0
        os.close(old)
        os.unlink(self._log_path(gen - 1))
        self._snapshot_bytes = len(raw)
        self._named = set(files)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.flush()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _apply(state: Restored, rec: dict, touched: set[str]) -> None:
    """One log record onto the restored index."""
    if "unpublished" in rec:
        state.published.pop(rec["unpublished"], None)
        return
    pid = rec["pid"]
    parts = state.partitions
    if "drop" in rec:
        if rec["drop"] is None:
            parts.pop(pid, None)
        elif pid in parts:
            _forget(parts[pid], rec["drop"])
            touched.add(pid)
        return
    state.blocks.update(rec["blocks"])
    state.next_block = max(state.next_block, max(rec["blocks"], default=-1) + 1)
    if rec["wid"] is not None:
        state.published[rec["wid"]] = None
        while len(state.published) > _PUBLISHED_REMEMBERED:
            state.published.popitem(last=False)
    part = parts.get(pid)
    if part is not None and rec["gone"]:
        _forget(part, rec["gone"])
    if "ids" not in rec or not rec["ids"]:
        touched.add(pid)
        return
    part = parts.setdefault(pid, UnitPartition())
    touched.add(pid)
    slots = rec["slots"]
    part.slot_of.update(zip(rec["ids"], slots.tolist()))
    part.next_slot = max(part.next_slot, int(slots.max()) + 1)
    part.grow_meta()
    part.seq[slots], part.seq_len[slots], part.gen[slots] = rec["seq"], rec["seq_len"], rec["gen"]
    for slot in slots.tolist():
        part.tags.pop(slot, None)
    part.tags.update(rec["tags"])
    for name, col in part.columns.items():  # a column the record lacks holds no cell here
        if name not in rec["cols"]:
            col.ensure(part.next_slot)
            col.chunk[slots] = -1
    for name, (schema, shared, chunk, offset, nbytes, length) in rec["cols"].items():
        col = part.column(name, schema)
        col.schema, col.shared = schema, shared
        col.chunk[slots], col.offset[slots] = chunk, offset
        col.nbytes[slots], col.length[slots] = nbytes, length


def _forget(part: UnitPartition, sample_ids: list[str]) -> None:
    slots = np.array([part.slot_of.pop(s) for s in sample_ids if s in part.slot_of], np.int64)
    part.forget_slots(slots)
    for col in part.columns.values():
        col.ensure(part.next_slot)
        col.chunk[slots] = -1


def _settle(parts: dict[str, UnitPartition], pid: str) -> None:
    """After replay: free slots, group members, and no empty column or partition."""
    part = parts.get(pid)
    if part is None:
        return
    if not part.slot_of:
        del parts[pid]
        return
    used = np.zeros(part.next_slot, dtype=bool)
    used[np.fromiter(part.slot_of.values(), dtype=np.int64, count=len(part.slot_of))] = True
    part.free_slots = np.flatnonzero(~used).tolist()[::-1]
    part.group_slots = {}
    for slot in part.tags:
        part.index_group(slot)
    for name in [n for n, c in part.columns.items() if not (c.chunk[: part.next_slot] >= 0).any()]:
        del part.columns[name]
