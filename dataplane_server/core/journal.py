"""The controller's journal: what only the controller knows, kept on its node's disk.

The storage units are the ground truth for stored samples; the controller alone
knows partition declarations, consumption cursors and leases. Each change to
those is appended here as one msgpack record before the call that made it
returns (a commit appends nothing: its metadata rides to the units with the
bytes). Records are written to the OS at once (``flush``), so they survive the
controller's process; ``fsync_every_record`` also makes them survive the machine,
at a price (see RELIABILITY.md). Every ``compact_every`` records the whole state
is written as a snapshot (temporary name, then rename) and a new log starts, so
replay stays short and the directory bounded.

Layout: ``snapshot.msgpack`` = {"generation": g, "partitions": state}; ``log.<g>``
holds the records appended since. A torn last record (a crash mid-append) is
ignored.

Sample ids are reused (a trainer puts ``a..d`` again after clearing them), so a
record must never apply to a sample put after it: every removal of samples (a
clear, a drop, an eviction, a retired version) is a record, and replay folds
records in order, so a claim of the old ``a`` is forgotten by the clear that
follows it. A removal also names each sample's birth (the sequence number of the
commit that created it): a controller that died before the units freed the bytes
finds them again when it rebuilds, and drops exactly those, never a newer sample
of the same id (``recovery.rebuild``).
"""

from __future__ import annotations

import collections
import errno
import io
import os
from typing import Any

import msgpack

from dataplane_client.wire import failpoints
from dataplane_server.core import group_deadline, staleness_journal, steps
from dataplane_server.core.claim_answers import ClaimAnswer, ClaimAnswers

SNAPSHOT = "snapshot.msgpack"


def _write_atomically(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Journal:
    def __init__(self, directory: str, compact_every: int = 20_000, fsync: bool = False):
        self.directory = directory
        self.compact_every = compact_every
        self.fsync = fsync
        os.makedirs(directory, exist_ok=True)
        self.generation = 0
        self.records = 0
        self._log: io.BufferedWriter | None = None  # the open log, from the first write

    # ---- reading ------------------------------------------------------------------
    def load(self) -> dict[str, dict]:
        """Partition id -> {"declaration": dict, "tasks": {task: consumption state}}."""
        path = os.path.join(self.directory, SNAPSHOT)
        state: dict[str, dict] = {}
        if os.path.exists(path):
            with open(path, "rb") as f:
                snap = msgpack.unpackb(f.read(), raw=False)
            self.generation = snap["generation"]
            state = {pid: _internal(p) for pid, p in snap["partitions"].items()}
        log = self._log_path(self.generation)
        if os.path.exists(log):
            with open(log, "rb") as f:
                unpacker = msgpack.Unpacker(f, raw=False)
                try:
                    for record in unpacker:
                        _replay(state, record)
                except (msgpack.exceptions.ExtraData, ValueError):
                    pass  # a torn last record: the call that wrote it never returned
        return {pid: _external(p) for pid, p in state.items()}

    # ---- writing ------------------------------------------------------------------
    @staticmethod
    def pack(*record: Any) -> bytes:
        """A record's bytes; raises (ValueError, TypeError) for what msgpack cannot hold,
        before anything is written."""
        return msgpack.packb(list(record), use_bin_type=True)

    def append(self, *record: Any) -> None:
        self.write(self.pack(*record))

    def write(self, packed: bytes) -> None:
        """Append a packed record, or raise OSError with the log as it was: a record half
        written (a full disk) is cut off again, so the records after it still replay."""
        log = self._log
        if log is None:
            log = self._log = open(self._log_path(self.generation), "ab")  # noqa: SIM115 - held open
        end = log.tell()
        try:
            failpoints.fail_if_armed(
                failpoints.JOURNAL_WRITE, OSError(errno.ENOSPC, "No space left on device")
            )
            log.write(packed)
            log.flush()
            if self.fsync:
                os.fsync(log.fileno())
        except OSError:
            self._cut_back(end)
            raise
        self.records += 1

    def _cut_back(self, end: int) -> None:
        assert self._log is not None
        log, self._log = self._log, None
        try:
            log.close()  # drops whatever the failed write left buffered
        except OSError:
            pass
        with open(self._log_path(self.generation), "r+b") as f:
            f.truncate(end)

    def due(self) -> bool:
        return self.records >= self.compact_every

    def compact(self, partitions: dict[str, dict]) -> None:
        """Replace snapshot and log by ``partitions`` (the current state)."""
        old = self.generation
        self.generation += 1
        snap = {"generation": self.generation, "partitions": partitions}
        _write_atomically(
            os.path.join(self.directory, SNAPSHOT), msgpack.packb(snap, use_bin_type=True)
        )
        if self._log is not None:
            self._log.close()
            self._log = None
        for gen in (old, self.generation):  # a stale log of a crashed compaction, too
            if os.path.exists(self._log_path(gen)):
                os.remove(self._log_path(gen))
        self.records = 0

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def _log_path(self, generation: int) -> str:
        return os.path.join(self.directory, f"log.{generation}")


# ---- replay: records folded into per-task sets, keyed by sample id ----------------------
def _task() -> dict:
    task: dict[str, Any] = {
        "consumed": set(),
        "leases": {},
        "deliveries": collections.Counter(),
        "filtered": set(),
    }
    steps.folded(task)
    return task


def _internal(p: dict) -> dict:
    tasks = {}
    for task, st in p["tasks"].items():
        t = _task()
        t["consumed"].update(st.get("consumed", ()))
        t["leases"].update((sid, (d, h)) for sid, d, h in st.get("leases", ()))
        t["deliveries"].update(dict(st.get("deliveries", ())))
        t["filtered"].update(st.get("filtered", ()))
        t["claimed_at"].update((sid, int(n)) for sid, n in st.get("claimed_at", ()))
        t["steps"] = steps.TaskSteps.restore(st.get("steps"))
        tasks[task] = t
    answers = ClaimAnswers()
    answers.restore(p.get("answers", ()))
    return {
        "declaration": p["declaration"],
        "created_at": p.get("created_at"),
        "tasks": tasks,
        "answers": answers,
        "staleness": staleness_journal.folded(p.get("staleness")),
        "groups": group_deadline.folded(p.get("groups")),
        "removed": {sid: int(born) for sid, born in p.get("removed", ())},
    }


def _external(p: dict) -> dict:
    return {
        "declaration": p["declaration"],
        "created_at": p.get("created_at"),
        "tasks": {
            task: {
                "consumed": sorted(t["consumed"]),
                "leases": [[sid, d, h] for sid, (d, h) in t["leases"].items()],
                "deliveries": [[sid, n] for sid, n in t["deliveries"].items()],
                "filtered": sorted(t["filtered"]),
                "claimed_at": [[sid, n] for sid, n in t["claimed_at"].items()],
                "steps": t["steps"].export(),
            }
            for task, t in p["tasks"].items()
        },
        "answers": p["answers"].export(),
        "staleness": p["staleness"].export(),
        "groups": p["groups"],
        "removed": [[sid, born] for sid, born in p["removed"].items()],
    }


def _forget(part: dict, ids: list, births: list) -> None:
    """Samples removed (cleared, dropped, evicted): what earlier records said of them no
    longer applies, and a copy of them born no later than ``births`` is not theirs to keep."""
    for t in part["tasks"].values():
        for sid in ids:
            t["consumed"].discard(sid)
            t["leases"].pop(sid, None)
            t["deliveries"].pop(sid, None)
            t["filtered"].discard(sid)
            t["claimed_at"].pop(sid, None)
    removed = part["removed"]
    for sid, born in zip(ids, births):
        removed[sid] = max(int(born), removed.get(sid, -1))


def _replay(state: dict, record: list) -> None:
    op, pid, *rest = record
    if op == "register":
        state[pid] = {
            "declaration": rest[0],
            "created_at": None,
            "tasks": {},
            "answers": ClaimAnswers(),
            "staleness": staleness_journal.folded(None),
            "groups": group_deadline.folded(None),
            "removed": {},
        }
        return
    if op == "delete":
        state.pop(pid, None)
        return
    part = state.get(pid)
    if part is None:
        return
    if op == "clear":  # ids, births
        _forget(part, rest[0], rest[1])
        return
    if op == "expired":  # groups dropped at their deadline: how many, ids, births
        group_deadline.replay(part["groups"], rest[0], rest[1])
        _forget(part, rest[1], rest[2])
        return
    if op in staleness_journal.OPS:
        staleness_journal.replay(part["staleness"], op, rest)
        if op == "dropped" and len(rest) > 3:  # ..., ids, births (older journals: neither)
            _forget(part, rest[2], rest[3])
        elif op == "filtered":  # task, ids
            part["tasks"].setdefault(rest[0], _task())["filtered"].update(rest[1])
        return
    task = part["tasks"].setdefault(rest[0], _task())
    if op == "claim":  # task, ids, lease deadline (wall clock) or None, holder, answer
        _, ids, deadline, holder, *answer = rest
        if answer:  # request id, fields, dp rank (absent in journals of older versions)
            request_id, fields, dp_rank = answer
            part["answers"].add(
                request_id, ClaimAnswer(rest[0], ids, fields, holder or None, dp_rank)
            )
        steps.fold_claim(task, ids)
        if deadline is None:
            task["consumed"].update(ids)
        else:
            task["leases"].update(dict.fromkeys(ids, (deadline, holder)))
            task["deliveries"].update(ids)
    elif op == "ack":  # task, ids
        task["consumed"].update(rest[1])
        for sid in rest[1]:
            task["leases"].pop(sid, None)
    elif op == "reset":  # delivery and claim counts survive a reset, as in the key space
        claims = steps.TaskSteps(claims=task["steps"].claims)
        part["tasks"][rest[0]] = {**_task(), "deliveries": task["deliveries"], "steps": claims}
        part["answers"].forget_task(rest[0])
    elif op == "step":  # task, step: the trainer's step-k policy is saved (core/steps.py)
        steps.fold_commit(task, rest[1])
    elif op == "rewind":  # task, step or None: a trainer resumed from that step
        steps.fold_rewind(task, rest[1])
        part["answers"].forget_task(rest[0])
