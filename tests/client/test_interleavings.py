"""Randomized interleavings of one client's verbs, checked against a model.

One client, many coroutines at once: puts (new samples and overwrites, large
ones through shared memory and small ones), gets, claims of a cursor and a
leased task, acks and clears race on the same ids, with faults injected where
the Ray client's windows are narrow (a writer's chunk mapping that vanishes,
delays before copies). Each schedule is drawn from a seed, so a failure names
a schedule that can be run again. The model knows, per sample, every value a
put of it has started to write; it checks:

- every row a get returns is one of those values, whole (never zeros, never
  another sample's or a mix), and a sample whose put completed and which no
  clear has touched is always readable;
- per task, no sample is delivered twice, and once the schedule is over and
  the partition drained, every sample no clear touched was delivered once.

Both clients run the same schedules: the Ray client (shared memory, write
leases, claim batching) and the in-process one (its async twins run in
threads).
"""

import asyncio
import errno
import random
import time

import numpy as np
import pytest
import torch

from dataplane_client.wire import shm
from dataplane_client.wire.errors import FieldAlreadyProduced, SamplesNotFound
from dataplane_server.core.inprocess import InProcessDataPlaneClient

BIG, SMALL = 300_000, 64  # float32 values a row: 1.2 MB (own chunk, write leases), 256 B
SEEDS = [0, 1, 2]


def _row(sid: str, version: int, width: int) -> torch.Tensor:
    """A row no other (sample, version) has: its first value names both, never 0."""
    code = float(int(sid[1:]) * 16 + version + 1)
    return torch.full((width,), code, dtype=torch.float32)


def _rows(batch) -> list[np.ndarray]:
    return [t.numpy() for t in batch["x"].unbind()]


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


class Model:
    def __init__(self):
        self.values: dict[str, set[float]] = {}  # every value a put of the sample started
        self.committed: set[str] = set()  # samples whose put completed
        self.touched: set[str] = set()  # samples a clear has started on: anything goes after
        self.writing: dict[str, set] = {}  # per sample: the puts of it in flight
        self.overlapped: set = set()  # puts that were in flight with another of a sample
        self.delivered: dict[str, dict[str, int]] = {"c": {}, "l": {}}
        self.checked_rows = 0

    def start_write(self, ids: list[str], token: object) -> None:
        for sid in ids:
            others = self.writing.setdefault(sid, set())
            if others:
                self.overlapped.update(others | {token})
            others.add(token)

    def end_write(self, ids: list[str], token: object) -> None:
        for sid in ids:
            self.writing[sid].discard(token)

    def check_row(self, sid: str, row: np.ndarray) -> None:
        first = float(row[0])
        assert first in self.values.get(sid, ()), f"{sid}: {first} was never written to it"
        assert np.all(row == first), f"{sid}: a row mixing values {np.unique(row)[:4]}"
        self.checked_rows += 1

    def deliver(self, task: str, ids: list[str]) -> None:
        for sid in ids:
            seen = self.delivered[task].get(sid, 0)
            assert seen == 0, f"task {task}: {sid} delivered twice"
            self.delivered[task][sid] = 1


async def _schedule(client, pid: str, seed: int, ops: int = 160, width: int = 12) -> Model:
    rng = random.Random(seed)
    model = Model()
    versions: dict[str, int] = {}
    next_id = 0

    async def put(new: bool) -> None:
        nonlocal next_id
        if new or not model.committed:
            ids = [f"s{next_id + k}" for k in range(rng.randint(1, 3))]
            next_id += len(ids)
            overwrite = False
        else:
            stable = sorted(model.committed - model.touched)
            if not stable:
                return
            ids, overwrite = [rng.choice(stable)], True
        size = BIG if rng.random() < 0.5 else SMALL
        rows = []
        for sid in ids:
            versions[sid] = versions.get(sid, -1) + 1
            rows.append(_row(sid, versions[sid], size))
            model.values.setdefault(sid, set()).add(float(rows[-1][0]))
        token = object()
        model.start_write(ids, token)
        try:
            await client.put_samples_async(ids, pid, {"x": rows}, overwrite=overwrite)
        except SamplesNotFound as e:  # an overwrite racing a clear of the same sample
            _expect(overwrite and set(e.ids) <= model.touched, f"put of {ids} failed: {e}")
            return
        except FieldAlreadyProduced as e:  # refused: another put of it was committing
            _expect(overwrite and token in model.overlapped, f"put of {ids} failed: {e}")
            return
        finally:
            model.end_write(ids, token)
        model.committed.update(ids)

    async def get() -> None:
        stable = sorted(model.committed - model.touched)
        if not stable:
            return
        ids = rng.sample(stable, min(len(stable), rng.randint(1, 6)))
        rng.shuffle(ids)
        try:
            got = _rows(await client.get_samples_async(ids, pid, ["x"]))
        except SamplesNotFound as e:
            _expect(set(e.ids) <= model.touched, f"{e.ids} not found, but never cleared")
            return
        for sid, row in zip(ids, got):
            model.check_row(sid, row)

    async def claim(task: str) -> None:
        meta = await client.claim_meta_async(pid, task, ["x"], rng.randint(1, 6), blocking=False)
        if not meta:
            return
        model.deliver(task, list(meta.sample_ids))
        if task == "l":
            await client.ack_async(meta)

    async def clear() -> None:
        stable = sorted(model.committed - model.touched)
        if len(stable) < 4:
            return
        ids = rng.sample(stable, 2)
        model.touched.update(ids)
        await client.clear_samples_async(ids, pid)

    kinds = [
        (lambda: put(True), 5),
        (lambda: put(False), 1),
        (get, 4),
        (lambda: claim("c"), 2),
        (lambda: claim("l"), 2),
        (clear, 1),
    ]
    makers, weights = zip(*kinds)
    for _ in range(ops // width):  # waves of concurrent calls, each wave a random mix
        await asyncio.gather(*[rng.choices(makers, weights)[0]() for _ in range(width)])
    # Drain: every committed sample no clear touched is delivered once per task.
    for task in ("c", "l"):
        while True:
            meta = await client.claim_meta_async(pid, task, ["x"], 64, blocking=False)
            if not meta:
                break
            model.deliver(task, list(meta.sample_ids))
            if task == "l":
                await client.ack_async(meta)
        missing = model.committed - model.touched - set(model.delivered[task])
        assert not missing, f"task {task}: never delivered {sorted(missing)[:5]}"
    # And every byte of what is left reads back.
    stable = sorted(model.committed - model.touched)
    got = _rows(await client.get_samples_async(stable, pid, ["x"]))
    for sid, row in zip(stable, got):
        model.check_row(sid, row)
    return model


def _register(client, pid: str) -> None:
    client.register_partition(pid, ["x"], None, ["c", "l"], task_leases={"l": 600.0})


@pytest.fixture
def faulty_mappings(monkeypatch):
    """The Ray client's chunk mappings fail now and then (a chunk closed under a reclaimed
    lease) and copies start late, so puts overlap each other's answers."""
    real = shm.map_for_write
    rng = random.Random(1234)

    def flaky(chunk, start, nbytes):
        roll = rng.random()
        if roll < 0.15:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", chunk.path)
        if roll < 0.4:
            time.sleep(0.005)  # an injected delay: widens the window between stage and copy
        return real(chunk, start, nbytes)

    monkeypatch.setattr(shm, "map_for_write", flaky)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", SEEDS)
def test_ray_client_interleavings_match_the_model(service, faulty_mappings, seed, request):
    from dataplane_client import connect

    client = connect(service.config.name, service.config.namespace)
    pid = f"interleave-{seed}-{request.node.name}"
    try:
        _register(client, pid)
        model = asyncio.run(_schedule(client, pid, seed))
        assert model.checked_rows > 20  # the schedule did read a lot back
        assert all(client._open_transport().shared)  # faults never cost the fast path
    finally:
        client.delete_partition(pid)
        client.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", SEEDS)
def test_in_process_client_interleavings_match_the_model(seed):
    client = InProcessDataPlaneClient()
    _register(client, "p")
    model = asyncio.run(_schedule(client, "p", seed))
    assert model.checked_rows > 20
    client.close()
