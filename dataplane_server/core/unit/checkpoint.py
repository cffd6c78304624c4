"""A storage unit's share of a checkpoint: a cut pinned at once, copied later (no Ray).

Point in time. ``pin`` runs at the cut (the controller holds commits and frees back
for its duration, ``controller/cut_gate.py``): it copies the unit's row metadata,
which is small, and takes one reference on every block the rows point into, as a
read lease does. Published bytes never change in place (``arena.py``), and a held
block is never freed or recycled, so ``write`` may copy the bytes long after, in a
thread, while puts, clears and reads go on: a sample cleared meanwhile still has
its bytes, a sample put meanwhile is not in the pinned rows. ``release`` drops
the references.

Incremental. What a unit writes for one checkpoint:

- ``unit-<u>.index``: msgpack, per partition the rows the cut names (ids, commit
  order, lengths, tags) and per field where each row's value lives: a segment
  and an offset in it, and the value's *key* (block, offset) in the unit that
  wrote it; plus that unit's incarnation (a random id per process);
- ``unit-<u>-<checkpoint>.data``: the bytes of values no parent segment holds,
  back to back.

With a parent written by the same incarnation, a value whose key the parent's
index names is the same bytes (a block id is never reused in a process, nor a
region of a block), so it is referenced, not copied: the parent's segment file is
hard-linked into the new directory (copied where the filesystem refuses a link),
so deleting the parent never breaks the child. The manifest holds every file's
size and checksum (``core/file_digest.py``: CRC-32C); a restore checks every file it
reads before storing anything.

Paced. The copy runs in a thread of its own at the lowest priority, and keeps its CPU
time to at most ``copy_share`` of its wall time (``CopyPace``: after each batch it
rests in proportion to what the batch cost), so writers and claimers on the same cores
lose at most about that share while it runs; a checkpoint then takes longer, not
them. PostgreSQL spreads a checkpoint's writes over time for the same reason
(``checkpoint_completion_target``), RocksDB's backup engine has a rate limit. Each
file is synced by the thread that wrote it, so the controller's last step (state,
manifest, rename) syncs only its own small files.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import msgpack
import numpy as np

from dataplane_client.wire import atomic_dir, failpoints
from dataplane_client.wire.encoded import contiguous_runs
from dataplane_client.wire.errors import (
    CapacityExceeded,
    CheckpointError,
    CorruptPayload,
    InvalidBatch,
)
from dataplane_server.core import file_digest
from dataplane_server.core.recovery_messages import DumpedFile, DumpedUnit
from dataplane_server.core.unit.partition import Column, UnitPartition
from dataplane_server.core.unit.segment_file import SegmentWriter, Staging

if TYPE_CHECKING:
    from dataplane_server.core.unit.arena import Arena

FORMAT = 2
_KEY_SHIFT = 40  # a value's key: block << 40 | offset (a block is far below 2**40 bytes)
_BATCH_BYTES = 8 << 20  # new values are gathered and written this much at a time
_HASH_BYTES = 8 << 20


class StoreParts(Protocol):
    """What a checkpoint reads and fills of a unit's store (``store.UnitStore``, which calls
    this module: named here by what it has, not imported)."""

    index: int
    incarnation: str
    partitions: dict[str, UnitPartition]
    arena: Arena
    capacity_bytes: int

    @property
    def used_bytes(self) -> int: ...


@dataclass
class PinnedColumn:
    schema: tuple
    shared: bool
    chunk: np.ndarray
    offset: np.ndarray
    nbytes: np.ndarray
    length: np.ndarray


@dataclass
class PinnedPartition:
    slot_of: dict[str, int]
    seq: np.ndarray
    seq_len: np.ndarray
    tags: dict[int, dict]
    columns: dict[str, PinnedColumn]


@dataclass
class Pinned:
    """A unit's rows as of a cut, and the blocks it holds a reference on until released."""

    incarnation: str
    partitions: dict[str, PinnedPartition]
    blocks: list[int] = field(default_factory=list)


class CopyPace:
    """Keeps a copy's CPU time to at most ``share`` of its wall time: after a batch whose
    copy took ``t`` seconds of this thread's CPU (from ``start`` to ``after_batch``), it
    rests ``t * (1 / share - 1)``. ``share`` 1 never rests. Only the bytes' copy is paced:
    the per-row bookkeeping between batches (keys, lookups in the parent, the index) is
    not, or an incremental checkpoint's time would grow with the rows stored, not with
    the bytes it copies. The copy's own thread calls it; a rest is the pacing itself,
    not a wait for another thread."""

    def __init__(self, share: float, cpu_clock=time.thread_time, rest=time.sleep):
        if not 0 < share <= 1:
            raise InvalidBatch(f"a checkpoint's copy share is in (0, 1], not {share!r}")
        self.share = float(share)
        self.busy_s = self.rested_s = 0.0
        self._cpu_clock, self._rest = cpu_clock, rest
        self._mark = cpu_clock()

    def start(self) -> None:
        """A batch's copy begins: what ran since the last batch is not counted."""
        self._mark = self._cpu_clock()

    def after_batch(self) -> None:
        now = self._cpu_clock()
        busy, self._mark = now - self._mark, now
        self.busy_s += busy
        if self.share < 1 and busy > 0:
            rest = busy * (1 / self.share - 1)
            self._rest(rest)
            self.rested_s += rest
            self._mark = self._cpu_clock()  # a rest's own CPU (little) is not the copy's


# A cut's write is asked for as soon as every unit has pinned (milliseconds later): a pin
# whose write has not started after this long belongs to a controller that died
# mid-checkpoint (a restarted one never resumes a save; the caller's call failed and is
# retried anew), and would otherwise hold its blocks until the next checkpoint.
UNWRITTEN_PIN_TTL_S = 120.0


class Pins:
    """A unit's pinned cuts, by checkpoint id, until their bytes are written."""

    def __init__(self) -> None:
        self._pinned: dict[str, Pinned] = {}
        self._pinned_at: dict[str, float] = {}  # time.monotonic() of each pin
        self._writing: set[str] = set()  # cuts being copied: theirs to release when done
        self._staging = Staging()  # the copy thread's buffer, kept from one checkpoint to the next
        # Copies run in a thread of their own, never a shared pool's: it stays at the
        # lowest priority (raising it back would need a privilege).
        self._copier = ThreadPoolExecutor(1, "checkpoint-copy", initializer=_lowest_priority)

    def pin(self, store: StoreParts, checkpoint_id: str) -> None:
        """Pin the unit's rows now. A cut pinned before and never written (its controller
        died mid-checkpoint) is released: the controller takes one checkpoint at a time.
        One being copied is left to its copy, which releases it when done."""
        for stale in [c for c in self._pinned if c not in self._writing]:
            self._release(store, stale)
        self._pinned[checkpoint_id] = pin(store)
        self._pinned_at[checkpoint_id] = time.monotonic()

    def release_unwritten(
        self, store: StoreParts, now: float | None = None, ttl_s: float = UNWRITTEN_PIN_TTL_S
    ) -> list[str]:
        """Release the cuts pinned more than ``ttl_s`` ago whose copy never started (the
        unit's sweeper calls it); returns their ids. A later ``write`` of one is a
        ``CheckpointError``, as for any cut the unit does not hold."""
        now = time.monotonic() if now is None else now
        stale = [
            c for c, at in self._pinned_at.items() if c not in self._writing and now - at > ttl_s
        ]
        for c in stale:
            self._release(store, c)
        return stale

    def _release(self, store: StoreParts, checkpoint_id: str) -> None:
        release(store, self._pinned.pop(checkpoint_id))
        self._pinned_at.pop(checkpoint_id, None)

    async def write(
        self,
        store: StoreParts,
        checkpoint_id: str,
        directory: str,
        cut: dict[str, list[str]],
        parent_dir: str | None,
        parent_files: list[DumpedFile] | None,
        copy_share: float = 1.0,
    ) -> DumpedUnit:
        """``write`` in a thread, so the unit serves meanwhile, paced to ``copy_share`` of
        one core (``CopyPace``); the pin goes after."""
        pinned = self._pinned.get(checkpoint_id)
        if pinned is None:
            raise CheckpointError(f"unit {store.index} holds no cut of checkpoint {checkpoint_id}")
        self._writing.add(checkpoint_id)
        try:
            await failpoints.pause_if_armed(failpoints.CHECKPOINT_COPY)
            return await asyncio.get_running_loop().run_in_executor(
                self._copier,
                write,
                store,
                pinned,
                directory,
                checkpoint_id,
                cut,
                parent_dir,
                parent_files,
                copy_share,
                self._staging,
            )
        finally:
            if len(self._staging.buf) > 2 * _BATCH_BYTES:  # one huge value: not kept for good
                self._staging = Staging()
            self._writing.discard(checkpoint_id)
            if self._pinned.get(checkpoint_id) is pinned:
                self._release(store, checkpoint_id)

    @property
    def held(self) -> int:
        return len(self._pinned)


def _lowest_priority() -> None:
    """The copying thread at the lowest CPU priority (Linux takes a thread id as a process
    id here): the copy yields to the unit's serving and to the writers and claimers of
    the same machine, which is what "pauses nothing" asks."""
    with contextlib.suppress(OSError):  # not permitted here: it runs at the unit's priority
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def index_name(unit: int) -> str:
    return f"unit-{unit}.index"


def pin(store: StoreParts) -> Pinned:
    """The unit's rows now, and a reference on every block they point into."""
    partitions, held = {}, []
    for pid, part in store.partitions.items():
        n = part.next_slot
        part.grow_meta()
        columns = {}
        for name, col in part.columns.items():
            col.ensure(n)
            columns[name] = PinnedColumn(
                col.schema,
                col.shared,
                col.chunk[:n].copy(),
                col.offset[:n].copy(),
                col.nbytes[:n].copy(),
                col.length[:n].copy(),
            )
            held.append(columns[name].chunk)
        # Tags are replaced, never changed in place (partition.remember): a shallow copy keeps them.
        partitions[pid] = PinnedPartition(
            dict(part.slot_of),
            part.seq[:n].copy(),
            part.seq_len[:n].copy(),
            dict(part.tags),
            columns,
        )
    blocks = np.unique(np.concatenate(held)) if held else np.zeros(0, dtype=np.int64)
    blocks = blocks[blocks >= 0].tolist()
    for block in blocks:
        store.arena.hold(block, 1)
    return Pinned(store.incarnation, partitions, blocks)


def release(store: StoreParts, pinned: Pinned) -> None:
    store.arena.release(pinned.blocks)
    pinned.blocks = []


@dataclass
class _Parent:
    """The values a parent checkpoint's segments hold, by key, sorted for lookup."""

    directory: str
    segments: list[DumpedFile]
    keys: np.ndarray
    segment: np.ndarray
    at: np.ndarray


def _parent(
    pinned: Pinned, directory: str | None, files: list[DumpedFile] | None
) -> _Parent | None:
    """The parent's values this unit may reference: none when there is no parent or another
    process of the unit wrote it (its keys name other blocks)."""
    if directory is None or not files:
        return None
    index = _read_index(directory, files)
    if index["incarnation"] != pinned.incarnation:
        return None
    segments = _listed(directory, index, files)
    keys, seg, at = [], [], []
    for part in index["partitions"].values():
        for fld in part["fields"].values():
            keys.append(_array(fld["key"]))
            seg.append(_array(fld["segment"]))
            at.append(_array(fld["at"]))
    if not keys:
        return _Parent(directory, segments, *(np.zeros(0, dtype=np.int64),) * 3)
    k, s, a = np.concatenate(keys), np.concatenate(seg), np.concatenate(at)
    order = np.argsort(k, kind="stable")
    return _Parent(directory, segments, k[order], s[order], a[order])


def _array(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.int64)


def write(
    store: StoreParts,
    pinned: Pinned,
    directory: str,
    checkpoint_id: str,
    cut: dict[str, list[str]],
    parent_dir: str | None = None,
    parent_files: list[DumpedFile] | None = None,
    copy_share: float = 1.0,
    staging: Staging | None = None,
) -> DumpedUnit:
    """Write the rows of ``pinned`` the cut names (partition -> ids) into ``directory``,
    paced to ``copy_share`` (``CopyPace``), each file synced before it returns.

    Values a parent of this process holds are referenced; only the others are copied.
    Safe in a thread: it reads only ``pinned`` and the bytes of blocks it holds.
    """
    pace = CopyPace(copy_share)
    parent = _parent(pinned, parent_dir, parent_files)
    data_name = f"unit-{store.index}-{checkpoint_id}.data"
    # Segment 0 is this checkpoint's own; the parent's keep their order after it.
    segments: list[DumpedFile | None] = [None, *(parent.segments if parent else [])]
    used = np.zeros(len(segments), dtype=bool)
    digest, written = file_digest.Digest(), 0
    index_parts = {}
    out = SegmentWriter(os.path.join(directory, data_name), staging)
    try:
        for pid, ids in cut.items():
            if not ids:
                continue  # none of the partition's samples live here
            part = pinned.partitions.get(pid)
            if part is None:
                raise CheckpointError(f"unit {store.index} holds none of partition {pid!r}")
            slots = _slots(store.index, pid, part, ids)
            fields = {}
            for name, col in part.columns.items():
                have = np.nonzero(col.chunk[slots] >= 0)[0]
                rows = slots[have]
                keys = (col.chunk[rows] << _KEY_SHIFT) | col.offset[rows]
                # An empty value takes no space, so another value may start where it does:
                # each gets a key of its own, below every real one.
                empty = np.nonzero(col.nbytes[rows] == 0)[0]
                keys[empty] = -1 - empty
                uniq, first, value_of = np.unique(keys, return_index=True, return_inverse=True)
                nbytes = col.nbytes[rows][first]
                seg, at = _inherited(parent, uniq)
                new = np.nonzero(seg < 0)[0]
                at[new] = written + np.cumsum(nbytes[new]) - nbytes[new]
                seg[new] = 0
                used[np.unique(seg)] = True
                for chunk in _batches(nbytes[new]):
                    pace.start()
                    size = int(nbytes[new[chunk]].sum())
                    values = store.arena.gather(
                        *_ranges(col, rows[first[new[chunk]]], nbytes[new[chunk]]),
                        into=out.reserve(size),
                    )
                    digest.update(values.data)
                    out.commit(size)
                    pace.after_batch()
                written += int(nbytes[new].sum())
                value_of = value_of.reshape(-1)
                fields[name] = {
                    "schema": [col.schema[0], col.schema[1], list(col.schema[2])],
                    "shared": col.shared,
                    "rows": have.astype(np.int64).tobytes(),
                    "lengths": col.length[rows].astype(np.int64).tobytes(),
                    "nbytes": col.nbytes[rows].astype(np.int64).tobytes(),
                    "segment": seg[value_of].astype(np.int64).tobytes(),
                    "at": at[value_of].astype(np.int64).tobytes(),
                    "key": keys.astype(np.int64).tobytes(),
                }
            index_parts[pid] = {
                "ids": list(ids),
                "seq": part.seq[slots].astype(np.int64).tobytes(),
                "seq_len": part.seq_len[slots].astype(np.int64).tobytes(),
                "tags": [part.tags.get(int(s)) for s in slots.tolist()],
                "fields": fields,
            }
    except BaseException:
        out.abandon()
        raise
    out.close()
    segments[0] = DumpedFile(store.index, data_name, written, digest.value())
    kept, linked, copied = _carry(directory, parent, segments, used, pace, staging)
    index = {
        "format": FORMAT,
        "unit": store.index,
        "incarnation": pinned.incarnation,
        "segments": [segments[i].name for i in kept],  # type: ignore[union-attr]
        "partitions": _renumbered(index_parts, kept),
    }
    try:
        data = msgpack.packb(index, use_bin_type=True)
    except TypeError as e:
        raise InvalidBatch(f"unit {store.index} holds tags that cannot be saved ({e})") from None
    atomic_dir.write_synced(os.path.join(directory, index_name(store.index)), data)
    index_file = DumpedFile(store.index, index_name(store.index), len(data), file_digest.of(data))
    files = [index_file, *(segments[i] for i in kept)]
    return DumpedUnit(
        store.index,
        files,  # type: ignore[arg-type]
        written=written + len(data) + copied,
        linked=linked,
        samples=sum(len(ids) for ids in cut.values()),
    )


def _slots(unit: int, pid: str, part: PinnedPartition, ids: list[str]) -> np.ndarray:
    slots = np.fromiter((part.slot_of.get(s, -1) for s in ids), dtype=np.int64, count=len(ids))
    if (slots < 0).any():
        missing = [ids[i] for i in np.nonzero(slots < 0)[0][:3].tolist()]
        raise CheckpointError(
            f"unit {unit} does not hold samples {missing} of partition {pid!r} that the cut names"
        )
    return slots


def _inherited(parent: _Parent | None, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per key: the parent's segment (renumbered after this checkpoint's own, 0) and offset
    holding that value, or segment -1 where no parent segment holds it."""
    seg = np.full(len(keys), -1, dtype=np.int64)
    at = np.zeros(len(keys), dtype=np.int64)
    if parent is None or not len(parent.keys) or not len(keys):
        return seg, at
    where = np.minimum(np.searchsorted(parent.keys, keys), len(parent.keys) - 1)
    hit = (parent.keys[where] == keys) & (keys >= 0)  # an empty value is never looked up
    seg[hit] = parent.segment[where[hit]] + 1
    at[hit] = parent.at[where[hit]]
    return seg, at


def _batches(nbytes: np.ndarray):
    """Slices of values of about ``_BATCH_BYTES`` together (at least one value each)."""
    ends = np.cumsum(nbytes)
    start = 0
    while start < len(nbytes):
        base = ends[start - 1] if start else 0
        stop = max(start + 1, int(np.searchsorted(ends, base + _BATCH_BYTES, side="right")))
        yield slice(start, stop)
        start = stop


def _ranges(
    col: PinnedColumn, rows: np.ndarray, nbytes: np.ndarray
) -> tuple[list[int], np.ndarray, np.ndarray, np.ndarray]:
    """``Arena.gather``'s arguments for these rows' values. Gathering from a thread is safe:
    every block is held (never freed), and its bytes never change."""
    blocks, which = np.unique(col.chunk[rows], return_inverse=True)
    starts = col.offset[rows]
    return blocks.tolist(), which.reshape(-1), starts, starts + nbytes


def _carry(
    directory: str,
    parent: _Parent | None,
    segments: list,
    used: np.ndarray,
    pace: CopyPace,
    staging: Staging | None,
) -> tuple[list[int], int, int]:
    """Hard-link the parent segments still used into ``directory`` (copy where the filesystem
    refuses a link, paced as the rest); returns the kept segments' numbers, bytes linked
    and bytes copied."""
    kept, linked, copied = [0], 0, 0
    for i in range(1, len(segments)):
        if not used[i]:
            continue
        assert parent is not None
        seg = segments[i]
        src, dst = os.path.join(parent.directory, seg.name), os.path.join(directory, seg.name)
        try:
            os.link(src, dst)
            linked += seg.nbytes
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                raise
            _copy_file(src, dst, pace, staging)
            copied += seg.nbytes
        kept.append(i)
    return kept, linked, copied


def _copy_file(src: str, dst: str, pace: CopyPace, staging: Staging | None) -> None:
    out = SegmentWriter(dst, staging)
    try:
        with open(src, "rb") as inp:
            while True:
                pace.start()
                got = inp.readinto(out.reserve(_BATCH_BYTES).data)  # straight into the buffer
                if not got:
                    break
                out.commit(got)
                pace.after_batch()
    except BaseException:
        out.abandon()
        raise
    out.close()


def _renumbered(parts: dict, kept: list[int]) -> dict:
    """The index's segment numbers as positions in the kept list."""
    new_of = np.full(max(kept) + 1, -1, dtype=np.int64)
    new_of[kept] = np.arange(len(kept))
    for part in parts.values():
        for fld in part["fields"].values():
            fld["segment"] = new_of[_array(fld["segment"])].astype(np.int64).tobytes()
    return parts


# ---- restore ---------------------------------------------------------------------------
def _read_index(directory: str, files: list[DumpedFile]) -> dict:
    """A unit's index, checked against its manifest entry (the first of ``files``)."""
    entry = files[0]
    path = os.path.join(directory, entry.name)
    with open(path, "rb") as f:
        data = f.read()
    if len(data) != entry.nbytes or not file_digest.matches(entry.digest, data):
        raise CorruptPayload(f"checkpoint file {path} does not match its manifest")
    return msgpack.unpackb(data, raw=False)


def _listed(directory: str, index: dict, files: list[DumpedFile]) -> list[DumpedFile]:
    """The manifest entries of the segments an index uses, in its order."""
    by_name = {f.name: f for f in files}
    try:
        return [by_name[name] for name in index["segments"]]
    except KeyError as e:
        raise CorruptPayload(f"{directory}: segment {e} is not in the manifest") from None


def _segment(directory: str, entry: DumpedFile) -> np.ndarray:
    """A segment's bytes (mapped, not read), checked against its manifest entry."""
    path = os.path.join(directory, entry.name)
    digest, size = file_digest.checker(entry.digest), 0
    with open(path, "rb") as f:
        while block := f.read(_HASH_BYTES):
            digest.update(block)
            size += len(block)
    if size != entry.nbytes or digest.value() != entry.digest:
        raise CorruptPayload(f"checkpoint file {path} does not match its manifest")
    if not size:
        return np.zeros(0, dtype=np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r")


def load(store: StoreParts, directory: str, files: list[DumpedFile]) -> int:
    """Store the rows of a unit's checkpoint files (index first; every file checked first).

    ``store`` must hold none of its partitions. Returns the number of samples loaded.
    """
    index = _read_index(directory, files)
    segments = [_segment(directory, entry) for entry in _listed(directory, index, files)]
    for pid in index["partitions"]:
        if pid in store.partitions:
            raise InvalidBatch(
                f"unit {store.index} already holds partition {pid!r}: restore into a fresh service"
            )
    loaded = 0
    for pid, rec in index["partitions"].items():
        part = store.partitions[pid] = UnitPartition()
        slots = part.slots_for(rec["ids"])
        part.grow_meta()
        part.seq[slots] = _array(rec["seq"])
        part.seq_len[slots] = _array(rec["seq_len"])
        part.tags.update((int(s), t) for s, t in zip(slots.tolist(), rec["tags"]) if t)
        for slot in part.tags:
            part.index_group(slot)
        for name, fld in rec["fields"].items():
            _load_field(store, part, slots, name, fld, segments)
        loaded += len(slots)
    return loaded


def _load_field(
    store: StoreParts,
    part: UnitPartition,
    slots: np.ndarray,
    name: str,
    fld: dict,
    segments: list[np.ndarray],
) -> None:
    kind, dtype, shape = fld["schema"]
    rows = slots[_array(fld["rows"])]
    nbytes, seg, at = _array(fld["nbytes"]), _array(fld["segment"]), _array(fld["at"])
    # Each distinct value once (a group field's members share theirs), back to back.
    uniq, first, value_of = np.unique(
        np.stack([seg, at, nbytes]), axis=1, return_index=True, return_inverse=True
    )
    value_of = value_of.reshape(-1)
    sizes = nbytes[first]
    total = int(sizes.sum())
    arena = store.arena
    if store.used_bytes + arena.extra_bytes([total]) > store.capacity_bytes:
        raise CapacityExceeded(
            f"unit {store.index}: the checkpoint's {total} bytes of field {name!r} do not fit "
            f"({store.used_bytes} of {store.capacity_bytes} used)"
        )
    ((block, offset),) = arena.alloc([total])
    values = np.empty(total, dtype=np.uint8)
    starts = uniq[1]
    key = uniq[0] << 48
    run_starts, run_ends = contiguous_runs(starts + key, starts + sizes + key)
    pos = 0
    for s, e in zip(run_starts.tolist(), run_ends.tolist()):
        lo = s & ((1 << 48) - 1)
        src = segments[s >> 48][lo : lo + e - s]
        if len(src) != e - s:
            raise CorruptPayload(f"a checkpoint segment is shorter than its index says ({name!r})")
        values[pos : pos + e - s] = src
        pos += e - s
    arena.write(block, offset, values)
    col = part.columns[name] = Column((kind, dtype, tuple(shape)), shared=fld["shared"])
    col.ensure(part.next_slot)
    col.chunk[rows] = block
    col.offset[rows] = (offset + np.cumsum(sizes) - sizes)[value_of]
    col.nbytes[rows] = nbytes
    col.length[rows] = _array(fld["lengths"])
    arena.hold(block, len(rows))
    arena.release([block])  # the allocation's own reference
