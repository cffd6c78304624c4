"""Reproductions of suspected data-plane races that need no Ray (a code review's hazards).

Each test reproduced its bug on the code before its fix (as an ``xfail(strict=True)``
test, then unmarked when the fix landed); they stay as regression tests.

- Hazard 1: ``KeySpace.check_commit`` compares a field's schema only with the
  schema recorded for the partition, not with commits of the field in flight: two
  first writes of a field with different dtypes, on different samples, both pass
  and both apply; the partition records the first schema only.
- Hazard 2: ``publish._on_units`` undoes a multi-unit commit whose publish failed on
  one unit by ``unpublish``: the units' ``clear`` by sample id, which drops every
  field of the samples on the units that did publish, not only the new write's.
  Driven here over two ``UnitStore``s behind in-process stand-ins for their Ray
  handles (the controller's own ``publish.publish``, the units' own store).
- Hazard 4: ``InProcessDataPlaneClient._read`` looks samples up under the lock
  but decodes their fields after releasing it, from the very per-sample dicts a
  concurrent ``put_samples(..., overwrite=True)`` replaces field by field: one row
  can hold fields of two different writes.
"""

import asyncio
import inspect
import threading
import time
import types

import numpy as np
import pytest
import torch

from dataplane_client.codec.fields import decode_field, encode_field
from dataplane_client.wire.errors import (
    DataPlaneError,
    SamplesLost,
    SamplesNotFound,
    SchemaConflict,
)
from dataplane_client.wire.messages import CommitRequest
from dataplane_server.controller import publish
from dataplane_server.core.inprocess import InProcessDataPlaneClient
from dataplane_server.core.keyspace import CommitPlan, Declaration, KeySpace
from dataplane_server.core.recovery_messages import SampleMeta
from dataplane_server.core.unit.store import UnitStore

# How long a race test looks for its hazard. Each reproduced within about a second
# before its fix (commit f71a0ee's notes); they once looked for 15-20 s each.
HAZARD_WINDOW_S = 5.0


def _space() -> KeySpace:
    ks = KeySpace(lambda: 1000.0)
    ks.unit_alive = [True]
    ks.register("p", Declaration(["x"], None, ["t"], None))
    return ks


def _first_write(ids, dtype) -> CommitRequest:
    return CommitRequest(
        partition_id="p",
        write_id=f"w-{dtype}",
        sample_ids=list(ids),
        units=[0] * len(ids),
        schemas={"x": ("dense", dtype, (4,))},
        sequence_lengths=None,
        tags=None,
        overwrite=False,
        staged_units=[0],
    )


def test_a_field_written_once_with_one_dtype_refuses_another_afterwards():
    """Guard: the sequential case is caught (the schema recorded at apply is compared)."""
    ks = _space()
    ks.apply_commit(ks.check_commit(_first_write(["a"], "float32")))
    with pytest.raises(SchemaConflict):
        ks.check_commit(_first_write(["b"], "int64"))


def test_two_first_writes_of_a_field_in_flight_with_different_dtypes_cannot_both_apply():
    """Two writers' first commits of field x, on different samples, checked before either
    is applied (the controller awaits the units' publish in between). Either the second
    check is refused (SchemaConflict), or what is applied records, for every sample, the
    schema its bytes were written with. Today both pass, both apply, the partition says
    float32 for all of them, and b's int64 bytes are read as float32."""
    ks = _space()
    first = ks.check_commit(_first_write(["a"], "float32"))
    assert isinstance(first, CommitPlan)
    try:
        second = ks.check_commit(_first_write(["b"], "int64"))
    except SchemaConflict:
        return  # the fixed behaviour: the second writer is told at once
    ks.apply_commit(first)
    ks.apply_commit(second)
    part = ks.partition("p")
    assert part.produced["x"][part.row_of["b"]]  # b's x counts as produced ...
    assert part.schema["x"] == ("dense", "int64", (4,)), (
        f"b's x was written as int64, the partition records {part.schema['x']} for it"
    )


class _UnitHandle:
    """A storage unit's Ray handle, in process: ``handle.name.remote(*args)`` is an
    awaitable of ``store.name(*args)`` (the actor shell forwards each call to its store
    alike); ``instead`` replaces some methods (a fault)."""

    def __init__(self, store: UnitStore, **instead):
        self._store, self._instead = store, instead

    def __getattr__(self, name: str):
        method = self._instead.get(name) or getattr(self._store, name)

        async def remote(*args, **kwargs):
            out = method(*args, **kwargs)
            return await out if inspect.isawaitable(out) else out

        return types.SimpleNamespace(remote=remote)


def _dead_unit_error() -> BaseException:
    import ray.exceptions  # what Ray raises for a call to a dead actor (no cluster needed)

    return ray.exceptions.RayActorError()


@pytest.mark.parametrize("fault", ["stage-reclaimed", "unit-died"])
def test_a_write_back_undone_after_a_failed_publish_keeps_the_samples_earlier_fields(fault):
    """Samples a (unit 0) and b (unit 1) hold field x. A write-back of y over both is
    prepared on both units; then unit 1's publish fails: its pinned stage was reclaimed
    (a typed SamplesNotFound), or unit 1 died. The commit is refused and undone; a's x on
    unit 0, which the controller still lists, must still be there."""
    stores = [
        UnitStore(
            index=u,
            capacity_bytes=64 << 20,
            use_shm=False,
            put_wait_timeout_s=0.0,
            warm_reserve_bytes=0,
            stage_ttl_s=30.0,
        )
        for u in (0, 1)
    ]
    try:
        x = {"a": torch.full((1, 4), 1.0), "b": torch.full((1, 4), 2.0)}
        for u, sid in enumerate(("a", "b")):
            encoded = {"x": encode_field("x", x[sid])}
            asyncio.run(stores[u].stage("p", f"x-{sid}", [sid], encoded, None))
            assert stores[u].publish(f"x-{sid}", SampleMeta(seq=1))
        y = encode_field("y", torch.zeros(1, 4))
        for u, sid in enumerate(("a", "b")):
            asyncio.run(stores[u].stage("p", "wb", [sid], {"y": y}, None))

        def failing_publish(write_id, meta=None):
            if fault == "unit-died":
                raise _dead_unit_error()
            stores[1].discard(write_id)  # as the sweeper does to a stage past its deadline
            return stores[1].publish(write_id, meta)

        units = [_UnitHandle(stores[0]), _UnitHandle(stores[1], publish=failing_publish)]
        request = CommitRequest(
            partition_id="p",
            write_id="wb",
            sample_ids=["a", "b"],
            units=[0, 1],
            schemas={"y": y.schema},
            sequence_lengths=None,
            tags=None,
            overwrite=False,
            staged_units=[0, 1],
        )
        lost: list[int] = []

        async def lose_unit(u: int) -> None:
            lost.append(u)

        expected = SamplesLost if fault == "unit-died" else SamplesNotFound
        with pytest.raises(expected):
            asyncio.run(
                publish.publish(units, request, publish.sample_metas(request, 2), lose_unit)
            )
        assert lost == ([1] if fault == "unit-died" else [])
        try:
            got = decode_field(stores[0].read("p", ["a"], ["x"])["x"])
        except SamplesNotFound as e:
            pytest.fail(f"unit 0 lost sample a's x with the undone write-back of y: {e}")
        assert torch.equal(torch.as_tensor(got), x["a"])
    finally:
        for store in stores:
            store.close()


def test_an_in_process_read_racing_overwrites_never_mixes_two_writes_in_one_row():
    """Write k sets fields a and b of every sample to k; a reader must see a == b in each
    row. A writer thread overwrites in a loop while the reader reads; stops at the first
    mixed row or after the deadline."""
    c = InProcessDataPlaneClient()
    n, width = 256, 64
    ids = [f"s{i}" for i in range(n)]
    c.register_partition("p", ["a", "b"], None, [])

    def write(k: int) -> None:
        rows = torch.full((n, width), float(k))
        c.put_samples(ids, "p", {"a": rows, "b": rows.clone()}, overwrite=True)

    write(0)
    c.get_samples(ids, "p", ["a", "b"])  # imports done before two threads race for them
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        k = 1
        try:
            while not stop.is_set():
                write(k)
                k += 1
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    mixed, reads = None, 0
    # Before its fix a mixed row showed within the first 1-2 reads: 5 s of reads (thousands)
    # keep a wide margin.
    deadline = time.monotonic() + HAZARD_WINDOW_S
    try:
        while mixed is None and time.monotonic() < deadline and t.is_alive():
            try:
                got = c.get_samples(ids, "p", ["a", "b"])
            except DataPlaneError:
                continue
            reads += 1
            a, b = got["a"][:, 0].numpy(), got["b"][:, 0].numpy()
            bad = np.nonzero(a != b)[0]
            if len(bad):
                r = int(bad[0])
                mixed = f"read {reads}: row {ids[r]} has a={a[r]:g} from one write, b={b[r]:g}"
    finally:
        stop.set()
        t.join(timeout=10)
        c.close()
    assert errors == []
    assert mixed is None, mixed
