"""The GPU path's code, on the CPU: device selection, the copies, pinning's bookkeeping.

``get_data`` / ``get_samples`` with ``device="cpu"`` run the code a CUDA device runs
(gather straight from the unit's chunk, through the kept mapping, into a buffer on
the device; one wait), minus the pinning; a put whose bytes are on a device runs the
device-to-host copy into the unit's region when ``codec._device_bytes`` is made to
defer CPU tensors as it defers CUDA ones. The pinning is checked with a registrar
that records instead of calling CUDA. ``make gpu-check`` runs the CUDA side itself;
here, only its skip without CUDA.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from dataplane_client import KVBatchMeta
from dataplane_client.codec import devices
from dataplane_client.codec import fields as codec
from dataplane_client.wire import encoded, shm
from dataplane_client.wire.encoded import JAGGED, EncodedField, take_rows
from dataplane_client.wire.errors import InvalidBatch
from dataplane_server.core.inprocess import InProcessDataPlaneClient

ROOT = Path(__file__).resolve().parents[2]
ROWS = 12
BIG = 1 << 20  # per field: above the unit's inline-answer limit, so reads map chunks


class RecordingRegistrar:
    """Stands in for CUDA's: records what it pins and unpins (``refuse``: pins nothing)."""

    def __init__(self, refuse: bool = False):
        self.refuse = refuse
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []

    def register(self, addr: int, nbytes: int) -> bool:
        self.registered.append((addr, nbytes))
        return not self.refuse

    def unregister(self, addr: int) -> None:
        self.unregistered.append(addr)


def _fields(rows: int = ROWS, width: int = 3) -> dict:
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(0, 6, (rows,), generator=g)
    return {
        "f32": torch.randn(rows, width, generator=g),
        "bf16": torch.randn(rows, 2, width, generator=g).to(torch.bfloat16),
        "i64": torch.randint(-(2**40), 2**40, (rows,), generator=g),
        "flags": torch.randint(0, 2, (rows, width), generator=g).bool(),
        "tokens": [torch.randint(0, 1000, (int(n),), generator=g) for n in lengths],
        "big": torch.randint(0, 256, (rows, BIG // rows), generator=g, dtype=torch.uint8),
        "kind": ["a" if i % 3 else "b" for i in range(rows)],  # an enum
        "note": [{"i": i} if i % 2 else f"row {i}" for i in range(rows)],  # objects
    }


def _put_one(client, name: str) -> tuple[dict, str, KVBatchMeta]:
    """Field ``name`` of `_fields` alone, put as ROWS samples into a partition of its own:
    (the fields put, the partition, the put's meta)."""
    fields = {name: _fields()[name]}
    pid = f"dev-{uuid.uuid4().hex[:8]}"
    client.register_partition(pid, fields=[name], consumer_tasks=[])
    return fields, pid, client.put_samples([f"s{i}" for i in range(ROWS)], pid, fields)


def _register(client, fields: dict) -> str:
    pid = f"dev-{uuid.uuid4().hex[:8]}"
    client.register_partition(
        pid,
        fields=list(fields),
        consumer_tasks=[],
        enums={"kind": ["a", "b"]},
        object_fields=["note"],
    )
    return pid


def _put_all(client) -> tuple[dict, str, list[str], KVBatchMeta]:
    """Every field of `_fields` put as ROWS samples into a partition of its own:
    (the fields put, the partition, the ids, the put's meta)."""
    fields = _fields()
    pid = _register(client, fields)
    ids = [f"s{i}" for i in range(ROWS)]
    return fields, pid, ids, client.put_samples(ids, pid, fields)


def _bits(t: torch.Tensor) -> tuple:
    if t.is_nested:
        return (_bits(t.values()), _bits(t.offsets()))
    return (t.dtype, tuple(t.shape), t.contiguous().reshape(-1).view(torch.uint8).tolist())


def _assert_same(got, want: dict) -> None:
    for name, value in want.items():
        if isinstance(value, torch.Tensor):
            assert _bits(got[name]) == _bits(value), name
        elif isinstance(value[0], torch.Tensor):
            assert _bits(got[name]) == _bits(
                torch.nested.as_nested_tensor(value, layout=torch.jagged)
            ), name
        else:
            assert list(got[name]) == value, name


@pytest.fixture(params=["ray", "in_process"])
def any_client(request):
    if request.param == "ray":
        yield request.getfixturevalue("client")
        return
    c = InProcessDataPlaneClient()
    yield c
    c.close()


# ---- device selection ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad", ["gpu", "cuda:x", "meta", "", 0, 1.5, object(), torch.device("meta")]
)
def test_a_bad_device_is_invalid_batch_naming_the_argument(bad):
    with pytest.raises(InvalidBatch, match="device"):
        devices.parse_device(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this process sees CUDA")
@pytest.mark.parametrize("asked", ["cuda", "cuda:0", torch.device("cuda", 1)])
def test_cuda_without_cuda_is_invalid_batch(asked):
    with pytest.raises(InvalidBatch, match="sees no CUDA device"):
        devices.parse_device(asked)


def test_bad_device_on_get_is_refused_before_anything_is_read(any_client):
    fields, pid, ids, meta = _put_all(any_client)
    for call in (
        lambda: any_client.get_data(meta, device="cuda:x"),
        lambda: any_client.get_samples(ids, pid, ["f32"], device=7),
    ):
        with pytest.raises(InvalidBatch, match="device"):
            call()
    assert any_client.get_data(meta, ["f32"])["f32"].shape == (ROWS, 3)  # still all there
    any_client.delete_partition(pid)


# ---- reads to a device --------------------------------------------------------------------------


def test_read_to_cpu_device_equals_host_read_bit_for_bit(any_client):
    fields, pid, ids, meta = _put_all(any_client)
    shuffled = [ids[i] for i in np.random.default_rng(3).permutation(ROWS)]
    host = any_client.get_samples(shuffled, pid, list(fields))
    on_cpu = any_client.get_samples(shuffled, pid, list(fields), device="cpu")
    assert host.device is None
    assert on_cpu.device == torch.device("cpu")
    for name in fields:
        if isinstance(host[name], torch.Tensor):
            assert _bits(on_cpu[name]) == _bits(host[name]), name
        else:
            assert list(on_cpu[name]) == list(host[name]), name
    _assert_same(any_client.get_data(meta, device=torch.device("cpu")), fields)
    any_client.delete_partition(pid)


def test_device_read_owns_its_bytes(client):
    """A device read is a copy: changing it changes neither the store nor a later read."""
    fields, pid, meta = _put_one(client, "big")
    got = client.get_data(meta, device="cpu")["big"]
    got.zero_()
    assert torch.equal(client.get_data(meta, device="cpu")["big"], fields["big"])
    client.delete_partition(pid)


def test_async_twins_take_the_device(client):
    import asyncio

    fields, pid, meta = _put_one(client, "f32")
    got = asyncio.run(client.get_data_async(meta, device="cpu"))
    assert got.device == torch.device("cpu")
    assert torch.equal(got["f32"], fields["f32"])
    with pytest.raises(InvalidBatch, match="device"):
        asyncio.run(client.get_data_async(meta, device="gpu"))
    client.delete_partition(pid)


# ---- puts from a device: the same copy code, with CPU tensors standing in --------------------


@pytest.fixture
def cpu_tensors_deferred(monkeypatch):
    """Encode contiguous CPU tensors as CUDA ones are: bytes kept on their "device" until
    the put knows where they land (the unit's region, or require_values)."""

    def defer(t: torch.Tensor):
        if not t.is_contiguous() or t.numel() == 0:
            return None
        flat = t.detach().reshape(-1)
        return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)

    monkeypatch.setattr(codec, "_device_bytes", defer)


def test_device_bytes_are_copied_into_place_by_row_runs(cpu_tensors_deferred):
    rows = [torch.arange(n, dtype=torch.int32) + 100 * n for n in (3, 0, 5, 2, 4)]
    enc = codec.encode_field("x", rows)
    assert enc.kind == JAGGED
    assert enc.values is None
    assert enc.device_values is not None
    assert encoded.row_copy_pairs(enc, np.arange(5), np.empty(0, np.uint8)) is None
    pick = np.array([4, 0, 1, 2, 3])  # out of order: runs [4], [0..3]
    out = np.empty(take_rows(enc, pick, header_only=True).nbytes, dtype=np.uint8)
    devices.copy_rows_to_host(enc, pick, out)
    want = torch.cat([rows[i] for i in pick]).view(torch.uint8).numpy()
    assert np.array_equal(out, want)
    assert enc.device_values is not None  # still there for another stage (a retry)
    assert np.array_equal(enc.require_values(), torch.cat(rows).view(torch.uint8).numpy())
    assert enc.device_values is None  # materialized once: the Ray path's .cpu()


def test_put_of_device_bytes_reads_back_bit_for_bit(any_client, cpu_tensors_deferred):
    fields = _fields()
    pid = _register(any_client, fields)
    ids = [f"s{i}" for i in range(ROWS)]
    any_client.put_samples(ids, pid, fields)
    _assert_same(any_client.get_samples(ids, pid, list(fields)), fields)
    any_client.delete_partition(pid)


def test_device_bytes_copy_needs_device_bytes():
    enc = EncodedField(
        kind="dense", dtype="uint8", shape=(), values=np.zeros(2, np.uint8), num_rows=2
    )
    with pytest.raises(ValueError, match="not on a device"):
        devices.copy_rows_to_host(enc, np.arange(2), np.empty(2, np.uint8))


# ---- pinning: each kept mapping registered once, unregistered when it goes --------------------


def test_each_kept_mapping_is_registered_once_and_unregistered_when_it_goes():
    maps, registrar = shm.KeptMaps(), RecordingRegistrar()
    a, b = shm.create(1 << 20), shm.create(1 << 20)
    try:
        first = maps.region(a.ref(), 0, 4096)  # kept before pinning: registered by pin_with
        maps.pin_with(registrar)
        assert len(registrar.registered) == 1
        for offset in (0, 8192, 65536):
            maps.region(a.ref(), offset, 4096)[:] = 1  # the same mapping: no new registration
        maps.region(b.ref(), 0, 4096)
        assert [n for _, n in registrar.registered] == [1 << 20, 1 << 20]
        assert len({addr for addr, _ in registrar.registered}) == 2
        assert maps.pinned_bytes() == 2 << 20
        maps.pin_with(registrar)  # again: nothing registered twice
        assert len(registrar.registered) == 2

        maps.forget([a.name])  # dropped while a view is alive: still pinned, still mapped
        assert registrar.unregistered == []
        del first
        assert registrar.unregistered == [registrar.registered[0][0]]
        maps.forget([b.name])
        assert sorted(registrar.unregistered) == sorted(addr for addr, _ in registrar.registered)
        assert maps.pinned_bytes() == 0
    finally:
        a.close()
        b.close()


def test_a_refused_registration_is_not_retried_nor_undone():
    maps, registrar = shm.KeptMaps(), RecordingRegistrar(refuse=True)
    chunk = shm.create(1 << 20)
    try:
        maps.pin_with(registrar)
        for _ in range(3):
            maps.region(chunk.ref(), 0, 4096)
        assert len(registrar.registered) == 1
        assert maps.pinned_bytes() == 0
        maps.forget([chunk.name])
        assert registrar.unregistered == []
    finally:
        chunk.close()


def test_a_device_read_pins_the_chunk_mapping_once(client, monkeypatch):
    """The Ray client's same-node device read goes through the kept, pinned mapping."""
    registrar = RecordingRegistrar()
    monkeypatch.setattr(shm.write_maps, "registrar", None)  # restored after the test
    shm.write_maps.pin_with(registrar)
    fields, pid, meta = _put_one(client, "big")
    big = fields["big"]
    shm.write_maps.forget([], prefix="")  # the put's kept mappings gone: the read maps anew
    assert shm.write_maps.pinned_bytes() == 0
    before = len(registrar.registered)
    assert torch.equal(client.get_data(meta)["big"], big)  # device=None: no kept mapping
    assert len(registrar.registered) == before
    assert torch.equal(client.get_data(meta, device="cpu")["big"], big)
    assert len(registrar.registered) > before  # the chunks it read through, pinned
    assert shm.write_maps.pinned_bytes() > 0
    registered = len(registrar.registered)
    for _ in range(3):
        assert torch.equal(client.get_data(meta, device="cpu")["big"], big)
        assert torch.equal(client.get_data(meta)["big"], big)  # device=None: no kept mapping
    assert len(registrar.registered) == registered  # each kept mapping registered once
    client.delete_partition(pid)


# ---- the policy worker fetches to its device -----------------------------------------------------


def test_policy_worker_fetches_to_its_gpu_and_keeps_cpu_reads_zero_copy():
    from types import SimpleNamespace

    from policy_workers.worker import PolicyWorker

    on_cpu = SimpleNamespace(device=torch.device("cpu"))
    assert PolicyWorker._fetch_device(on_cpu) is None  # the host mapping, no copy
    on_gpu = SimpleNamespace(device=torch.device("cuda", 0))
    assert PolicyWorker._fetch_device(on_gpu) == torch.device("cuda", 0)


def test_mixin_fetch_reads_to_the_fetch_device():
    from policy_workers.config import PolicyConfig
    from policy_workers.tq_mixin import TQWorkerMixin

    class Host(TQWorkerMixin):
        def __init__(self, client, device):
            self.cfg, self._dp_client, self.device = PolicyConfig(), client, device

        def _local_coords(self):
            return {}

        def _fetch_device(self):
            return self.device

    c = InProcessDataPlaneClient()
    try:
        c.register_partition("p", fields=["input_ids"], consumer_tasks=[])
        ids = [torch.arange(n) + 1 for n in (2, 5, 3)]
        meta = c.put_samples(["a", "b", "c"], "p", {"input_ids": ids})
        data = Host(c, "cpu")._fetch(meta)
        assert data["input_ids"].tolist() == [[1, 2, 0, 0, 0], [1, 2, 3, 4, 5], [1, 2, 3, 0, 0]]
        with pytest.raises(InvalidBatch, match="device"):
            Host(c, "tpu:0")._fetch(meta)  # the host's device reaches get_data
    finally:
        c.close()


# ---- make gpu-check without CUDA ----------------------------------------------------------------


def test_gpu_check_skips_cleanly_without_cuda(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = tmp_path / "gpu.json"
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    last = json.loads(run.stdout.strip().splitlines()[-1])
    assert last["check"] == "gpu"
    assert "no CUDA device" in last["skipped"]
    assert json.loads(out.read_text()) == last
    assert time.monotonic() - started < 60  # a skip, not a run: no Ray started
