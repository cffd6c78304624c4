"""Concurrent claims of one process coalesced into one controller call (``claim_many``).

The batcher alone (a plain callable as the controller: what it sends, and
when), then the real service: one batch with good, bad and must-wait claims
answered each on its own; a claim that times out while its batch-mates
succeed; and 64 concurrent claimers (coroutines and threads of one process)
racing writers and clears, every sample delivered once per task.
"""

import asyncio
import threading
import time
import uuid

import pytest
import ray
import torch

from dataplane_client.transport.claim_batcher import ClaimBatcher
from dataplane_client.wire.errors import (
    ClaimTimeout,
    InvalidBatch,
    ServiceUnavailable,
    UnknownPartition,
    UnknownTask,
)
from dataplane_client.wire.messages import ClaimOutcome, ClaimRequest


def _request(i: int) -> ClaimRequest:
    return ClaimRequest(f"p{i}", "t", [], 1, None, True)


def _until(predicate, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.001)


class _HeldController:
    """A ``send`` that records each call and answers only when the test lets it."""

    def __init__(self):
        self.calls: list[list[ClaimRequest]] = []
        self.release = threading.Semaphore(0)

    def __call__(self, requests):
        self.calls.append(list(requests))
        self.release.acquire()
        return [ClaimOutcome(meta=r.partition_id) for r in requests]


def test_claims_arriving_while_a_call_is_out_go_together_in_the_next_call():
    send = _HeldController()
    batcher = ClaimBatcher(send)
    first = batcher.submit(_request(0))
    _until(lambda: len(send.calls) == 1, "the first call")
    rest = [batcher.submit(_request(i)) for i in range(1, 11)]
    send.release.release()
    assert first.result(timeout=10).meta == "p0"
    _until(lambda: len(send.calls) == 2, "the second call")
    send.release.release()
    assert [f.result(timeout=10).meta for f in rest] == [f"p{i}" for i in range(1, 11)]
    assert [len(c) for c in send.calls] == [1, 10]  # a crowd costs one call, not ten
    batcher.close()


def test_a_claim_cancelled_before_its_call_left_is_never_sent():
    send = _HeldController()
    batcher = ClaimBatcher(send)
    batcher.submit(_request(0))
    _until(lambda: len(send.calls) == 1, "the first call")
    cancelled, kept = batcher.submit(_request(1)), batcher.submit(_request(2))
    assert cancelled.cancel()
    send.release.release()
    _until(lambda: len(send.calls) == 2, "the second call")
    send.release.release()
    assert kept.result(timeout=10).meta == "p2"
    assert [r.partition_id for r in send.calls[1]] == ["p2"]
    batcher.close()


def test_a_failed_call_is_the_error_of_every_claim_in_it_and_the_next_call_goes_out():
    answers = iter([ServiceUnavailable("controller gone"), None])

    def send(requests):
        failure = next(answers)
        if failure is not None:
            raise failure
        return [ClaimOutcome(meta="ok") for _ in requests]

    batcher = ClaimBatcher(send)
    with pytest.raises(ServiceUnavailable):
        batcher.submit(_request(0)).result(timeout=10)
    assert batcher.submit(_request(1)).result(timeout=10).meta == "ok"
    batcher.close()
    with pytest.raises(ServiceUnavailable):
        batcher.submit(_request(2))


# ---- the real service --------------------------------------------------------------


def _pid() -> str:
    return f"cb-{uuid.uuid4().hex[:8]}"


def _put(client, pid, ids):
    client.put_samples(ids, pid, {"x": torch.arange(len(ids), dtype=torch.int64)})


def test_one_batch_answers_each_claim_alone_good_bad_and_must_wait(client, service):
    pid, empty = _pid(), _pid()
    client.register_partition(pid, fields=["x"], consumer_tasks=["t"])
    client.register_partition(empty, fields=["x"], consumer_tasks=["t"])
    _put(client, pid, [f"s{i}" for i in range(8)])
    requests = [
        ClaimRequest(pid, "t", ["x"], 4, None, True),
        ClaimRequest("no-such-partition", "t", ["x"], 4, None, True),
        ClaimRequest(pid, "no-such-task", ["x"], 4, None, True),
        ClaimRequest(pid, "t", ["x"], 0, None, True),
        "not a request",
        ClaimRequest(empty, "t", ["x"], 4, None, True),  # blocking, nothing due
        ClaimRequest(empty, "t", ["x"], 4, None, False),  # non-blocking, nothing due
        ClaimRequest(pid, "t", ["x"], 4, 3, True),
    ]
    answers = ray.get(service.controller.claim_many.remote(requests))
    good, no_part, no_task, zero, junk, wait, nothing, second = answers
    assert good.error is None
    assert good.meta.sample_ids == [f"s{i}" for i in range(4)]
    assert isinstance(no_part.error, UnknownPartition)
    assert no_part.meta is None
    assert isinstance(no_task.error, UnknownTask)
    assert "no-such-task" in str(no_task.error)
    assert isinstance(zero.error, InvalidBatch)
    assert isinstance(junk.error, InvalidBatch)
    assert wait.must_wait
    assert wait.error is None
    assert wait.meta is None
    assert not nothing.must_wait
    assert nothing.meta is None
    assert nothing.error is None
    assert second.meta.sample_ids == [f"s{i}" for i in range(4, 8)]
    assert second.meta.extra_info["dp_rank"] == 3


def test_a_claim_times_out_on_its_own_while_its_batch_mates_succeed(client):
    pid, empty = _pid(), _pid()
    client.register_partition(pid, fields=["x"], consumer_tasks=[f"t{i}" for i in range(8)])
    client.register_partition(empty, fields=["x"], consumer_tasks=["t"])
    _put(client, pid, [f"s{i}" for i in range(4)])

    async def main():
        t0 = time.monotonic()
        late = asyncio.ensure_future(client.claim_meta_async(empty, "t", ["x"], 4, timeout_s=1.0))
        metas = await asyncio.gather(
            *[client.claim_meta_async(pid, f"t{i}", ["x"], 4, timeout_s=30) for i in range(8)],
            client.claim_meta_async(pid, "bogus", ["x"], 4, timeout_s=30),
            return_exceptions=True,
        )
        with pytest.raises(ClaimTimeout):
            await late
        return metas, time.monotonic() - t0

    metas, elapsed = asyncio.run(main())
    assert [m.sample_ids for m in metas[:8]] == [[f"s{i}" for i in range(4)]] * 8
    assert isinstance(metas[8], UnknownTask)  # the bad one fails alone, typed
    assert elapsed >= 1.0  # its own timeout, counted from its own call


def test_sync_and_async_claims_of_one_client_share_calls_and_keep_their_answers(client):
    pid = _pid()
    tasks = [f"t{i}" for i in range(16)]
    client.register_partition(pid, fields=["x"], consumer_tasks=tasks)
    _put(client, pid, [f"s{i}" for i in range(4)])
    got: dict[str, list[str]] = {}

    async def main():
        sync = [
            asyncio.to_thread(client.claim_meta, pid, t, ["x"], 4, timeout_s=30) for t in tasks[:8]
        ]
        coros = [client.claim_meta_async(pid, t, ["x"], 4, timeout_s=30) for t in tasks[8:]]
        return await asyncio.gather(*sync, *coros)

    for task, meta in zip(tasks, asyncio.run(main())):
        assert meta.task_name == task
        got[task] = meta.sample_ids
    assert got == {t: [f"s{i}" for i in range(4)] for t in tasks}


def test_64_claimers_racing_writers_and_clears_get_every_sample_once_per_task(client):
    """32 claimers per task (coroutines, and threads for every fourth) in one process,
    two writers and a clearer at once: no sample reaches a task twice; every sample
    written and never cleared reaches each task; cleared ones at most once."""
    pid = _pid()
    tasks = ("a", "b")
    client.register_partition(pid, fields=["x"], consumer_tasks=list(tasks))
    n_writes, per_write = 60, 5
    written: list[str] = []
    cleared: set[str] = set()
    delivered: dict[str, list[str]] = {t: [] for t in tasks}

    async def main():
        done = asyncio.Event()  # the writers finished: claimers drain without blocking

        async def writer(w: int):
            for i in range(n_writes // 2):
                ids = [f"w{w}-{i}-{j}" for j in range(per_write)]
                await client.put_samples_async(
                    ids, pid, {"x": torch.arange(per_write, dtype=torch.int64)}
                )
                written.extend(ids)

        async def clearer():
            for _ in range(10):
                if written:
                    victim = written[len(written) // 2]
                    if victim not in cleared:
                        cleared.add(victim)
                        await client.clear_samples_async([victim], pid)
                await asyncio.sleep(0)  # yield to the claimers, not a synchronisation

        async def claimer(task: str, k: int):
            def claim(blocking: bool):
                kwargs = dict(blocking=blocking, timeout_s=0.5)
                if k % 4 == 0:  # a sync caller on a thread shares the same batcher
                    return asyncio.to_thread(client.claim_meta, pid, task, ["x"], 4, **kwargs)
                return client.claim_meta_async(pid, task, ["x"], 4, **kwargs)

            while True:
                try:
                    meta = await claim(blocking=not done.is_set())
                except ClaimTimeout:
                    continue
                if not meta:  # non-blocking after the writers finished: drained (an empty meta)
                    return
                delivered[task].extend(meta.sample_ids)

        async def writers():
            await asyncio.gather(writer(0), writer(1), clearer())
            done.set()

        await asyncio.gather(writers(), *[claimer(t, k) for t in tasks for k in range(32)])

    asyncio.run(main())
    kept = set(written) - cleared
    for task in tasks:
        got = delivered[task]
        assert len(got) == len(set(got)), f"task {task}: a sample was delivered twice"
        assert set(got) <= set(written)
        assert kept <= set(got), f"task {task} missed {sorted(kept - set(got))[:5]}"
