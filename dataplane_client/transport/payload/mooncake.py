"""Mooncake's Transfer Engine (RDMA where it finds a device, else TCP): a get pulls a
unit's bytes straight out of the unit's registered chunk memory into its own buffer, with
no copy on the unit's side and nothing through Ray's object store
(``dataplane_server/unit/payload.py`` is the unit's side).

Peer-to-peer handshake (``P2PHANDSHAKE``): no metadata server to run; a peer is named by
its engine's ``ip:port`` (its session). One engine per process, started on first use.

What the engine moves bytes over is its own choice, made as it starts: it discovers the
machine's RDMA devices with an active port and installs its RDMA transport, alone, when
it finds one, else its TCP transport (Mooncake's ``transfer_engine_impl.cpp``; the
``protocol`` argument of ``initialize`` does not choose it outside EFA builds, and
``MC_FORCE_TCP`` keeps it on TCP). :func:`transport` reads that choice back, so the
path is named for what it is (``mooncake-rdma`` or ``mooncake-tcp``); two engines that
chose differently cannot reach each other, and the probe says so rather than trying.
A get's segments (runs of rows back to back in one chunk) are pulled in one batch of
transfers, and each is checked against the CRC-32C the unit stated before the get returns
(Mooncake 0.3.10's TCP path was found to truncate silently, Relax #256): a mismatch is
pulled once more, and a second one raises ``CorruptPayload``. A get pulls into one
buffer from a pool of registered ones (:class:`_Pool`), lent until the caller drops its
tensors; registrations are counted (:func:`counters`: registered minus unregistered is
always the pool's buffers), so a test sees that nothing else stays registered.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import threading
import time
import traceback
from typing import Any

import numpy as np
import ray

from dataplane_client.transport.payload import checksum
from dataplane_client.transport.payload.base import (
    MOONCAKE_RDMA,
    MOONCAKE_TCP,
    PayloadBackend,
)
from dataplane_client.wire import failpoints
from dataplane_client.wire.encoded import EncodedField
from dataplane_client.wire.errors import CorruptPayload, PayloadTransferFailed
from dataplane_client.wire.messages import PayloadOffer, RemoteRows, read_request

log = logging.getLogger(__name__)

_lock = threading.Lock()
_engine: Any = None
_engine_error: str | None = None
_transport: tuple[str, tuple[str, ...]] | None = None  # what this process's engine moves bytes over
_counts = {
    "registered": 0,  # buffers registered with the engine (a pull's, a push's sources)
    "unregistered": 0,  # ... and unregistered again (the difference: the pool's buffers)
    "register_failures": 0,
    "pooled": 0,  # destination buffers idle in the pool, registered (see _Pool)
    "lent": 0,  # pooled buffers a get's arrays still hold (0 once the caller drops them)
    "pulled_bytes": 0,
    "pushed_bytes": 0,
    "corrupt": 0,  # pulls whose CRC-32C did not match (each pulled again once)
    "corrupt_raised": 0,  # fields that mismatched twice: CorruptPayload
    "transfer_failures": 0,
}


# Mooncake's TCP transport moves a transfer in slices of MC_TCP_SLICE_SIZE; with its
# default a 128 MiB pull on loopback ran at 0.2-0.7 GB/s here, with 16 MiB at 1.5-2.4 GB/s
# (2 loaded cores, 2026-11-29). A process that sets it keeps its own.
TCP_SLICE_BYTES = 16 << 20
# A pull is asked of the engine in batches of at most this many bytes (one more round trip
# per 64 MiB; the engine's own slicing above does the moving): a peer that fails stops the
# pull at the batch it hit, and tests get a point between batches (PAYLOAD_PULLED).
PULL_SLICE_BYTES = 64 << 20
VERIFY_TIMEOUT_S = 60.0  # a push's wait for the unit's check, for a put without deadline


def engine_environment(mode: str = "auto") -> None:
    """Set what Mooncake reads from the environment, before it is first imported (unless the
    process set it itself): the TCP slice size above, and its logs. It logs to stderr from
    INFO up: a dozen lines per engine start, and one per connection and segment; errors
    only here (``MC_LOG_LEVEL``; glog's own ``GLOG_minloglevel`` is not honoured before
    Mooncake initialises glog). One spurious error line ("Local segment descriptor not
    found") stays at each engine's start.

    A transfer that makes no progress fails after ``MC_TCP_PROGRESS_TIMEOUT_SEC`` (30 s by
    default; checked here: a stopped peer, -1 after 30.0 s; a dead one, -1 at once), so a
    pull never hangs a get for longer.

    ``mode`` (the service's ``cross_node_transport``): "tcp" keeps the engine on TCP even
    where the machine has an RDMA device (``MC_FORCE_TCP``), for clusters where some
    nodes have none; "auto" lets it choose."""
    os.environ.setdefault("MC_TCP_SLICE_SIZE", str(TCP_SLICE_BYTES))
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    if mode == "tcp":
        os.environ["MC_FORCE_TCP"] = "1"


def transport_of(eng: Any) -> tuple[str, tuple[str, ...]]:
    """What a started engine moves bytes over: ("rdma", its devices) when it found RDMA
    devices with an active port (and TCP is not forced), else ("tcp", ()). Read from the
    engine's own topology (``get_local_topology``: per CPU or GPU, the devices it
    prefers and may use), the discovery its start made."""
    if os.environ.get("MC_FORCE_TCP"):
        return "tcp", ()
    try:
        topology = json.loads(eng.get_local_topology())
        devices = {name for lists in topology.values() for group in lists for name in group}
    except (ValueError, TypeError, AttributeError, RuntimeError) as e:
        log.warning("cannot read Mooncake's topology (%s): taken as TCP", e)
        return "tcp", ()
    return ("rdma", tuple(sorted(devices))) if devices else ("tcp", ())


def backend_name(protocol: str) -> str:
    return MOONCAKE_RDMA if protocol == "rdma" else MOONCAKE_TCP


def transport(host: str, mode: str = "auto") -> tuple[str, tuple[str, ...]]:
    """What this process's engine moves bytes over (the engine started if need be)."""
    engine(host, mode)
    assert _transport is not None  # set with the engine
    return _transport


def counters() -> dict[str, int]:
    """This process's transfer-engine figures (tests, benchmarks)."""
    with _lock:
        return dict(_counts)


def _count(name: str, n: int = 1) -> None:
    with _lock:
        _counts[name] += n


def register(eng: Any, addr: int, nbytes: int, what: str) -> None:
    """Register ``nbytes`` at ``addr`` with the engine (counted), or PayloadTransferFailed
    naming ``what`` and the engine's code (counted too; nothing stays registered)."""
    if failpoints.countdown_if_armed(failpoints.PAYLOAD_REGISTER):
        rc = -1  # as the engine answers when it cannot pin the memory
    else:
        rc = eng.register_memory(addr, nbytes)
    if rc != 0:
        _count("register_failures")
        raise PayloadTransferFailed(
            f"Mooncake register_memory of {what} ({nbytes} bytes) returned {rc}"
        )
    _count("registered")


def start_engine(host: str, mode: str = "auto") -> Any:
    """A new engine on ``host`` with the peer-to-peer handshake (no metadata server to run);
    ImportError when the package (or the libibverbs it links) is missing, RuntimeError when
    it would not start. The protocol passed is a formality: the engine picks its transport
    (the module's docstring)."""
    engine_environment(mode)
    from mooncake.engine import TransferEngine

    e = TransferEngine()
    rc = e.initialize(host, "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"Mooncake TransferEngine.initialize({host!r}) returned {rc}")
    return e


def engine(host: str, mode: str = "auto") -> Any:
    """This process's engine (started on first call, ``mode`` as ``engine_environment``
    takes it); RuntimeError saying why when there is none (the package or its libibverbs
    missing, or the engine would not start): the reason is kept, so a process tries once."""
    global _engine, _engine_error, _transport
    with _lock:
        if _engine is not None:
            return _engine
        if _engine_error is not None:
            raise RuntimeError(_engine_error)
        try:
            e = start_engine(host, mode)
            _transport = transport_of(e)
        except Exception as exc:  # noqa: BLE001 - ImportError, OSError (libibverbs), engine errors
            _engine_error = f"Mooncake unavailable in this process: {type(exc).__name__}: {exc}"
            raise RuntimeError(_engine_error) from None
        _engine = e
        return e


class _Lent:
    """One get's use of a pooled buffer: the base of every array made of it, it gives the
    buffer back to the pool once they are all gone (the caller dropped its tensors)."""

    def __init__(self, pool: _Pool, buf: np.ndarray):
        self.pool, self.buf = pool, buf
        self.__array_interface__ = buf.__array_interface__

    def __del__(self) -> None:
        self.pool.give_back(self.buf)


class _Pool:
    """Destination buffers registered with the engine once and kept for later pulls.

    A fresh buffer per pull made the engine fault in and register new memory on every
    get, and those gets were the slow half of a bimodal spread (0.3-0.85 s against
    0.10-0.16 s for 128 MiB, 2 loaded cores); a steady reader now pulls into memory that
    is registered and faulted in already. A buffer is lent to one get (its arrays hold a
    :class:`_Lent`) and comes back when the caller drops them; idle buffers beyond
    ``KEEP_BYTES`` are unregistered and freed. ``counters()``: ``registered`` minus
    ``unregistered`` is always the pool's buffers, lent or ``pooled`` (idle).
    """

    KEEP_BYTES = 1 << 30
    ROUND = 1 << 20  # sizes rounded up to whole MiB, so similar gets share buffers

    def __init__(self) -> None:
        self._free: list[np.ndarray] = []
        self._free_bytes = 0
        self._eng: Any = None

    def take(self, eng: Any, nbytes: int) -> np.ndarray:
        """A registered buffer of at least ``nbytes`` (at most twice that, plus a MiB)."""
        with _lock:
            fits = [
                i for i, b in enumerate(self._free) if nbytes <= b.nbytes <= 2 * nbytes + self.ROUND
            ]
            if fits:  # the smallest that fits (by position: arrays do not compare as items)
                buf = self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))
                self._free_bytes -= buf.nbytes
                _counts["pooled"] -= 1
                return buf
        size = -(-max(nbytes, 1) // self.ROUND) * self.ROUND
        buf = np.empty(size, dtype=np.uint8)
        register(eng, buf.ctypes.data, buf.nbytes, "a get's destination buffer")
        self._eng = eng
        return buf

    def lend(self, buf: np.ndarray) -> np.ndarray:
        """``buf`` as an array whose views give it back once they are all gone."""
        _count("lent")
        return np.asarray(_Lent(self, buf))

    def give_back(self, buf: np.ndarray) -> None:
        with _lock:
            _counts["lent"] -= 1
            if self._free_bytes + buf.nbytes <= self.KEEP_BYTES:
                self._free.append(buf)
                self._free_bytes += buf.nbytes
                _counts["pooled"] += 1
                return
        self._eng.unregister_memory(buf.ctypes.data)
        _count("unregistered")


_pool = _Pool()


class _Registered:
    """A buffer registered with the engine for one transfer (unregistered on exit)."""

    def __init__(self, eng: Any, buf: np.ndarray, what: str):
        self.eng, self.addr, self.nbytes, self.what = eng, buf.ctypes.data, buf.nbytes, what

    def __enter__(self) -> _Registered:
        register(self.eng, self.addr, self.nbytes, self.what)
        return self

    def __exit__(self, *exc: object) -> None:
        self.eng.unregister_memory(self.addr)
        _count("unregistered")


def probe(offer: PayloadOffer, host: str, mode: str = "auto") -> str | None:
    """None when this process can pull from the unit that made ``offer`` (both engines move
    bytes over the same transport, and its probe bytes arrive, CRC-32C checked), else why
    not."""
    why_not = checksum.missing()
    if why_not is not None:
        return f"this process cannot check what it pulls: {why_not}"
    try:
        eng = engine(host, mode)
    except RuntimeError as e:
        return str(e)
    mine, devices = transport(host, mode)
    if backend_name(mine) != offer.backend:
        theirs = "RDMA" if offer.backend == MOONCAKE_RDMA else "TCP"
        here = f"RDMA ({', '.join(devices)})" if mine == "rdma" else "TCP (no RDMA device)"
        return (
            f"the unit's engine moves bytes over {theirs}, this process's over {here}: "
            "Mooncake's engine takes RDMA wherever it finds a device; cross_node_transport "
            "'tcp' keeps every engine of the service on TCP"
        )
    assert offer.probe is not None
    addr, nbytes, crc = offer.probe
    buf = np.zeros(nbytes, dtype=np.uint8)
    try:
        with _Registered(eng, buf, "the probe's destination"):
            rc = eng.transfer_sync_read(offer.session, buf.ctypes.data, addr, nbytes)
    except PayloadTransferFailed as e:
        return str(e)
    if rc != 0:
        return f"the unit's engine at {offer.session} is not reachable (transfer returned {rc})"
    if checksum.of(buf.data) != crc:
        return f"the probe bytes from {offer.session} arrived altered (CRC-32C mismatch)"
    return None


class Mooncake(PayloadBackend):
    """Pulls from one unit's engine (``session``: its ``ip:port``); ``name`` says what the
    two engines move bytes over (``mooncake-tcp`` or ``mooncake-rdma``): the same calls
    either way."""

    def __init__(self, unit_index: int, session: str, host: str, name: str = MOONCAKE_TCP):
        self.unit_index, self.session, self.host, self.name = unit_index, session, host, name

    def read_call(self, unit, partition_id, sample_ids, fields, expect, token):
        return unit.read_remote.remote(
            read_request(partition_id, sample_ids, fields, token, expect, None)
        )

    def needs_completion(self, answer: Any) -> bool:
        return isinstance(answer, dict) and any(isinstance(v, RemoteRows) for v in answer.values())

    def complete(self, unit: Any, answer: dict) -> dict[str, EncodedField]:
        """Pull every field the unit left to pull, check it, then give the lease back
        (always: a failed pull must not keep the unit's chunks)."""
        leases = {v.lease for v in answer.values() if isinstance(v, RemoteRows)}
        try:
            pulled = self._pull(engine(self.host), answer)
            return {
                name: dataclasses.replace(part.header, values=pulled[name])
                if isinstance(part, RemoteRows)
                else part
                for name, part in answer.items()
            }
        finally:
            try:
                unit.release_remote.remote(sorted(leases))
            except Exception:  # noqa: BLE001 - Ray shut down or the unit is gone: nothing to release
                pass

    def _pull(self, eng: Any, answer: dict) -> dict[str, np.ndarray]:
        """Every segment of every field to pull in one batch of transfers (the engine runs
        them together), each checked against its CRC-32C; the ones that do not match are
        pulled once more, and any still wrong raise CorruptPayload."""
        fields = {k: v for k, v in answer.items() if isinstance(v, RemoteRows)}
        # One pooled buffer for the whole get, each field a slice of it (lent: it goes back
        # to the pool when the caller's last tensor of this get is gone).
        whole = _pool.lend(_pool.take(eng, sum(r.nbytes for r in fields.values())))
        try:
            return self._fill(eng, whole, fields)
        except BaseException as e:
            # The error's traceback keeps its frames' locals (the buffer's views) for as long
            # as the caller keeps the error: let go of them now, so the buffer goes back.
            del whole
            traceback.clear_frames(e.__traceback__)
            raise

    def _fill(self, eng: Any, whole: np.ndarray, fields: dict) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        segs: list[tuple[str, int, int, int, int]] = []  # field, dest, src, length, crc
        pos = 0
        for name, rows in fields.items():
            out[name] = whole[pos : pos + rows.nbytes]
            at = whole.ctypes.data + pos
            for (src, n), crc in zip(rows.segments, rows.crc32s):
                if n > 0:
                    segs.append((name, at, src, n, crc))
                at += n
            pos += rows.nbytes
        todo = segs  # into the pooled buffer: registered already
        for attempt in (1, 2):
            self._transfer(eng, todo)
            if failpoints.countdown_if_armed(failpoints.PAYLOAD_CORRUPT) and todo:
                _, dest, _, n, _ = todo[0]  # what a truncated or corrupted transfer leaves
                _as_array(dest + n - 1, 1)[0] ^= 0xFF
            bad = [s for s in todo if checksum.of(_as_array(s[1], s[3]).data) != s[4]]
            if not bad:
                return out
            _count("corrupt", len(bad))
            log.warning(
                "unit %d: %d of %d segments pulled from %s did not match their CRC-32C "
                "(fields %s; attempt %d of 2)",
                self.unit_index,
                len(bad),
                len(todo),
                self.session,
                sorted({s[0] for s in bad}),
                attempt,
            )
            todo = bad
        _count("corrupt_raised")
        names = sorted({s[0] for s in todo})
        crcs = ", ".join(f"{s[4]:#x}" for s in todo[:4])
        raise CorruptPayload(
            f"unit {self.unit_index}: {len(todo)} segment(s) of field(s) "
            f"{', '.join(repr(n) for n in names)} pulled from {self.session} did not match "
            f"the unit's CRC-32C ({crcs}), twice",
            fields=names,
        )

    def _transfer(self, eng: Any, segs: list[tuple[str, int, int, int, int]]) -> None:
        """Pull ``segs`` in slices of at most ``PULL_SLICE_BYTES``, one batch each: a peer
        that dies or stalls fails the slice it hit and no later one is asked for."""
        pulled = 0
        for batch in _slices(segs, PULL_SLICE_BYTES):
            if len(batch) == 1:
                _, dest, src, n, _ = batch[0]
                rc = eng.transfer_sync_read(self.session, dest, src, n)
            else:
                rc = eng.batch_transfer_sync_read(
                    self.session,
                    [s[1] for s in batch],
                    [s[2] for s in batch],
                    [s[3] for s in batch],
                )
            _check_transfer(rc, batch, f"unit {self.unit_index}: pulling", f"from {self.session}")
            n = sum(s[3] for s in batch)
            _count("pulled_bytes", n)
            pulled += n
            failpoints.reached(failpoints.PAYLOAD_PULLED, pulled)


def _slices(segs: list[tuple[str, int, int, int, int]], limit: int):
    """``segs`` cut into batches of at most ``limit`` bytes, in order (a segment longer
    than what is left of a batch is split across batches)."""
    batch: list[tuple[str, int, int, int, int]] = []
    room = limit
    for name, dest, src, n, crc in segs:
        at = 0
        while at < n:
            take = min(n - at, room)
            batch.append((name, dest + at, src + at, take, crc))
            at += take
            room -= take
            if room == 0:
                yield batch
                batch, room = [], limit
    if batch:
        yield batch


def _check_transfer(rc: int, segs: list, doing: str, peer: str) -> None:
    """A batch transfer's return code: anything but 0 is PayloadTransferFailed naming the
    fields, the bytes and the peer (counted)."""
    if rc == 0:
        return
    _count("transfer_failures")
    names = sorted({s[0] for s in segs})
    raise PayloadTransferFailed(
        f"{doing} {sum(s[3] for s in segs)} bytes of {', '.join(repr(n) for n in names)} "
        f"{peer} failed (transfer returned {rc})",
        fields=names,
    )


class MooncakePush:
    """A cross-node put's stage on one unit through the engine: the unit sets the region
    aside (``alloc_remote``), this process pushes each field's bytes into it
    (``transfer_sync_write``) and the unit checks them against the CRC-32C this process
    computed of what it sent (``verify_remote``), before any commit: a mismatch is pushed
    once more, then CorruptPayload. The commit, the only visibility point, is sent only
    after that, so a push that failed, timed out or was corrupted is never half applied:
    its stage is discarded (or reclaimed at its deadline), invisible.

    A timeout after the remote write (the engine reports failure, or the unit does not
    confirm the bytes before the put's deadline) means exactly that: the bytes may sit in
    the staged region, but this push raises PayloadTransferFailed, no commit is sent and
    the stage is discarded; the put stages again through Ray under a new write id (while
    its deadline lasts), so it lands once or not at all."""

    def __init__(self, backend: Mooncake):
        self.backend = backend

    def push(
        self,
        unit: Any,
        write_id: str,
        values: dict[str, np.ndarray],
        regions: dict,
        expires_at: float | None = None,
    ) -> int:
        """``expires_at``: the put's deadline (``time.time()``); the unit's check of the bytes
        is awaited until then (``VERIFY_TIMEOUT_S`` without one)."""
        b = self.backend
        eng = engine(b.host)
        srcs = {k: np.ascontiguousarray(v).reshape(-1).view(np.uint8) for k, v in values.items()}
        for name, (_, n) in regions.items():
            if srcs[name].nbytes != n:
                raise CorruptPayload(
                    f"unit {b.unit_index}: field {name!r} has {srcs[name].nbytes} bytes to "
                    f"push into a {n}-byte region",
                    fields=[name],
                )
        crcs = {k: checksum.of(v.data) for k, v in srcs.items()}
        todo = [k for k in regions if regions[k][1] > 0]
        with contextlib.ExitStack() as registered:
            for k in todo:
                registered.enter_context(_Registered(eng, srcs[k], f"field {k!r} to push"))
            for attempt in (1, 2):
                segs = [(k, srcs[k].ctypes.data, regions[k][0], regions[k][1], 0) for k in todo]
                self._write(eng, segs)
                stated = dict(crcs)
                if failpoints.countdown_if_armed(failpoints.PAYLOAD_CORRUPT) and todo:
                    stated[todo[0]] ^= 1  # as if the bytes had changed on the way
                try:
                    self._verified(unit, write_id, stated, expires_at)
                except CorruptPayload as e:
                    _count("corrupt")
                    log.warning("%s (attempt %d of 2)", e, attempt)
                    if attempt == 2:
                        _count("corrupt_raised")
                        raise CorruptPayload(
                            f"unit {b.unit_index}: the bytes pushed to {b.session} for "
                            f"write {write_id} did not match their CRC-32C, twice",
                            fields=e.fields,
                        ) from None
                    continue
                return sum(n for _, (_, n) in regions.items())
        raise AssertionError("unreachable")

    def _verified(self, unit: Any, write_id: str, crcs: dict, expires_at: float | None) -> None:
        """The unit's check of the pushed bytes; PayloadTransferFailed when it does not
        answer in time (the bytes' fate unknown: the put discards the stage and stages
        again through Ray). A unit that died raises RayActorError, as any unit call does
        (the put's rerouting handles it)."""
        b = self.backend
        wait_s = VERIFY_TIMEOUT_S if expires_at is None else max(expires_at - time.time(), 0.0)
        try:
            _wait(unit.verify_remote.remote(write_id, crcs), wait_s)
        except ray.exceptions.GetTimeoutError:
            _count("transfer_failures")
            raise PayloadTransferFailed(
                f"unit {b.unit_index} did not confirm the bytes pushed to {b.session} for "
                f"write {write_id} within {wait_s:.1f}s (the put's deadline): nothing committed"
            ) from None

    def _write(self, eng: Any, segs: list[tuple[str, int, int, int, int]]) -> None:
        b = self.backend
        if not segs:
            return
        rc = eng.batch_transfer_sync_write(
            b.session, [s[1] for s in segs], [s[2] for s in segs], [s[3] for s in segs]
        )
        if rc == 0 and failpoints.countdown_if_armed(failpoints.PAYLOAD_WRITE_FAILED):
            rc = -1  # the bytes landed, yet the engine says the write failed (a late timeout)
        _check_transfer(rc, segs, f"unit {b.unit_index}: pushing", f"to {b.session}")
        _count("pushed_bytes", sum(s[3] for s in segs))


def _wait(ref: Any, timeout_s: float | None = None) -> Any:
    """A unit call's answer, its typed error raised as itself."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, Exception):
            raise cause from None
        raise


def _as_array(addr: int, nbytes: int) -> np.ndarray:
    """The bytes at ``addr`` (inside one of this pull's own buffers) as an array."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))
