"""Reproductions of suspected races on the real Ray service (a code review's hazards;
the Ray-free ones, including hazards 2 and 4, are in ``test_hazards_keyspace.py``).

Each test reproduced its bug on the code before its fix (as an ``xfail(strict=True)``
test, then unmarked when the fix landed); they stay as regression tests. Nothing is
injected into the service: races are hit by concurrency alone, or at this process's
``CHUNK_OPEN`` failpoint.

- Hazard 1: two concurrent first writes of a field with different dtypes on
  different samples both commit (the key space checks a schema only against the
  one recorded, not against commits in flight); the unit keeps one schema for the
  column and decodes the other write's bytes with it.
- Hazard 5: ``RayDataPlaneClient._forget(pid, None)`` iterates the route cache
  while other threads add routes; ``_claims()`` makes the claim batcher without a lock.
- Hazard 6: ``close()`` racing a get: the get goes on with the controller handle gone.
"""

from __future__ import annotations

import asyncio
import functools
import sys
import threading
import time

import pytest
import torch

from dataplane_client.client import connect
from dataplane_client.wire import failpoints
from dataplane_client.wire.errors import DataPlaneError, SamplesNotFound, ServiceUnavailable

# How long a race test looks for its hazard. Each reproduced within about a second
# before its fix (commit f71a0ee's notes); they once looked for 15-20 s each.
HAZARD_WINDOW_S = 5.0

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def fresh(service_factory):
    """Services of their own (faults must not touch the session's), without admin."""
    return functools.partial(service_factory, "hazards", admin_enabled=False)


# ---- hazard 1: concurrent first writes of one field with different dtypes --------------


def test_concurrent_first_writes_of_a_field_with_other_dtypes_read_back_as_written(fresh):
    """Two awaited puts of field x on a fresh partition, float32 on samples a*, int32 or
    int64 on samples b*, gathered. One may be refused with a typed error; a put that
    succeeded must read back exactly (dtype and values). One unit, so both land in one
    column. No delay is injected: both stages land before either commit, and the second
    commit is checked while the first publishes (both committed in 10/10 rounds for
    int32, 9/10 for int64, the tenth refused by the unit's stage check)."""
    h = fresh(num_storage_units=1)
    c = h.client()
    n, width = 32, 1024
    rows_a = torch.arange(n * width, dtype=torch.float32).reshape(n, width) + 0.5
    ids_a, ids_b = [f"a{i}" for i in range(n)], [f"b{i}" for i in range(n)]

    async def both(pid, rows_b):
        return await asyncio.gather(
            c.put_samples_async(ids_a, pid, {"x": rows_a}),
            c.put_samples_async(ids_b, pid, {"x": rows_b}),
            return_exceptions=True,
        )

    wrong, hits, refused = [], 0, 0
    rounds = [torch.int32, torch.int64] * 2
    for r, other in enumerate(rounds):
        pid = f"schema-{r}"
        rows_b = torch.arange(n * width, dtype=torch.int64).reshape(n, width).to(other) + 7
        c.register_partition(pid, ["x"], None, [])
        outcome = asyncio.run(both(pid, rows_b))
        untyped = [e for e in outcome if isinstance(e, BaseException)]
        assert all(isinstance(e, DataPlaneError) for e in untyped), untyped
        refused += len(untyped)
        hits += not untyped
        for ids, want, ok in ((ids_a, rows_a, outcome[0]), (ids_b, rows_b, outcome[1])):
            if isinstance(ok, BaseException):
                continue
            try:
                got = c.get_samples(ids, pid, ["x"])["x"]
            except Exception as e:  # noqa: BLE001 - a committed write must read back
                wrong.append(f"round {r}: {ids[0]}..: {e!r}")
                continue
            if got.dtype != want.dtype or not torch.equal(got, want):
                wrong.append(
                    f"round {r}: {ids[0]}.. written as {want.dtype} {want[0, :3].tolist()}, "
                    f"read as {got.dtype} {got[0, :3].tolist()}"
                )
    print(f"hazard 1: both puts committed in {hits}/{len(rounds)} rounds, {refused} refused")
    assert wrong == []


# ---- hazard 5: one client's route cache and claim batcher under threads ----------------


@pytest.fixture
def fast_switching():
    """Threads switch every microsecond (instead of 5 ms): races show within seconds."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def test_deleting_a_partition_while_other_threads_use_another_raises_only_typed_errors(
    service, fast_switching
):
    c = connect(service.config.name, service.config.namespace)
    # A client that has touched many samples: rebuilding its route cache takes a while.
    c._routes.remember("filler", [f"f{i}" for i in range(300_000)], [0] * 300_000)
    c.register_partition("hz5-b", ["x"], None, [])
    stop = threading.Event()
    untyped: list[str] = []

    def record(e: BaseException) -> None:
        untyped.append(f"{threading.current_thread().name}: {e!r}")
        stop.set()

    def churn_a() -> None:
        while not stop.is_set():
            try:
                c.register_partition("hz5-a", ["x"], None, [])
                c.delete_partition("hz5-a")
            except DataPlaneError:
                pass
            except Exception as e:  # noqa: BLE001 - exactly what this test looks for
                record(e)

    def use_b(k: int) -> None:
        i = 0
        while not stop.is_set():
            ids = [f"{k}-{i}-{j}" for j in range(64)]
            i += 1
            try:
                c.put_samples(ids, "hz5-b", {"x": torch.zeros(64, 2)})
                c.get_samples(ids, "hz5-b", ["x"])
            except DataPlaneError:
                pass
            except Exception as e:  # noqa: BLE001 - exactly what this test looks for
                record(e)

    threads = [threading.Thread(target=churn_a, name="churn-a")]
    threads += [threading.Thread(target=use_b, args=(k,), name=f"use-b-{k}") for k in range(3)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    # Before its fix the routes race raised within 0.3-0.6 s: 5 s keeps a wide margin.
    stop.wait(HAZARD_WINDOW_S)
    print(f"hazard 5 (routes): {'hit' if untyped else 'no hit'} after {time.monotonic() - t0:.1f}s")
    stop.set()
    for t in threads:
        t.join(timeout=30)
    c.delete_partition("hz5-b")
    c.close()
    assert untyped == []


def test_concurrent_first_claims_of_a_client_share_one_batcher(service, fast_switching):
    """8 threads make a client's first claims at once: they must share one ClaimBatcher
    (each batcher a claim is queued on starts a sender thread; only the one the client
    keeps is ever closed). Rounds of 8 threads call ``_claims()`` (what ``claim_meta``
    calls first) on a client whose batcher is reset, until two threads get different
    batchers or the deadline."""
    c = connect(service.config.name, service.config.namespace)
    split, rounds = None, 0
    # Before its fix the first round of 8 threads made two batchers.
    deadline = time.monotonic() + HAZARD_WINDOW_S
    while split is None and time.monotonic() < deadline:
        rounds += 1
        c._batcher = None  # as a fresh client
        start = threading.Barrier(8)
        got: list = []

        def first_claim(start=start, got=got) -> None:
            start.wait()
            got.append(c._claims())

        claimers = [threading.Thread(target=first_claim) for _ in range(8)]
        for t in claimers:
            t.start()
        for t in claimers:
            t.join(timeout=30)
        made = {id(b): b for b in got}
        if len(made) > 1:
            split = f"round {rounds}: 8 concurrent first claims made {len(made)} batchers"
        for b in made.values():
            b.close()
    print(f"hazard 5 (batcher): {'hit' if split else 'no hit'} in {rounds} rounds")
    c.close()
    assert split is None, split


# ---- hazard 6: close() racing a put or a get ------------------------------------------


def test_close_during_a_get_raises_a_typed_error_or_returns_the_rows(service):
    """The client is closed while its get maps the unit's shared memory (the CHUNK_OPEN
    failpoint, in this process: after the unit answered, before the rows are decoded), as
    another thread's close() would. The get must return the rows or raise a
    DataPlaneError (ServiceUnavailable: closed)."""
    writer = connect(service.config.name, service.config.namespace)
    writer.register_partition("hz6", ["x"], None, [])
    rows = torch.ones(4, 1 << 16)  # 1 MiB: mapped from shared memory, not inlined
    writer.put_samples(["a", "b", "c", "d"], "hz6", {"x": rows})
    c = connect(service.config.name, service.config.namespace)  # no mapping of its own yet
    closes: list[str] = []

    def close_now(path: str) -> None:
        closes.append(path)
        c.close()

    try:
        with failpoints.run_at(failpoints.CHUNK_OPEN, close_now):
            got = c.get_samples(["a", "b", "c", "d"], "hz6", ["x"])
        assert torch.equal(got["x"], rows)
    except DataPlaneError:
        pass
    except Exception as e:
        raise AssertionError(f"a get racing close() raised {e!r}") from e
    finally:
        writer.delete_partition("hz6")
        writer.close()
    assert closes, "the get never opened a chunk: the failpoint did not fire"


def test_close_during_a_put_raises_service_unavailable_and_commits_nothing(service):
    """The client is closed while its put maps the unit's chunk to copy its rows in (the
    CHUNK_OPEN failpoint, in this process: staged, not yet committed), as another thread's
    close() would. The put must raise ServiceUnavailable (closed) and commit nothing."""
    c = connect(service.config.name, service.config.namespace)
    c.register_partition("hz6-put", ["x"], None, [])
    rows = torch.ones(3, (5 << 18) + 1024)  # an odd size: a chunk no earlier write mapped
    reader = connect(service.config.name, service.config.namespace)
    closes: list[str] = []

    def close_now(path: str) -> None:
        closes.append(path)
        c.close()

    try:
        with (
            failpoints.run_at(failpoints.CHUNK_OPEN, close_now),
            pytest.raises(ServiceUnavailable, match="closed"),
        ):
            c.put_samples(["a", "b", "c"], "hz6-put", {"x": rows})
        assert closes, "the put never opened a chunk: the failpoint did not fire"
        with pytest.raises(SamplesNotFound):
            reader.get_samples(["a", "b", "c"], "hz6-put", ["x"])
    finally:
        reader.delete_partition("hz6-put")
        reader.close()
