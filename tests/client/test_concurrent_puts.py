"""Concurrent async puts of ONE client: every sample reads back as written, never zeros.

A user gathered 8 ``put_samples_async`` calls of one client (each a 1.6 MB
sample of its own value) and read back 2-6 of 240 samples as zeros, with no
error anywhere. One put's copy into a reclaimed write lease failed with
``FileNotFoundError`` (the unit had closed that chunk); the transport then
marked the unit "not shared memory" for the whole client, and another put,
already staged in shared memory, re-read that flag, took itself for staged
through Ray, skipped its copy and committed the unit's zeroed region. The
failure is injected here where it happened (the writer's mapping of a chunk),
and also left to happen naturally with write leases being reclaimed under many
puts.
"""

import asyncio
import errno

import numpy as np
import pytest
import torch

from dataplane_client.wire import shm

ROW = 400_000  # float32 values: 1.6 MB a sample, so same-node puts get write leases


def _value(i: int) -> float:
    return float(i + 1)  # never 0: a zeroed region can never pass for a sample


async def _put_rounds(client, partition: str, rounds: int, width: int) -> list[str]:
    ids = []
    for r in range(rounds):
        batch = [f"s{r * width + k}" for k in range(width)]
        await asyncio.gather(
            *[
                client.put_samples_async(
                    [sid], partition, {"x": torch.full((1, ROW), _value(r * width + k))}
                )
                for k, sid in enumerate(batch)
            ]
        )
        ids.extend(batch)
    return ids


def _check_every_byte(client, partition: str, ids: list[str]) -> None:
    bad = []
    for start in range(0, len(ids), 16):
        part = ids[start : start + 16]
        got = client.get_samples(part, partition, ["x"])["x"].numpy()
        for k, sid in enumerate(part):
            want = _value(int(sid[1:]))
            if not np.all(got[k] == want):
                bad.append((sid, float(got[k].min()), float(got[k].max())))
    assert bad == [], f"{len(bad)} of {len(ids)} samples read back wrong: {bad[:5]}"


@pytest.fixture
def fresh_client(service):
    """A client of its own: what one client learns (e.g. about shared memory) stays in it."""
    from dataplane_client import connect

    client = connect(service.config.name, service.config.namespace)
    yield client
    client.close()


def test_a_failed_copy_in_one_put_never_makes_another_commit_zeros(
    fresh_client, monkeypatch, request
):
    partition = f"concurrent-{request.node.name}"
    fresh_client.register_partition(partition, ["x"], None, ["t"])
    real = shm.map_for_write
    calls = {"n": 0}

    def every_fifth_chunk_is_gone(chunk, start, nbytes):
        calls["n"] += 1
        if calls["n"] % 5 == 0:  # what a reclaimed lease's closed chunk gives
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", chunk.path)
        return real(chunk, start, nbytes)

    monkeypatch.setattr(shm, "map_for_write", every_fifth_chunk_is_gone)
    ids = asyncio.run(_put_rounds(fresh_client, partition, rounds=12, width=8))
    monkeypatch.setattr(shm, "map_for_write", real)
    _check_every_byte(fresh_client, partition, ids)
    assert calls["n"] >= 96  # every put copied through shared memory at least once
    # A vanished chunk is not "no shared memory": the client keeps its fast path.
    assert all(fresh_client._open_transport().shared)
    fresh_client.delete_partition(partition)


def test_many_concurrent_async_puts_read_back_bit_for_bit(fresh_client, request):
    partition = f"concurrent-{request.node.name}"
    fresh_client.register_partition(partition, ["x"], None, ["t"])
    ids = asyncio.run(_put_rounds(fresh_client, partition, rounds=30, width=8))
    _check_every_byte(fresh_client, partition, ids)
    assert all(fresh_client._open_transport().shared)
    fresh_client.delete_partition(partition)


def test_puts_of_many_threads_on_one_client_read_back_bit_for_bit(fresh_client, request):
    """Threads share the client's write leases: no two puts may copy into one region."""
    from concurrent.futures import ThreadPoolExecutor

    partition = f"concurrent-{request.node.name}"
    fresh_client.register_partition(partition, ["x"], None, ["t"])
    ids = [f"s{i}" for i in range(96)]

    def put(i: int) -> None:
        fresh_client.put_samples([ids[i]], partition, {"x": torch.full((1, ROW), _value(i))})

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(put, range(len(ids))))
    _check_every_byte(fresh_client, partition, ids)
    fresh_client.delete_partition(partition)
