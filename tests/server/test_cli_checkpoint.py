"""``dataplane checkpoint save|restore`` against real services, through the admin API.

One service is saved by the CLI and a fresh one restored from the directory; a
sample read back through the restored service's client equals what was written,
bit for bit (bf16 compared as its raw int16 bits). Each failure reaches the
operator as one line with the gRPC code it maps to.
"""

from __future__ import annotations

import contextlib
import hashlib
import json

import grpc
import pytest
import torch
from cli_run import run_dataplane

from dataplane_client.wire.errors import CorruptPayload, UnknownPartition
from dataplane_server.admin_pb import admin_pb2, admin_pb2_grpc

TOKEN = "ckpt-token"


def dataplane(*args: str, address: str, token: str | None = TOKEN):
    env = {"DATAPLANE_ADMIN_ADDRESS": address}
    if token:
        env["DATAPLANE_ADMIN_TOKEN"] = token
    return run_dataplane(*args, env=env, timeout=300)


def ok(proc) -> str:
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def refused(proc, code: int, *needles: str) -> str:
    assert proc.returncode == code, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err
    return err


PARTITIONS = ("rollouts", "p")  # every partition a test here makes


@pytest.fixture(scope="module")
def started(module_services):
    """Two services for the module: each start costs seconds here, and no test needs more."""
    config = dict(
        num_storage_units=2, unit_warm_reserve_bytes=0, metrics_enabled=False, admin_token=TOKEN
    )
    return [module_services("cli-ckpt", **config) for _ in range(2)]


@pytest.fixture
def services(started, monkeypatch):
    """``services()`` gives the next service holding no partition (restore needs an empty
    one): the first test gets them fresh, the next ones emptied by the test before."""
    monkeypatch.delenv("DATAPLANE_ADMIN_TOKEN", raising=False)
    for h in started:
        assert h.client().service_info().num_partitions == 0
    yield iter(started).__next__
    for h in started:
        c = h.client()
        for pid in PARTITIONS:
            with contextlib.suppress(UnknownPartition):
                c.delete_partition(pid)


def _fields(n: int) -> dict:
    g = torch.Generator().manual_seed(11)
    return {
        "input_ids": [torch.randint(0, 50_000, (3 + i % 5,), generator=g) for i in range(n)],
        "logprobs": torch.randn(n, 4, generator=g).to(torch.bfloat16),
        "mask": torch.rand(n, generator=g) > 0.5,
    }


def test_save_then_restore_into_a_fresh_service_bit_for_bit(services, tmp_path):
    src_handle = services()
    src = src_handle.client()
    pid, ids = "rollouts", [f"s{i}" for i in range(12)]
    src.register_partition(pid, ["input_ids", "logprobs", "mask"], 12, ["train"])
    fields = _fields(12)
    src.put_samples(ids, pid, fields)
    taken = src.claim_meta(pid, "train", ["input_ids"], 5).sample_ids

    target = tmp_path / "ck"
    out = ok(dataplane("checkpoint", "save", str(target), address=src_handle.admin_address))
    assert out.strip() == f"saved checkpoint {target}"
    assert (target / "manifest.json").is_file()

    dst_handle = services()
    got = json.loads(
        ok(
            dataplane(
                "checkpoint", "restore", str(target), "--json", address=dst_handle.admin_address
            )
        )
    )
    assert got == {"directory": str(target), "restored_samples": 12}
    dst = dst_handle.client()
    back = dst.get_samples(ids, pid, ["input_ids", "logprobs", "mask"])
    for i, row in enumerate(back["input_ids"].unbind()):
        assert row.dtype == torch.int64
        assert torch.equal(row, fields["input_ids"][i])
    assert back["logprobs"].dtype == torch.bfloat16
    assert torch.equal(back["logprobs"].view(torch.int16), fields["logprobs"].view(torch.int16))
    assert torch.equal(back["mask"], fields["mask"])
    rest = dst.claim_meta(pid, "train", ["input_ids"], 100, blocking=False)
    assert sorted(rest.sample_ids) == sorted(set(ids) - set(taken))  # the cursor came along


def _as_format_2(directory) -> None:
    """Rewrite a checkpoint's manifest as the previous version wrote it: format 2, each
    file with a bare SHA-256 (computed here, apart from the code under test)."""
    path = directory / "manifest.json"
    got = json.loads(path.read_text())
    entries = [f for u in got["units"] for f in u["files"]] + [got["state"]]
    for entry in entries:
        del entry["digest"]
        entry["sha256"] = hashlib.sha256((directory / entry["name"]).read_bytes()).hexdigest()
    got["format"] = 2
    path.write_text(json.dumps(got))


def test_a_checkpoint_of_format_2_still_restores_and_is_checked(services, tmp_path):
    """Checkpoints saved before CRC-32C (format 2, SHA-256 per file) restore bit for bit,
    and a file that does not match its SHA-256 is refused before anything is stored."""
    src_handle = services()
    src = src_handle.client()
    ids = [f"s{i}" for i in range(6)]
    src.register_partition("rollouts", ["input_ids", "logprobs", "mask"], 6, ["train"])
    fields = _fields(6)
    src.put_samples(ids, "rollouts", fields)
    saved = tmp_path / "old"
    src.checkpoint(str(saved))
    assert json.loads((saved / "manifest.json").read_text())["state"]["digest"].startswith(
        "crc32c:"
    )
    _as_format_2(saved)
    dst = services().client()
    assert dst.restore(str(saved)) == 6
    back = dst.get_samples(ids, "rollouts", ["input_ids"])["input_ids"]
    assert all(torch.equal(r, f) for r, f in zip(back.unbind(), fields["input_ids"]))
    dst.delete_partition("rollouts")
    segment = next(saved.glob("unit-*-*.data"))
    spoiled = bytearray(segment.read_bytes())
    spoiled[0] ^= 0xFF
    segment.write_bytes(bytes(spoiled))
    with pytest.raises(CorruptPayload, match="does not match its manifest"):
        dst.restore(str(saved))
    assert dst.service_info().num_partitions == 0  # nothing stored


def test_each_refusal_is_one_line_with_its_grpc_code(services, tmp_path):
    h = services()
    h.client().register_partition("p", ["x"])
    h.client().put_samples(["a"], "p", {"x": torch.ones(1, 2)})
    addr = h.admin_address
    target = tmp_path / "ck"

    refused(dataplane("checkpoint", "save", str(target), address=addr, token=None), 4, "token")
    assert not target.exists()
    ok(dataplane("checkpoint", "save", str(target), address=addr))
    refused(
        dataplane("checkpoint", "save", str(target), address=addr),
        1,
        "FAILED_PRECONDITION",
        str(target),
    )
    # Restoring over live data is refused; the service keeps what it holds.
    refused(
        dataplane("checkpoint", "restore", str(target), address=addr),
        1,
        "FAILED_PRECONDITION",
        "empty service",
    )
    assert h.client().describe_partition("p").num_samples == 1

    fresh = services()
    state = target / "state.msgpack"
    raw = bytearray(state.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    state.write_bytes(bytes(raw))
    refused(
        dataplane("checkpoint", "restore", str(target), address=fresh.admin_address),
        1,
        "DATA_LOSS",
    )
    refused(
        dataplane("checkpoint", "restore", str(tmp_path / "none"), address=fresh.admin_address),
        1,
        "DATA_LOSS",
        "manifest",
    )


def test_a_relative_directory_is_invalid_argument(services):
    # The CLI makes paths absolute; another client sending a relative one is told why.
    h = services()
    with grpc.insecure_channel(h.admin_address) as channel:
        stub = admin_pb2_grpc.AdminServiceStub(channel)
        md = [("authorization", f"Bearer {TOKEN}")]
        for call, request in (
            (stub.SaveCheckpoint, admin_pb2.SaveCheckpointRequest(directory="ck")),
            (stub.RestoreCheckpoint, admin_pb2.RestoreCheckpointRequest(directory="")),
        ):
            with pytest.raises(grpc.RpcError) as info:
                call(request, timeout=30, metadata=md)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "absolute path" in info.value.details()


def test_save_with_a_parent_and_status_names_the_last_checkpoint_and_its_position(
    services, tmp_path
):
    """``save --parent`` links what the parent holds; ``status`` and GetServiceInfo name the
    last checkpoint with its position, ``describe`` the level and the partition's samples in
    it; a checkpoint of format 1 is refused naming it."""
    h = services()
    addr = h.admin_address
    h.client().register_partition("p", ["x"])
    h.client().put_samples(["a", "b"], "p", {"x": torch.ones(2, 4096)})
    full, child = tmp_path / "full", tmp_path / "child"
    ok(dataplane("checkpoint", "save", str(full), address=addr))
    h.client().put_samples(["c"], "p", {"x": torch.ones(1, 4096)})
    ok(dataplane("checkpoint", "save", str(child), "--parent", str(full), address=addr))
    with grpc.insecure_channel(addr) as channel:
        info = admin_pb2_grpc.AdminServiceStub(channel).GetServiceInfo(
            admin_pb2.GetServiceInfoRequest(), timeout=30
        )
    last = info.last_checkpoint
    assert (last.directory, last.parent, last.samples) == (str(child), str(full), 3)
    assert last.position >= 2  # two commits at least went into it
    assert last.bytes_linked >= 2 * 4096 * 4
    status = ok(dataplane("status", address=addr))
    line = next(s for s in status.splitlines() if s.startswith("checkpoint "))
    assert line.startswith(f"checkpoint {child} at position {last.position}"), line
    assert f"incremental to {full}" in line, line
    h.client().put_samples(["d"], "p", {"x": torch.ones(1, 4096)})  # after the cut: not in it
    described = ok(dataplane("describe", "p", address=addr))
    assert "durability      memory; 3 samples in the last checkpoint (" in described, described
    with grpc.insecure_channel(addr) as channel:
        d = admin_pb2_grpc.AdminServiceStub(channel).DescribePartition(
            admin_pb2.DescribePartitionRequest(partition_id="p"),
            timeout=30,
            metadata=[("authorization", f"Bearer {TOKEN}")],
        )
    assert (d.durability, d.checkpointed_samples, d.num_samples) == ("memory", 3, 4)
    assert d.last_checkpoint_at == pytest.approx(last.taken_at)

    manifest = full / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"format": 3', '"format": 1'))
    refused(
        dataplane("checkpoint", "restore", str(full), address=services().admin_address),
        1,
        "FAILED_PRECONDITION",
        "format 1",
    )
