"""Mooncake's Transfer Engine over TCP: a get pulls a unit's bytes straight out of the
unit's registered chunk memory into its own buffer, with no copy on the unit's side and
nothing through Ray's object store (``dataplane_server/unit/payload.py`` is the unit's
side).

Peer-to-peer handshake (``P2PHANDSHAKE``): no metadata server to run; a peer is named by
its engine's ``ip:port`` (its session). One engine per process, started on first use.
Every field pulled is checked against the CRC-32 the unit stated before the get returns
(Mooncake 0.3.10's TCP path was found to truncate silently, Relax #256): a mismatch is
pulled once more, and a second one raises ``CorruptPayload``. Each destination buffer is
registered with the engine for its transfer only and unregistered after, counted
(:func:`counters`), so a test sees that nothing stays registered.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import zlib
from typing import Any

import numpy as np

from dataplane_client.transport.payload.base import MOONCAKE_TCP, PayloadBackend
from dataplane_client.wire import failpoints
from dataplane_client.wire.encoded import EncodedField
from dataplane_client.wire.errors import CorruptPayload, PayloadTransferFailed
from dataplane_client.wire.messages import PayloadOffer, RemoteRows, read_request

log = logging.getLogger(__name__)

_lock = threading.Lock()
_engine: Any = None
_engine_error: str | None = None
_counts = {
    "registered": 0,  # destination buffers registered with the engine
    "unregistered": 0,  # ... and unregistered again (equal once no get is pulling)
    "register_failures": 0,
    "pulled_bytes": 0,
    "corrupt": 0,  # pulls whose CRC-32 did not match (each pulled again once)
    "corrupt_raised": 0,  # fields that mismatched twice: CorruptPayload
    "transfer_failures": 0,
}


def quiet_engine_logs() -> None:
    """Mooncake logs through glog to stderr, INFO up, from its first import: a line per
    engine start, connection and segment, and a spurious error ("Local segment descriptor
    not found") at every start. Only FATAL unless the process set ``GLOG_minloglevel``
    itself: our own errors name the engine's return codes."""
    os.environ.setdefault("GLOG_minloglevel", "3")


def counters() -> dict[str, int]:
    """This process's transfer-engine figures (tests, benchmarks)."""
    with _lock:
        return dict(_counts)


def _count(name: str, n: int = 1) -> None:
    with _lock:
        _counts[name] += n


def engine(host: str) -> Any:
    """This process's engine (started on first call); RuntimeError saying why when there
    is none (the package or its libibverbs missing, or the engine would not start): the
    reason is kept, so a process tries once."""
    global _engine, _engine_error
    with _lock:
        if _engine is not None:
            return _engine
        if _engine_error is not None:
            raise RuntimeError(_engine_error)
        try:
            quiet_engine_logs()
            from mooncake.engine import TransferEngine

            e = TransferEngine()
            rc = e.initialize(host, "P2PHANDSHAKE", "tcp", "")
            if rc != 0:
                raise RuntimeError(f"TransferEngine.initialize({host!r}, tcp) returned {rc}")
        except Exception as exc:  # noqa: BLE001 - ImportError, OSError (libibverbs), engine errors
            _engine_error = f"Mooncake unavailable in this process: {type(exc).__name__}: {exc}"
            raise RuntimeError(_engine_error) from None
        _engine = e
        return e


class _Registered:
    """A buffer registered with the engine for one transfer (unregistered on exit)."""

    def __init__(self, eng: Any, buf: np.ndarray):
        self.eng, self.addr, self.nbytes = eng, buf.ctypes.data, buf.nbytes

    def __enter__(self) -> _Registered:
        rc = self.eng.register_memory(self.addr, self.nbytes)
        if rc != 0:
            _count("register_failures")
            raise PayloadTransferFailed(
                f"Mooncake register_memory of a {self.nbytes}-byte destination returned {rc}"
            )
        _count("registered")
        return self

    def __exit__(self, *exc: object) -> None:
        self.eng.unregister_memory(self.addr)
        _count("unregistered")


def probe(offer: PayloadOffer, host: str) -> str | None:
    """None when this process can pull from the unit that made ``offer`` (its probe bytes
    arrive, CRC-32 checked), else why not."""
    try:
        eng = engine(host)
    except RuntimeError as e:
        return str(e)
    assert offer.probe is not None
    addr, nbytes, crc = offer.probe
    buf = np.zeros(nbytes, dtype=np.uint8)
    try:
        with _Registered(eng, buf):
            rc = eng.transfer_sync_read(offer.session, buf.ctypes.data, addr, nbytes)
    except PayloadTransferFailed as e:
        return str(e)
    if rc != 0:
        return f"the unit's engine at {offer.session} is not reachable (transfer returned {rc})"
    if zlib.crc32(buf.data) != crc:
        return f"the probe bytes from {offer.session} arrived altered (CRC-32 mismatch)"
    return None


class MooncakeTcp(PayloadBackend):
    """Pulls from one unit's engine (``session``: its ``ip:port``)."""

    name = MOONCAKE_TCP

    def __init__(self, unit_index: int, session: str, host: str):
        self.unit_index, self.session, self.host = unit_index, session, host

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
            eng = engine(self.host)
            return {
                name: part
                if not isinstance(part, RemoteRows)
                else dataclasses.replace(part.header, values=self._pull(eng, name, part))
                for name, part in answer.items()
            }
        finally:
            try:
                unit.release_remote.remote(sorted(leases))
            except Exception:  # noqa: BLE001 - Ray shut down or the unit is gone: nothing to release
                pass

    def _pull(self, eng: Any, name: str, rows: RemoteRows) -> np.ndarray:
        out = np.empty(rows.nbytes, dtype=np.uint8)
        segments = [(a, n) for a, n in rows.segments if n > 0]
        if not segments:
            return out
        dests, pos = [], out.ctypes.data
        for _, n in segments:
            dests.append(pos)
            pos += n
        srcs, lengths = [a for a, _ in segments], [n for _, n in segments]
        with _Registered(eng, out):
            for attempt in (1, 2):
                if len(segments) == 1:
                    rc = eng.transfer_sync_read(self.session, dests[0], srcs[0], lengths[0])
                else:
                    rc = eng.batch_transfer_sync_read(self.session, dests, srcs, lengths)
                if rc != 0:
                    _count("transfer_failures")
                    raise PayloadTransferFailed(
                        f"unit {self.unit_index}: pulling field {name!r} ({rows.nbytes} bytes) "
                        f"from {self.session} failed (transfer returned {rc})",
                        fields=[name],
                    )
                _count("pulled_bytes", rows.nbytes)
                if failpoints.countdown_if_armed(failpoints.PAYLOAD_CORRUPT):
                    out[-1] ^= 0xFF  # what a truncated or corrupted transfer leaves
                got = zlib.crc32(out.data)
                if got == rows.crc32:
                    return out
                _count("corrupt")
                log.warning(
                    "unit %d: field %r pulled from %s has CRC-32 %#x, the unit stated %#x "
                    "(attempt %d of 2)",
                    self.unit_index,
                    name,
                    self.session,
                    got,
                    rows.crc32,
                    attempt,
                )
        _count("corrupt_raised")
        raise CorruptPayload(
            f"unit {self.unit_index}: field {name!r} ({rows.nbytes} bytes) pulled from "
            f"{self.session} did not match the unit's CRC-32 {rows.crc32:#x}, twice",
            fields=[name],
        )
