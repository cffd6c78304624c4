"""A checkpoint is a cut at one position, taken while writers, claimers and clears go on,
and an incremental one copies only what is new: restored into another service, each
gives back exactly the samples committed before its cut, consumption as of the cut,
every byte as written, and the last checkpoint is shown with its position."""

from __future__ import annotations

import os
import shutil
import threading
import time

import pytest
import ray
import torch
from polling import wait_until

from dataplane_client.wire import failpoints

pytestmark = pytest.mark.ray

WRITERS = 2
BIG = (2 << 20) // 8  # int64 elements of a 2 MiB value


@pytest.fixture(scope="module")
def service_pair(module_services):
    config = dict(num_storage_units=2, admin_enabled=False, unit_warm_reserve_bytes=0)
    return [module_services("cut", **config) for _ in range(2)]


@pytest.fixture
def two_services(service_pair):
    clients = [h.client() for h in service_pair]
    yield service_pair
    for c in clients:
        if c.service_info().num_partitions:
            c.delete_partition("p")


def _value(sid: str) -> torch.Tensor:
    """A sample's bytes, made from its id: a torn or swapped row reads wrong."""
    writer, n = sid[1:].split("-")
    return torch.full((64,), int(writer) * 1_000_000 + int(n), dtype=torch.int64)


class Load:
    """Writers put (one sample a put, each its own sequence), one claimer consumes task t,
    each call timed, until ``stop``."""

    def __init__(self, client):
        self.client = client
        self.stop = threading.Event()
        self.puts: list[list[tuple[str, float, float]]] = [[] for _ in range(WRITERS)]
        self.claims: list[tuple[list[str], float, float]] = []
        self.errors: list[BaseException] = []
        self.threads = [
            threading.Thread(target=self._guard, args=(self._write, w)) for w in range(WRITERS)
        ]
        self.threads.append(threading.Thread(target=self._guard, args=(self._claim,)))
        for t in self.threads:
            t.start()

    def _guard(self, body, *args) -> None:
        try:
            body(*args)
        except BaseException as e:  # noqa: BLE001 - reported by join()
            self.errors.append(e)

    def _write(self, w: int) -> None:
        n = 0
        while not self.stop.is_set():
            sid = f"w{w}-{n}"
            t0 = time.monotonic()
            self.client.put_samples([sid], "p", {"x": _value(sid)[None]})
            self.puts[w].append((sid, t0, time.monotonic()))
            n += 1

    def _claim(self) -> None:
        while not self.stop.is_set():
            t0 = time.monotonic()
            got = self.client.claim_meta("p", "t", ["x"], 3, blocking=False)
            if got is not None and got.size:
                self.claims.append((got.sample_ids, t0, time.monotonic()))

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)
        assert not self.errors, self.errors


def _commit_seqs(handle) -> dict[str, int]:
    """Each sample the service's units hold now, with the commit sequence number that
    wrote it."""
    seqs = {}
    for unit in handle.units:
        rows = ray.get(unit.recovery_view.remote(), timeout=60).partitions.get("p")
        if rows is not None:
            seqs.update(zip(rows.sample_ids, rows.seq))
    return seqs


def _during(calls, start: float, end: float) -> int:
    """How many calls both began and returned inside [start, end]."""
    return sum(1 for *_, t0, t1 in calls if t0 > start and t1 < end)


@pytest.fixture
def armed():
    names = []

    def arm(name: str, seconds: float) -> None:
        failpoints.arm(name, str(seconds))
        names.append(name)

    yield arm
    for name in names:
        failpoints.disarm(name)


def test_a_checkpoint_taken_under_load_restores_exactly_its_cut(two_services, tmp_path, armed):
    """Two writers and a claimer run through the checkpoint; commits pause between
    publishing and applying (so the cut meets commits half way), and the units pause
    before copying (so puts, claims and clears happen after the cut, before the copy).
    The restored service holds, per writer, exactly a prefix of its puts (every put that
    returned before the checkpoint began, none begun after it returned), every byte as
    written, samples cleared during the copy, and consumption as of the cut: a prefix of
    the claims."""
    src, dst = (h.client() for h in two_services)
    src.register_partition("p", ["x", "big"], None, ["t", "all"])  # nobody claims "all" in src
    # Samples with a block of their own each (too large for a slab), cleared during the
    # copy: their blocks would be freed, not merely their cells, were they not pinned.
    big_ids = [f"w{WRITERS}-{i}" for i in range(3)]
    big = torch.arange(3 * BIG, dtype=torch.int64).reshape(3, BIG)
    src.put_samples(big_ids, "p", {"x": torch.stack([_value(s) for s in big_ids]), "big": big})
    load = Load(src)
    wait_until(lambda: all(len(p) >= 20 for p in load.puts), 120, "the writers to start")
    armed(failpoints.COMMIT_AFTER_PUBLISH, 0.02)
    armed(failpoints.CHECKPOINT_COPY, 3.0)
    before = [list(p) for p in load.puts]
    cleared_later = [sid for sid, *_ in before[0][:10]] + big_ids
    clearer = threading.Timer(1.0, src.clear_samples, args=(cleared_later, "p"))  # during the copy
    t0 = time.monotonic()
    clearer.start()
    path = src.checkpoint(str(tmp_path / "ck"))
    t1 = time.monotonic()
    clearer.join()
    failpoints.disarm(failpoints.COMMIT_AFTER_PUBLISH)
    load.join()
    assert failpoints.fired(failpoints.CHECKPOINT_COPY) >= 1
    # It paused nothing: puts and claims began and returned while it ran.
    assert min(_during(p, t0, t1) for p in load.puts) >= 3, [len(p) for p in load.puts]
    assert _during(load.claims, t0, t1) >= 3

    restored = dst.restore(path)
    last = src.service_info().last_checkpoint
    assert last is not None
    assert last.directory == path
    assert last.samples == restored
    held = set(dst.claim_meta("p", "all", ["x"], 100_000, blocking=False).sample_ids)
    assert len(held) == restored
    # The cut's position: every sample committed at or below it is in it, none above.
    born = _commit_seqs(two_services[0])
    assert {sid for sid, seq in born.items() if seq <= last.position} == held - set(cleared_later)
    for w, puts in enumerate(load.puts):
        ids = [sid for sid, *_ in puts]
        kept = [sid in held for sid in ids]
        k = sum(kept)
        assert kept == [True] * k + [False] * (len(ids) - k), f"writer {w}: not a prefix"
        assert all(sid in held for sid, _, end in puts if end < t0), "a put before it is missing"
        assert not any(sid in held for sid, start, _ in puts if start > t1), "a put after it"
    assert set(cleared_later) <= held  # cleared after the cut: still in it
    got = dst.get_samples(sorted(held), "p", ["x"])["x"]
    assert torch.equal(got, torch.stack([_value(sid) for sid in sorted(held)]))
    assert torch.equal(dst.get_samples(big_ids, "p", ["big"])["big"], big)

    # Consumption as of the cut: claimed before it (a prefix of the claims), not after.
    owed = set(dst.claim_meta("p", "t", ["x"], 10_000, blocking=False).sample_ids)
    consumed = held - owed
    claimed = [(set(ids) & held, start, end) for ids, start, end in load.claims]
    in_cut = [bool(ids) and ids <= consumed for ids, *_ in claimed]
    k = sum(in_cut)
    assert in_cut[:k] == [True] * k, "consumption is not a prefix of the claims"
    assert consumed == set().union(*(ids for ids, *_ in claimed[:k]))
    assert all(ok for ok, (_, _, end) in zip(in_cut, claimed) if end < t0)


def test_an_incremental_checkpoint_copies_only_new_bytes_and_restores_whole(two_services, tmp_path):
    """After a full checkpoint of 64 samples of 64 KiB, 4 more puts and a clear: the child
    writes those 4 samples' bytes (and its indexes), hard-links the rest, restores whole
    with the parent deleted, and service_info and metrics name it with its position."""
    src, dst = (h.client() for h in two_services)
    src.register_partition("p", ["x"], None, ["t"])
    row = 64 * 1024
    first_ids = [f"a{i}" for i in range(64)]
    src.put_samples(first_ids, "p", {"x": torch.ones(64, row, dtype=torch.uint8)})
    full = src.checkpoint(str(tmp_path / "full"))
    first = src.service_info().last_checkpoint
    assert first.bytes_written >= 64 * row
    assert first.bytes_linked == 0
    assert first.parent == ""
    new_ids = [f"b{i}" for i in range(4)]
    src.put_samples(new_ids, "p", {"x": torch.full((4, row), 2, dtype=torch.uint8)})
    src.clear_samples(first_ids[:8], "p")
    child = src.checkpoint(str(tmp_path / "child"), parent=full)
    last = src.service_info().last_checkpoint
    assert last.parent == full
    assert last.position > first.position
    assert 4 * row <= last.bytes_written < 5 * row  # the new bytes, and small indexes
    assert last.bytes_linked >= 56 * row
    shutil.rmtree(full)
    assert not os.path.exists(full)
    assert dst.restore(child) == 60
    got = dst.get_samples(first_ids[8:] + new_ids, "p", ["x"])["x"]
    assert torch.equal(got[:56], torch.ones(56, row, dtype=torch.uint8))
    assert torch.equal(got[56:], torch.full((4, row), 2, dtype=torch.uint8))
