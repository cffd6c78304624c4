"""Many concurrent writers on the real service: admission, coalesced commits, no collapse.

A put that cannot be admitted within its deadline fails fast with the typed,
retryable ``Overloaded`` and stages nothing; concurrent puts of one process
share commit calls while each keeps its own outcome; calls waiting on one actor
share its state queries; and (slow) 4,096
concurrent writers of the ``benchmarks.many_writers`` fleet lose nothing,
corrupt nothing, see no untyped or ``KeyError`` error and keep their goodput.
"""

import asyncio
import contextlib
import threading
import time

import pytest
import ray
import ray._private.state as ray_state
import torch
from bench_run import run_benchmark
from polling import wait_until

from dataplane_client import client as client_module
from dataplane_client.wire import failpoints
from dataplane_client.wire.errors import FieldAlreadyProduced, Overloaded, SamplesNotFound


@contextlib.contextmanager
def _commits_paused(seconds: float):
    """Every controller pauses each commit between publish and apply while the block runs;
    yields how often a commit paused."""
    failpoints.arm(failpoints.COMMIT_AFTER_PUBLISH, str(seconds))
    try:
        yield lambda: failpoints.fired(failpoints.COMMIT_AFTER_PUBLISH)
    finally:
        failpoints.disarm(failpoints.COMMIT_AFTER_PUBLISH)


def _counter(handle, name: str) -> float:
    snap = ray.get(handle.controller.metrics_snapshot.remote())
    return snap.stats["counters"].get(name, 0)


def _rows(n: int, value: int) -> dict:
    return {"x": torch.full((n, 64), value, dtype=torch.uint8)}


def test_a_put_not_admitted_in_time_fails_fast_with_overloaded_and_stages_nothing(
    service_factory,
):
    handle = service_factory(
        "dp-admit", num_storage_units=1, put_credits=1, put_admission_timeout_s=0.5
    )
    client = handle.client()
    client.register_partition("p", fields=["x"])
    with _commits_paused(6.0) as paused:
        first = threading.Thread(target=client.put_samples, args=(["a"], "p", _rows(1, 1)))
        first.start()
        wait_until(lambda: paused() >= 1, 30, "the first put's commit to pause")
        t0 = time.monotonic()
        with pytest.raises(Overloaded) as e:  # the only credit is held by the first put
            client.put_samples(["b"], "p", _rows(1, 2))
        waited = time.monotonic() - t0
        assert ray.get(handle.units[0].staged_write_ids.remote()) == []  # b staged nothing
        first.join(timeout=60)
    assert waited < 5.0  # failed at its own deadline, not after the first put's commit
    err = e.value
    assert isinstance(err, TimeoutError)
    assert not isinstance(err, KeyError)
    assert err.queue == "put admission"
    assert "put admission" in str(err)
    assert torch.equal(client.get_samples(["a"], "p", ["x"])["x"], _rows(1, 1)["x"])
    with pytest.raises(SamplesNotFound):
        client.get_samples(["b"], "p", ["x"])  # nothing of the refused put is visible
    client.put_samples(["b"], "p", _rows(1, 2))  # retried, it goes through
    assert torch.equal(client.get_samples(["b"], "p", ["x"])["x"], _rows(1, 2)["x"])
    # Operators see it: the writer reported the refusal (and its wait) to the controller.
    wait_until(lambda: _counter(handle, "puts_rejected_total") == 1, 30, "the report")
    assert _counter(handle, "puts_admitted_total") >= 2


def test_concurrent_puts_of_one_process_share_commit_calls_and_keep_their_own_outcomes(
    service_factory,
):
    handle = service_factory("dp-coalesce", num_storage_units=2)
    client = handle.client()
    client.register_partition("p", fields=["x"])
    client.put_samples(["taken"], "p", _rows(1, 9))
    before = _counter(handle, "commit_batches_total")

    async def puts():
        calls = [client.put_samples_async([f"s{i}"], "p", _rows(1, i)) for i in range(64)]
        calls.append(client.put_samples_async(["taken"], "p", _rows(1, 0)))  # already there
        return await asyncio.gather(*calls, return_exceptions=True)

    with _commits_paused(1.0):
        results = asyncio.run(puts())
    assert [type(r).__name__ for r in results[:64]] == ["KVBatchMeta"] * 64
    assert isinstance(results[64], FieldAlreadyProduced)  # its error is its own
    batches = _counter(handle, "commit_batches_total") - before
    assert 1 <= batches <= 16, f"65 puts took {batches} commit_many calls"
    got = client.get_samples([f"s{i}" for i in range(64)], "p", ["x"])["x"]
    assert torch.equal(got, torch.stack([_rows(1, i)["x"][0] for i in range(64)]))
    assert torch.equal(client.get_samples(["taken"], "p", ["x"])["x"], _rows(1, 9)["x"])


class _CountingController:
    """The client's real controller handle, counting ``field_codecs`` calls."""

    def __init__(self, handle):
        self._handle = handle
        self.codecs_asked = 0

    def __getattr__(self, name):
        method = getattr(self._handle, name)
        if name != "field_codecs":
            return method
        counter = self

        class _Counted:
            def remote(self, *args):
                counter.codecs_asked += 1
                return method.remote(*args)

        return _Counted()


def test_the_first_puts_of_a_partition_in_a_process_ask_its_codecs_once(service_factory):
    """Found under load: every put that found the partition's codecs not yet cached asked
    the controller for them, so a writer process's first wave of puts on a partition (256
    at once, one per credit) queued 256 identical calls at the controller and waited on
    them. They now share the one call in flight."""
    handle = service_factory("dp-codecs-once", num_storage_units=1)
    handle.client().register_partition("p", fields=["x"])
    writer = handle.client()  # its own process-side state: has not seen "p" yet
    counting = _CountingController(writer._controller)
    writer._controller = counting

    async def puts():
        calls = [writer.put_samples_async([f"s{i}"], "p", _rows(1, i)) for i in range(64)]
        return await asyncio.gather(*calls)

    assert len(asyncio.run(puts())) == 64
    assert counting.codecs_asked == 1, f"64 first puts asked {counting.codecs_asked} times"
    got = writer.get_samples([f"s{i}" for i in range(64)], "p", ["x"])["x"]
    assert torch.equal(got, torch.stack([_rows(1, i)["x"][0] for i in range(64)]))


@ray.remote(num_cpus=0)
class _SlowActor:
    async def answer_after(self, seconds: float) -> float:
        await asyncio.sleep(seconds)  # the call's own work: it takes this long
        return seconds


def test_calls_waiting_on_one_actor_share_its_restart_checks(ray_session, monkeypatch):
    """Found under load: every call the client waited on asked the GCS for its actor's
    state once a second (the restart budget's check), a synchronous query on the event
    loop. 512 puts in flight per writer process spent a third of the loop in them and
    goodput fell as writers were added. Calls waiting on one actor share one answer."""
    asked: list = []
    real_actors = ray_state.actors

    def counting_actors(actor_id=None, *args, **kwargs):
        asked.append(actor_id)
        return real_actors(actor_id, *args, **kwargs)

    monkeypatch.setattr(ray_state, "actors", counting_actors)
    slow = _SlowActor.remote()
    ray.get(slow.__ray_ready__.remote())
    refs = [slow.answer_after.remote(2.5) for _ in range(200)]  # each waited > 2 polls
    assert asyncio.run(client_module._resolve_async(refs)) == [2.5] * 200
    # One query per poll (about 1 s) for all 200 calls, not one per call per poll (~400).
    assert 1 <= len(asked) <= 8, f"200 waiting calls made {len(asked)} state queries"
    ray.kill(slow)


@pytest.mark.slow
def test_4096_concurrent_writers_lose_nothing_and_keep_their_goodput(tmp_path):
    """The benchmark's fleet (8 writer actors) at 1,024, 4,096, then 1,024 concurrent writers
    again, one put of 4 x 4 KiB each, every sample read back; in a subprocess with its own
    Ray. The 4,096 run is judged against the mean of the two 1,024 runs around it, so a
    change in the shared machine's load during the test weighs on both sides (a collapse,
    as before admission, is 0.25x). The floor is below the benchmark's 0.9 target: one
    round per level here, and single rounds differ by 10% on a quiet box (the benchmark
    README's table) and more under load; the dip two client bugs caused (0.57x, issue
    27's profile) stays well below it."""
    out = tmp_path / "writers.json"
    report, _ = run_benchmark(
        "benchmarks.many_writers", "--levels", "1024x1,4096x1,1024x1", out=out
    )
    before, at_4096, after = report["levels"]
    for level in (before, at_4096, after):
        assert level["lost"] == 0, level
        assert level["corrupt"] == 0, level
        # Only the typed, retryable refusal may fail a put; never a KeyError.
        assert set(level["errors"]) <= {"Overloaded"}, level["errors"]
    assert at_4096["completed_puts"] == at_4096["puts"], at_4096["errors"]
    at_1024 = (before["goodput_samples_per_s"] + after["goodput_samples_per_s"]) / 2
    ratio = at_4096["goodput_samples_per_s"] / at_1024
    assert ratio >= 0.75, f"goodput at 4,096 writers is {ratio:.2f}x the 1,024 writers' runs"
