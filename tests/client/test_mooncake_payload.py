"""The Mooncake backend's pulls against a real peer engine (no Ray, no cluster): a peer
process registers random bytes with its own engine, as a storage unit does, and this
process pulls them through ``Mooncake`` (dataplane_client/transport/payload/mooncake.py).
Bytes identical, a wrong CRC-32C pulled again then ``CorruptPayload``, a dead peer
``PayloadTransferFailed``, the probe's reasons, and every destination buffer back in the
pool (or unregistered) and the read lease given back whatever happened; a second pull of
the same size reuses the pooled buffer (no new registration). One test pushes instead, to a
unit (a Ray actor) that does not confirm the bytes by the put's deadline. Skipped where
Mooncake's engine does not load; under CI=true it must (tests/scenario_run.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from polling import wait_until
from scenario_run import mooncake_loads

from dataplane_client.transport.payload import checksum, mooncake
from dataplane_client.wire import failpoints
from dataplane_client.wire.encoded import DENSE, EncodedField
from dataplane_client.wire.errors import CorruptPayload, PayloadTransferFailed
from dataplane_client.wire.messages import PayloadOffer, RemoteRows

pytestmark = pytest.mark.skipif(not mooncake_loads(), reason="Mooncake's engine does not load")

NBYTES = 3 << 20
PEER = """
import os, sys, zlib
import numpy as np
from dataplane_client.transport.payload import mooncake
mooncake.engine_environment()
from mooncake.engine import TransferEngine
e = TransferEngine()
assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
data = np.frombuffer(os.urandom(int(sys.argv[1])), dtype=np.uint8).copy()
assert e.register_memory(data.ctypes.data, data.nbytes) == 0
print(e.get_rpc_port(), data.ctypes.data, flush=True)
sys.stdout.buffer.write(data.tobytes())
sys.stdout.flush()
sys.stdin.read()  # held until the test closes our stdin (or kills us)
"""


@dataclasses.dataclass
class Peer:
    proc: subprocess.Popen
    session: str
    addr: int
    data: np.ndarray


@pytest.fixture
def peer():
    proc = subprocess.Popen(
        [sys.executable, "-c", PEER, str(NBYTES)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert proc.stdout is not None
    port, addr = proc.stdout.readline().split()
    data = np.frombuffer(proc.stdout.read(NBYTES), dtype=np.uint8)
    yield Peer(proc, f"127.0.0.1:{int(port)}", int(addr), data)
    proc.kill()
    proc.wait(timeout=30)


class _Unit:
    """Stands in for a storage unit's actor handle: records the leases given back."""

    def __init__(self):
        self.released: list[list[int]] = []
        self.release_remote = self

    def remote(self, leases: list[int]) -> None:
        self.released.append(leases)


def _answer(peer: Peer, cuts: list[tuple[int, int]], wrong_crc: bool = False) -> dict:
    """A unit's read_remote answer for one field: rows at the peer's (start, nbytes) cuts,
    back to back, in that order."""
    segments = [(peer.addr + s, n) for s, n in cuts]
    crcs = [checksum.of(peer.data[s : s + n].data) ^ int(wrong_crc) for s, n in cuts]
    nbytes = sum(n for _, n in cuts)
    header = EncodedField(kind=DENSE, dtype="uint8", shape=(nbytes,), num_rows=1)
    return {"x": RemoteRows(header, segments, crcs, lease=7)}


def _balanced(before: dict) -> dict:
    """What changed since ``before``; every registered buffer is unregistered or idle in
    the pool (none is lent: the caller dropped what the pulls returned)."""
    after = mooncake.counters()
    assert after["registered"] - after["unregistered"] == after["pooled"], after
    return {k: after[k] - before[k] for k in after}


def test_a_pull_of_scattered_segments_returns_the_peers_bytes(peer):
    cuts = [(NBYTES // 2, 1 << 20), (0, 4096), (5000, 123_457), (NBYTES - 10, 10)]
    unit, before = _Unit(), mooncake.counters()
    got = mooncake.Mooncake(0, peer.session, "127.0.0.1").complete(unit, _answer(peer, cuts))
    want = np.concatenate([peer.data[s : s + n] for s, n in cuts])
    assert np.array_equal(got["x"].values, want)
    assert unit.released == [[7]]
    lent = mooncake.counters()
    assert lent["registered"] - lent["unregistered"] == lent["pooled"] + 1, "one buffer lent"
    del got  # the caller drops its arrays: the buffer goes back to the pool
    delta = _balanced(before)
    assert delta["pulled_bytes"] == want.nbytes
    assert delta["corrupt"] == 0


def test_a_crc_that_never_matches_is_pulled_twice_then_corrupt_payload(peer):
    unit, before = _Unit(), mooncake.counters()
    backend = mooncake.Mooncake(3, peer.session, "127.0.0.1")
    with pytest.raises(CorruptPayload, match=r"unit 3: 1 segment\(s\) of field\(s\) 'x'") as e:
        backend.complete(unit, _answer(peer, [(0, NBYTES)], wrong_crc=True))
    assert e.value.fields == ["x"]
    assert unit.released == [[7]], "the lease goes back even when the get fails"
    delta = _balanced(before)
    assert delta["corrupt"] == 2
    assert delta["corrupt_raised"] == 1


def test_a_dead_peer_is_payload_transfer_failed_and_leaks_nothing(peer):
    peer.proc.kill()
    peer.proc.wait(timeout=30)
    unit, before = _Unit(), mooncake.counters()
    backend = mooncake.Mooncake(1, peer.session, "127.0.0.1")
    with pytest.raises(PayloadTransferFailed, match=r"unit 1: pulling 4096 bytes of 'x' from"):
        backend.complete(unit, _answer(peer, [(0, 4096)]))
    assert unit.released == [[7]]
    assert _balanced(before)["transfer_failures"] == 1


def test_the_probe_says_why_a_peer_cannot_be_used(peer):
    good = (peer.addr, 4096, checksum.of(peer.data[:4096].data))
    offer = PayloadOffer("mooncake-tcp", session=peer.session, probe=good)
    assert mooncake.probe(offer, "127.0.0.1") is None
    altered = dataclasses.replace(offer, probe=(peer.addr, 4096, good[2] ^ 1))
    assert "arrived altered" in (mooncake.probe(altered, "127.0.0.1") or "")
    peer.proc.kill()
    peer.proc.wait(timeout=30)
    assert "is not reachable" in (mooncake.probe(offer, "127.0.0.1") or "")


def test_a_second_get_of_the_same_size_reuses_the_pooled_buffer(peer):
    backend = mooncake.Mooncake(0, peer.session, "127.0.0.1")
    first = backend.complete(_Unit(), _answer(peer, [(0, 1 << 20)]))
    del first
    before = mooncake.counters()
    again = backend.complete(_Unit(), _answer(peer, [(4096, 1 << 20)]))
    assert np.array_equal(again["x"].values, peer.data[4096 : 4096 + (1 << 20)])
    del again
    delta = _balanced(before)
    assert delta["registered"] == 0, "pulled into the pooled buffer, registered once"


def test_a_peer_killed_mid_pull_is_payload_transfer_failed_and_leaks_nothing(peer, monkeypatch):
    # Pulled in 1 MiB slices; the peer process is killed once the first has landed.
    monkeypatch.setattr(mooncake, "PULL_SLICE_BYTES", 1 << 20)
    seen: list[int] = []

    def kill_peer(pulled: int) -> None:
        seen.append(pulled)
        peer.proc.kill()
        peer.proc.wait(timeout=30)

    unit, before = _Unit(), mooncake.counters()
    backend = mooncake.Mooncake(2, peer.session, "127.0.0.1")
    with (
        failpoints.run_at(failpoints.PAYLOAD_PULLED, kill_peer),
        pytest.raises(PayloadTransferFailed, match=r"unit 2: pulling .* of 'x' from"),
    ):
        backend.complete(unit, _answer(peer, [(0, NBYTES)]))
    assert seen == [1 << 20], "killed after the first slice, mid-transfer"
    assert unit.released == [[7]], "the lease goes back"
    delta = _balanced(before)
    assert delta["transfer_failures"] == 1
    assert delta["pulled_bytes"] == 1 << 20
    assert mooncake.counters()["lent"] == 0, "the destination buffer is back in the pool"


def test_a_refused_registration_is_payload_transfer_failed_and_leaks_nothing(peer):
    # Twice the peer's bytes: larger than any buffer pooled by the other tests, so the pull
    # registers a new one, which the engine refuses once.
    cuts = [(0, NBYTES), (0, NBYTES)]
    unit, before = _Unit(), mooncake.counters()
    backend = mooncake.Mooncake(4, peer.session, "127.0.0.1")
    failpoints.arm(failpoints.PAYLOAD_REGISTER, "1")
    try:
        with pytest.raises(PayloadTransferFailed, match=r"register_memory of a get's destination"):
            backend.complete(unit, _answer(peer, cuts))
    finally:
        failpoints.disarm(failpoints.PAYLOAD_REGISTER)
    assert failpoints.fired(failpoints.PAYLOAD_REGISTER) == 1
    assert unit.released == [[7]]
    delta = _balanced(before)
    assert (delta["register_failures"], delta["registered"], delta["pulled_bytes"]) == (1, 0, 0)
    # The engine takes the next registration: the same get goes through.
    got = backend.complete(_Unit(), _answer(peer, cuts))
    assert np.array_equal(got["x"].values, np.concatenate([peer.data, peer.data]))
    del got
    assert _balanced(before)["registered"] == 1


STALLED = """
import json, sys, time
from dataplane_client.transport.payload import mooncake
from dataplane_client.wire.encoded import DENSE, EncodedField
from dataplane_client.wire.messages import RemoteRows
session, addr, n, crc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
header = EncodedField(kind=DENSE, dtype="uint8", shape=(n,), num_rows=1)
answer = {"x": RemoteRows(header, [(addr, n)], [0], lease=7)}
class Unit:
    def __init__(self):
        self.release_remote, self.released = self, []
    def remote(self, leases):
        self.released.append(leases)
backend = mooncake.Mooncake(5, session, "127.0.0.1")
backend.complete(Unit(), {"x": RemoteRows(header, [(addr, n)], [crc], lease=6)})
print("connected", flush=True)  # the test stops the peer now, then tells us to go on
sys.stdin.readline()
unit, t0 = Unit(), time.monotonic()
try:
    backend.complete(unit, answer)
    error = None
except Exception as e:
    error = f"{type(e).__name__}: {e}"
print(json.dumps({"error": error, "s": time.monotonic() - t0, "released": unit.released,
                  "counters": mooncake.counters()}))
"""


def test_a_stalled_peer_fails_the_pull_after_the_engines_progress_timeout(peer):
    # A peer that stops answering (SIGSTOP) after its first pull: the next fails typed once
    # the engine sees no progress for MC_TCP_PROGRESS_TIMEOUT_SEC (2 s here, 30 s by
    # default), in a process of its own (the setting is read as its engine starts).
    env = {**os.environ, "MC_TCP_PROGRESS_TIMEOUT_SEC": "2"}
    args = [peer.session, str(peer.addr), str(NBYTES), str(checksum.of(peer.data.data))]
    child = subprocess.Popen(
        [sys.executable, "-c", STALLED, *args],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None
    assert child.stdout is not None
    try:
        assert child.stdout.readline().strip() == "connected"
        peer.proc.send_signal(signal.SIGSTOP)
        child.stdin.write("go\n")
        child.stdin.flush()
        last = child.stdout.readlines()[-1]
        child.wait(timeout=60)
    finally:
        peer.proc.send_signal(signal.SIGCONT)
        child.kill()
    out = json.loads(last)
    assert out["error"].startswith("PayloadTransferFailed: unit 5: pulling"), out
    assert 1.5 < out["s"] < 30, out
    assert out["released"] == [[7]]
    c = out["counters"]
    assert (c["transfer_failures"], c["lent"]) == (1, 0), c
    assert c["registered"] - c["unregistered"] == c["pooled"], c


def test_a_push_the_unit_does_not_confirm_by_the_deadline_fails_typed_and_leaks_nothing(
    peer, ray_session
):
    """A timeout after the remote write: the bytes reached the unit's region, but its check
    (``verify_remote``) does not answer before the put's deadline. The push raises
    ``PayloadTransferFailed`` (the bytes' fate unknown, so nothing may be committed: the
    put discards that stage and stages again through Ray), counted, and the buffers it
    registered to push from are unregistered."""
    import ray

    @ray.remote(max_concurrency=2)
    class UnconfirmingUnit:
        """A unit whose check of pushed bytes answers only once the test lets it."""

        def __init__(self):
            import threading

            self.go, self.asked = threading.Event(), 0

        def verify_remote(self, write_id, crcs):
            self.asked += 1
            self.go.wait(120)

        def let_go(self):
            self.go.set()

        def checks(self):
            return self.asked

    unit = UnconfirmingUnit.remote()
    assert ray.get(unit.checks.remote()) == 0  # started: the deadline is not spent starting it
    values = {"x": np.arange(1 << 20, dtype=np.uint8)}  # 1 MiB, into the peer's first MiB
    before = mooncake.counters()
    push = mooncake.MooncakePush(mooncake.Mooncake(6, peer.session, "127.0.0.1"))
    # Waited until the put's deadline (1 s away), not VERIFY_TIMEOUT_S (for puts without one).
    late = r"did not confirm .* within [01]\.\ds \(the put's deadline\): nothing committed"
    with pytest.raises(PayloadTransferFailed, match=late):
        push.push(unit, "w-late", values, {"x": (peer.addr, 1 << 20)}, expires_at=time.time() + 1)
    ray.get(unit.let_go.remote())
    wait_until(lambda: ray.get(unit.checks.remote()) == 1, timeout_s=60, what="the late check")
    delta = _balanced(before)
    assert delta["transfer_failures"] == 1
    assert delta["pushed_bytes"] == 1 << 20, "the bytes were written before the wait"
    assert delta["registered"] == delta["unregistered"] == 1, "the source, registered then not"
    ray.kill(unit)


class _Topology:
    """An engine as far as ``transport_of`` reads one: its topology, as Mooncake prints it."""

    def __init__(self, text: str):
        self.text = text

    def get_local_topology(self) -> str:
        return self.text


def test_the_transport_is_read_from_the_engines_own_discovery(monkeypatch):
    """Mooncake's engine installs RDMA wherever it found a device with an active port (its
    topology lists it), else TCP, whatever protocol ``initialize`` was given: the path is
    named for what the engine chose. ``MC_FORCE_TCP`` (cross_node_transport 'tcp') wins."""
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    with_nics = '{"cpu:0": [["mlx5_1"], ["mlx5_0", "mlx5_1"]], "cuda:0": [["mlx5_1"], []]}'
    assert mooncake.transport_of(_Topology(with_nics)) == ("rdma", ("mlx5_0", "mlx5_1"))
    assert mooncake.transport_of(_Topology('{"cpu:0": [[], []]}')) == ("tcp", ())
    assert mooncake.transport_of(_Topology("not json")) == ("tcp", ())
    assert mooncake.backend_name("rdma") == "mooncake-rdma"
    # This machine has no RDMA device: its engine, really started, moves bytes over TCP.
    assert mooncake.transport("127.0.0.1") == ("tcp", ())
    monkeypatch.setenv("MC_FORCE_TCP", "1")
    assert mooncake.transport_of(_Topology(with_nics)) == ("tcp", ())


def test_the_probe_refuses_a_unit_whose_engine_moves_bytes_over_another_transport(peer):
    """A unit whose engine found an RDMA device cannot be reached by an engine on TCP (and
    the other way round): the probe says so, naming the setting that makes both TCP,
    without trying a transfer that cannot work."""
    good = (peer.addr, 4096, checksum.of(peer.data[:4096].data))
    rdma = PayloadOffer("mooncake-rdma", session=peer.session, probe=good, devices=("mlx5_0",))
    before = mooncake.counters()
    why = mooncake.probe(rdma, "127.0.0.1") or ""
    assert "the unit's engine moves bytes over RDMA" in why, why
    assert "this process's over TCP (no RDMA device)" in why, why
    assert "cross_node_transport 'tcp'" in why, why
    assert mooncake.counters()["registered"] == before["registered"], "no transfer was tried"
