"""Faults on a real local Ray: a unit refusing a publish, the controller killed (Ray restarts
it) during writes, during a blocking claim and during a checkpoint, the controller gone for
good, a restart held past the clients' retry budget, a storage unit killed during writes,
a consumer killed holding a leased claim.

Each test asserts what survives bit for bit, exactly which ids are lost, and that
the service keeps serving with typed errors only.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
import time
from pathlib import Path

import crc32c
import pytest
import ray
import torch
from polling import wait_until
from ray_writers import values, writer_class

import dataplane_client.client as client_module
from dataplane_client.wire import failpoints
from dataplane_client.wire.errors import (
    CorruptPayload,
    DataPlaneError,
    SamplesLost,
    SamplesNotFound,
    ServiceUnavailable,
)
from dataplane_client.wire.messages import CommitRequest
from dataplane_server.core import checkpoint

DENSE_F32 = ("dense", "float32", ())


def _values(ids: list[str]) -> torch.Tensor:
    """Each sample's row is a pure function of its id, so any mix-up is visible."""
    return values(ids, 4)


@pytest.fixture
def fresh(service_factory):
    """Services of their own (a fault must not touch the session's), without admin."""
    return functools.partial(service_factory, "faults", admin_enabled=False)


@pytest.mark.parametrize("num_units", [1, 2])
def test_a_typed_publish_refusal_reaches_the_caller_and_no_unit_is_lost(fresh, num_units):
    """A commit of a write the unit never staged (or reclaimed) is the unit's typed
    SamplesNotFound, not SamplesLost, and the unit stays alive."""
    h = fresh(num_storage_units=num_units)
    c = h.client()
    c.register_partition("p", ["x"], None, ["t"])
    units = list(range(num_units))
    request = CommitRequest(
        "p",
        "never-staged",
        [f"s{u}" for u in units],
        units,
        {"x": DENSE_F32},
        None,
        None,
        False,
        units,
    )
    with pytest.raises(SamplesNotFound, match="no staged write") as e:
        ray.get(h.controller.commit.remote(request))
    assert not isinstance(e.value, SamplesLost)
    assert [u.alive for u in c.service_info().units] == [True] * num_units
    c.put_samples(["ok"], "p", {"x": torch.ones(1)})  # the service keeps serving
    assert c.get_samples(["ok"], "p", ["x"])["x"].tolist() == [1.0]


@pytest.mark.slow
def test_controller_killed_during_writes_loses_nothing_committed_and_keeps_cursors(fresh):
    h = fresh(num_storage_units=2)
    c = h.client()
    pid = "p"
    c.register_partition(pid, ["x"], None, ["t", "u"], task_leases={"u": 600.0})
    c.put_samples(["pre-0", "pre-1", "pre-2"], pid, {"x": _values(["pre-0", "pre-1", "pre-2"])})
    first = c.claim_meta(pid, "t", ["x"], 2)
    held = c.claim_meta(pid, "u", ["x"], 1)
    writer = writer_class().remote(h.config.name, h.config.namespace)
    run = writer.write.remote(pid, 60, 8)
    wait_until(lambda: ray.get(writer.progress.remote()) >= 80, 120, "writes under way")
    ray.kill(h.controller, no_restart=False)
    done, untyped = ray.get(run, timeout=300)
    assert untyped == []
    assert len(done) == 480  # every put went through the restart
    everything = ["pre-0", "pre-1", "pre-2", *done]
    got = c.get_samples(everything, pid, ["x"])["x"]
    assert torch.equal(got, _values(everything))  # bit for bit
    info = ray.get(h.controller.metrics_snapshot.remote())
    assert info.stats["counters"].get("controller_restarts_total", 0) >= 1
    # Cursors and leases kept: nothing claimed before comes back.
    rest = c.claim_meta(pid, "t", ["x"], 10_000, blocking=False)
    assert set(rest.sample_ids) == set(everything) - set(first.sample_ids)
    again = c.claim_meta(pid, "u", ["x"], 10_000, blocking=False)
    assert held.sample_ids[0] not in again.sample_ids
    assert c.ack(held) == 1


@pytest.mark.slow
def test_a_blocking_claim_survives_a_controller_restart(fresh):
    h = fresh(num_storage_units=1)
    c = h.client()
    c.register_partition("p", ["x"], None, ["t"])

    @ray.remote
    def claim(name, namespace):
        from dataplane_client.client import connect

        meta = connect(name, namespace).claim_meta("p", "t", ["x"], 2, timeout_s=120)
        return meta.sample_ids

    waiting = claim.remote(h.config.name, h.config.namespace)
    wait_until(
        lambda: ray.get(h.controller.metrics_snapshot.remote()).claims_waiting == 1,
        60,
        "the claim to wait",
    )
    ray.kill(h.controller, no_restart=False)
    c.put_samples(["a", "b"], "p", {"x": _values(["a", "b"])})  # rides through the restart
    assert sorted(ray.get(waiting, timeout=180)) == ["a", "b"]


@pytest.mark.slow
def _put_then_kill_unit_1(h, c, ids: list[str]) -> tuple[list[str], list[str]]:
    """Put ``ids`` over two units, kill unit 1, wait until the service shows it dead;
    returns (ids on unit 0, ids on unit 1), each non-empty."""
    c.put_samples(ids, "p", {"x": _values(ids)})
    units = ray.get(h.controller.lookup_units.remote("p", ids))
    kept = [s for s, u in zip(ids, units) if u == 0]
    on_dead = [s for s, u in zip(ids, units) if u == 1]
    assert kept
    assert on_dead
    ray.kill(h.units[1], no_restart=True)
    wait_until(lambda: not c.service_info().units[1].alive, 30, "the watcher to see the loss")
    return kept, on_dead


def test_a_unit_killed_during_writes_loses_exactly_its_samples(fresh):
    h = fresh(num_storage_units=2)
    c = h.client()
    ids = [f"s{i}" for i in range(40)]
    c.register_partition("p", ["x"], len(ids), ["t"])
    kept, on_dead = _put_then_kill_unit_1(h, c, ids)
    # Writes go on (new samples go to the live unit); the rest stays readable bit for bit.
    c.put_samples(["late"], "p", {"x": _values(["late"])})
    assert torch.equal(c.get_samples(kept, "p", ["x"])["x"], _values(kept))
    with pytest.raises(SamplesLost) as e:
        c.get_samples(on_dead[:3], "p", ["x"])
    assert e.value.ids == on_dead[:3]
    claimed = c.claim_meta("p", "t", ["x"], 1000, blocking=False).sample_ids
    assert sorted(claimed) == sorted([*kept, "late"])  # lost samples are never handed out
    assert c.check_consumption_status("p", ["t"])  # lost samples are terminal: done
    with pytest.raises(SamplesLost) as e:
        c.claim_meta("p", "t", ["x"], 4, timeout_s=30)
    assert sorted(e.value.ids) == sorted(on_dead)


SLOW_PING_S = 8.0  # past the 5 s the controller once gave a unit before declaring it lost


def test_a_unit_slow_to_answer_is_not_declared_lost_on_a_clients_say_so(fresh):
    """A client that saw a unit fail asks the controller to mark it lost. Lost is for good
    (its samples with it), so only a dead actor is proof: a unit whose pings answer after
    the controller's 5 s (the ``UNIT_PING`` failpoint, a loaded node) stays alive."""
    h = fresh(num_storage_units=2)
    c = h.client()
    ids = [f"s{i}" for i in range(8)]
    c.register_partition("p", ["x"], None, ["t"])
    c.put_samples(ids, "p", {"x": _values(ids)})
    failpoints.arm(failpoints.UNIT_PING, str(SLOW_PING_S))
    try:
        assert ray.get(h.controller.mark_unit_lost.remote(0)) is False
        assert failpoints.fired(failpoints.UNIT_PING) >= 1  # it was slow when asked
    finally:
        failpoints.disarm(failpoints.UNIT_PING)
    assert [u.alive for u in c.service_info().units] == [True, True]
    assert torch.equal(c.get_samples(ids, "p", ["x"])["x"], _values(ids))


def test_a_controller_restarted_after_a_unit_died_finds_the_rest_by_name(fresh):
    """The controller is given its units' names (no actor handles in its constructor
    arguments, which Ray would keep in the starter's object store). A unit dead when it
    restarts has no name left: it stays lost, the rest serve on."""
    h = fresh(num_storage_units=2)
    c = h.client()
    ids = [f"r{i}" for i in range(20)]
    c.register_partition("p", ["x"], len(ids), ["t"])
    kept, on_dead = _put_then_kill_unit_1(h, c, ids)
    ray.kill(h.controller, no_restart=False)  # Ray restarts it; unit 1's name is gone
    wait_until(lambda: _controller_state(h) == "ALIVE", 60, "the controller's restart")
    info = c.service_info()
    assert [u.alive for u in info.units] == [True, False]
    assert torch.equal(c.get_samples(kept, "p", ["x"])["x"], _values(kept))
    # Which ids lived on the dead unit was known only to it and to the old controller's
    # memory: after the restart they are unknown (typed), not reported as lost.
    with pytest.raises(SamplesNotFound) as e:
        c.get_samples(on_dead, "p", ["x"])
    assert e.value.ids == on_dead
    # ... and count as never written: the known-size partition cannot reach done.
    assert sorted(c.claim_meta("p", "t", ["x"], 100, blocking=False).sample_ids) == sorted(kept)
    assert not c.check_consumption_status("p", ["t"])
    c.put_samples(["after"], "p", {"x": _values(["after"])})  # writes go to the live unit
    assert ray.get(h.controller.lookup_units.remote("p", ["after"])) == [0]


def test_retention_keeps_only_the_newest_emptied_partitions(fresh):
    """Operators' opt-in rule: emptied partitions beyond the newest N are deleted; one that is
    written to again is not empty any more and stays. Default (off) keeps every one."""
    h = fresh(num_storage_units=1, retain_emptied_partitions=1)
    c = h.client()
    for pid in ["old", "mid", "new", "busy"]:
        c.register_partition(pid, ["x"], None, ["t"])
        c.put_samples(["a"], pid, {"x": torch.ones(1)})
    c.clear_samples(["a"], "busy")
    c.put_samples(["b"], "busy", {"x": torch.ones(1)})  # written again: not empty
    for pid in ["old", "mid", "new"]:
        c.clear_samples(["a"], pid)
    left = sorted(p.partition_id for p in ray.get(h.controller.list_partitions.remote()))
    assert left == ["busy", "new"]
    off = fresh(num_storage_units=1).client()
    off.register_partition("p", ["x"], None, ["t"])
    off.put_samples(["a"], "p", {"x": torch.ones(1)})
    off.clear_samples(["a"], "p")
    assert off.describe_partition("p").num_samples == 0  # kept by default


def test_a_controller_gone_for_good_is_service_unavailable_never_a_ray_error(fresh):
    """Killed with no restart left, every verb (sync and async) that needs the controller
    raises ServiceUnavailable, which is also a ConnectionError, and no Ray exception
    reaches the caller. A get of rows the client knows the place of is served by their
    unit under the generation check (direct reads), controller or not."""
    h = fresh(num_storage_units=1)
    c = h.client()
    c.register_partition("p", ["x"], None, ["t"])
    c.put_samples(["a", "z"], "p", {"x": torch.tensor([1.0, 2.0])})
    h.client().clear_samples(["z"], "p")  # another client: ours still remembers z's place
    ray.kill(h.controller, no_restart=True)
    assert torch.equal(c.get_samples(["a"], "p", ["x"])["x"], torch.ones(1))
    verbs = [
        lambda: c.put_samples(["b"], "p", {"x": torch.ones(1)}),
        lambda: c.get_samples(["z"], "p", ["x"]),  # cleared: the unit refuses, locate fails
        lambda: c.claim_meta("p", "t", ["x"], 1, timeout_s=5),
        lambda: c.check_consumption_status("p", ["t"]),
        lambda: c.clear_samples(["a"], "p"),
        lambda: asyncio.run(c.claim_meta_async("p", "t", ["x"], 1, timeout_s=5)),
    ]
    for verb in verbs:
        with pytest.raises(ServiceUnavailable, match="gone") as e:
            verb()
        assert isinstance(e.value, ConnectionError)
        assert not isinstance(e.value, ray.exceptions.RayError)


@pytest.fixture
def restart_held():
    """Arm the controller-restart failpoint: a restarted controller stays RESTARTING (in
    Ray's view) until the fixture disarms it, however long the test needs."""
    armed = Path(os.environ[failpoints.ENV]) / failpoints.CONTROLLER_RESTART
    armed.touch()
    yield armed
    armed.unlink(missing_ok=True)


def _controller_state(h) -> str:
    return client_module._actor_state(h.controller._actor_id.hex())[1]


@pytest.mark.slow
def test_a_restart_past_the_retry_budget_is_service_unavailable_then_serving_again(
    fresh, restart_held, monkeypatch
):
    """A controller that stays RESTARTING longer than controller_retry_budget_s: verbs
    give up with ServiceUnavailable naming the budget (never a Ray error, never a hang);
    once the restart completes the same client serves again with nothing lost."""
    monkeypatch.setattr(client_module, "_budget_s", 1.0)
    h = fresh(num_storage_units=1)
    c = h.client()
    c.register_partition("p", ["x"], None, ["t"])
    c.put_samples(["a"], "p", {"x": _values(["a"])})
    h.client().put_samples(["c"], "p", {"x": _values(["c"])})  # a place ours does not know
    ray.kill(h.controller, no_restart=False)
    wait_until(lambda: _controller_state(h) == "RESTARTING", 60, "the controller to restart")
    # A row whose place the client knows is read from its unit meanwhile (direct read).
    assert torch.equal(c.get_samples(["a"], "p", ["x"])["x"], _values(["a"]))
    verbs = [
        lambda: c.put_samples(["b"], "p", {"x": _values(["b"])}),
        lambda: c.get_samples(["c"], "p", ["x"]),
        lambda: c.check_consumption_status("p", ["t"]),
        lambda: asyncio.run(c.claim_meta_async("p", "t", ["x"], 1, timeout_s=5)),
    ]
    for verb in verbs:
        t0 = time.monotonic()
        with pytest.raises(ServiceUnavailable, match="restarting for over") as e:
            verb()
        assert isinstance(e.value, ConnectionError)
        assert not isinstance(e.value, ray.exceptions.RayError)
        assert time.monotonic() - t0 < 60  # bounded by the budget and the poll, not a hang
    assert _controller_state(h) == "RESTARTING"  # the failpoint held it all along

    restart_held.unlink()
    wait_until(lambda: _controller_state(h) == "ALIVE", 120, "the restart to finish")
    assert torch.equal(c.get_samples(["a"], "p", ["x"])["x"], _values(["a"]))
    c.put_samples(["b"], "p", {"x": _values(["b"])})
    assert c.claim_meta("p", "t", ["x"], 3, timeout_s=60).sample_ids == ["a", "c", "b"]


def _checkpoints_under(root) -> list[str]:
    return sorted(str(p) for p in root.iterdir() if p.is_dir())


def _loads_whole(directory: str) -> bool:
    """True when the directory reads as a checkpoint and every unit file matches its
    manifest (what a restore checks before storing anything)."""
    try:
        files, _ = checkpoint.read(directory)
    except CorruptPayload:
        return False
    for f in files:
        data = open(os.path.join(directory, f.name), "rb").read()  # noqa: SIM115 - test read
        # Checked apart from the code under test: the CRC-32C of the bytes, as the manifest says.
        assert (len(data), f"crc32c:{crc32c.crc32c(data):08x}") == (f.nbytes, f.digest), directory
    return True


@pytest.mark.slow
def test_a_controller_killed_during_a_checkpoint_leaves_none_half_written(fresh, tmp_path):
    """The controller dies while the units dump: whatever directory is left either loads whole
    or never loads; a checkpoint after the restart succeeds and restores bit for bit."""
    h = fresh(num_storage_units=2)
    c = h.client()
    c.register_partition("p", ["x"], None, ["t"])
    ids = [f"s{i}" for i in range(64)]
    rows = torch.randn(64, 256 * 1024)  # 64 MiB: the dump takes long enough to be interrupted
    c.put_samples(ids, "p", {"x": rows})
    outcome: list = []

    def save() -> None:
        try:
            outcome.append(c.checkpoint(tmp_path / "first"))
        except DataPlaneError as e:  # a typed refusal is allowed; anything else fails the test
            outcome.append(e)

    saver = threading.Thread(target=save)
    saver.start()
    wait_until(lambda: bool(_checkpoints_under(tmp_path)), 60, "the checkpoint to start")
    ray.kill(h.controller, no_restart=False)  # Ray restarts it
    saver.join(timeout=180)
    assert outcome, "the interrupted checkpoint call never returned"
    for d in _checkpoints_under(tmp_path):  # loads whole (checksums verified), or never
        assert _loads_whole(d) or ".tmp-" in d, f"{d} has the final name but does not load"
    path = c.checkpoint(tmp_path / "retry")
    assert _loads_whole(path)
    restored = fresh(num_storage_units=2).client()
    assert restored.restore(path) == 64
    assert torch.equal(restored.get_samples(ids, "p", ["x"])["x"], rows)


@pytest.mark.slow
def test_a_consumer_killed_holding_a_lease_has_its_samples_delivered_once_more(fresh):
    """A leased task's consumer dies holding a claim: after the lease runs out its samples
    go to one of the surviving consumers exactly once; nothing is lost or duplicated."""
    h = fresh(num_storage_units=2)
    c = h.client()
    ids = [f"s{i}" for i in range(24)]
    c.register_partition("p", ["x"], len(ids), ["train"], task_leases={"train": 5.0})
    c.put_samples(ids, "p", {"x": _values(ids)})
    Consumer = _consumer_class()
    doomed = Consumer.remote(h.config.name, h.config.namespace)
    held = ray.get(doomed.claim_once.remote("p", 4), timeout=60)
    assert len(held) == 4
    ray.kill(doomed)  # dies holding its claim, never acknowledging it
    survivors = [Consumer.remote(h.config.name, h.config.namespace) for _ in range(2)]
    runs = ray.get([s.drain.remote("p", 4) for s in survivors], timeout=120)
    delivered = [sid for got, _ in runs for sid in got]
    assert sorted(delivered) == sorted(ids)  # the 20 never held, plus the 4 once more
    assert all(not untyped for _, untyped in runs)
    assert sorted(s for s in delivered if s in held) == sorted(held)  # exactly once
    (detail,) = c.consumption_detail("p", ["train"])
    assert (detail.consumed, detail.leased, detail.redeliveries, detail.done) == (24, 0, 4, True)


def _consumer_class():
    """A consumer actor of a leased task (defined here so Ray ships it by value)."""

    @ray.remote
    class Consumer:
        def __init__(self, name, namespace):
            from dataplane_client.client import connect

            self.c = connect(name, namespace)

        def claim_once(self, pid: str, n: int) -> list[str]:
            return self.c.claim_meta(pid, "train", ["x"], n, timeout_s=30).sample_ids

        def drain(self, pid: str, n: int) -> tuple[list[str], list[str]]:
            """Claim, read and ack until the task is done; (ids got, untyped errors)."""
            got, untyped = [], []
            while not self.c.check_consumption_status(pid, ["train"]):
                try:
                    meta = self.c.claim_meta(pid, "train", ["x"], n, timeout_s=1)
                except DataPlaneError:  # nothing due right now (the other survivor took it)
                    continue
                except Exception as e:  # noqa: BLE001 - exactly what the test looks for
                    untyped.append(repr(e))
                    break
                self.c.get_data(meta, ["x"])
                self.c.ack(meta)
                got.extend(meta.sample_ids)
            return got, untyped

    return Consumer
