"""Checkpoint and restore of the whole store: a checkpoint restored into a fresh service
gives back every sample bit for bit and every cursor and lease; a damaged or half-written
checkpoint never loads; a path no checkpoint can be saved to or restored from is a typed
error naming it and the reason."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid

import grpc
import pytest
import torch

from dataplane_client.wire.errors import CheckpointError, CorruptPayload, InvalidBatch
from dataplane_server.admin_pb import admin_pb2, admin_pb2_grpc


@pytest.fixture(scope="module")
def service_pair(module_services):
    """Started once for this module (two services cost about 20 s to start here)."""
    config = dict(num_storage_units=2, admin_enabled=False, unit_warm_reserve_bytes=0)
    return [module_services("ckpt", **config) for _ in range(2)]


@pytest.fixture
def two_services(service_pair):
    """A source and a destination holding no partition: the first test gets them fresh,
    the next ones emptied by the one before (restore needs an empty service)."""
    clients = [h.client() for h in service_pair]
    for c in clients:
        assert c.service_info().num_partitions == 0
    yield service_pair
    for c in clients:
        if c.service_info().num_partitions:
            c.delete_partition("p")  # every test here uses one partition, "p"


def _fields(n: int) -> dict:
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(1, 9, (n,), generator=g)
    return {
        "input_ids": [torch.randint(0, 50_000, (int(k),), generator=g) for k in lengths],
        "logprobs": torch.randn(n, 3, generator=g).to(torch.bfloat16),
        "mask": torch.rand(n, generator=g) > 0.5,
    }


def _unit_files(path: str, unit: int) -> list[str]:
    """The files the manifest lists for a unit: its index, then its data segments."""
    manifest = json.loads(open(os.path.join(path, "manifest.json")).read())  # noqa: SIM115
    (entry,) = [u for u in manifest["units"] if u["unit"] == unit]
    return [f["name"] for f in entry["files"]]


def test_restore_into_a_fresh_service_gives_back_every_sample_and_cursor(two_services, tmp_path):
    src, dst = (h.client() for h in two_services)
    ids = [f"s{i}" for i in range(30)]
    src.register_partition(
        "p", ["input_ids", "logprobs", "mask"], 30, ["t", "u"], task_leases={"u": 600.0}
    )
    fields = _fields(30)
    src.put_samples(ids, "p", fields, tags=[{"step": i % 3} for i in range(30)])
    taken = src.claim_meta("p", "t", ["input_ids"], 7).sample_ids
    held = src.claim_meta("p", "u", ["input_ids"], 4)
    created = src.describe_partition("p").created_at
    path = src.checkpoint(str(tmp_path / "ck"))
    assert sorted(os.listdir(path)) == sorted(
        ["manifest.json", "state.msgpack", *_unit_files(path, 0), *_unit_files(path, 1)]
    )
    assert dst.restore(path) == 30
    assert dst.describe_partition("p").created_at == created  # not the restore's time
    got = dst.get_samples(ids, "p", ["input_ids", "logprobs", "mask"])
    for i, row in enumerate(got["input_ids"].unbind()):
        assert torch.equal(row, fields["input_ids"][i])
    assert torch.equal(got["logprobs"].view(torch.int16), fields["logprobs"].view(torch.int16))
    assert torch.equal(got["mask"], fields["mask"])
    rest = dst.claim_meta("p", "t", ["input_ids"], 100, blocking=False)
    assert sorted(rest.sample_ids) == sorted(set(ids) - set(taken))  # cursor kept
    assert rest.tags[0]["step"] == int(rest.sample_ids[0][1:]) % 3  # tags kept
    again = dst.claim_meta("p", "u", ["input_ids"], 100, blocking=False)
    assert set(again.sample_ids) == set(ids) - set(held.sample_ids)  # leases kept
    assert dst.ack(held) == 4  # the restored lease is the same lease
    with pytest.raises(InvalidBatch, match="empty service"):
        dst.restore(path)  # never over live data


def test_groups_dropped_at_their_deadline_stay_dropped_and_counted_after_a_restore(
    two_services, tmp_path
):
    src, dst = (h.client() for h in two_services)
    src.register_partition("p", ["x"], 8, ["t"], grpo_group_size=4, group_deadline_s=0.2)
    for ids, group in ((["a0", "a1", "a2", "a3"], "A"), (["b0", "b1", "b2"], "B")):
        src.put_samples(
            ids, "p", {"x": torch.zeros(len(ids))}, tags=[{"group_id": group}] * len(ids)
        )
    assert src.claim_meta("p", "t", ["x"], 8, timeout_s=20).size == 4  # B dropped
    before = src.describe_partition("p").groups
    assert (before.dropped_groups, before.recently_dropped) == (1, ["b0", "b1", "b2"])
    assert dst.restore(src.checkpoint(str(tmp_path / "ck"))) == 4
    after = dst.describe_partition("p").groups
    assert after == before
    assert dst.describe_partition("p").num_samples == 4


def test_a_damaged_or_half_written_checkpoint_never_loads(two_services, tmp_path):
    src, dst = (h.client() for h in two_services)
    src.register_partition("p", ["x"], None, ["t"])
    src.put_samples(["a", "b"], "p", {"x": torch.arange(2.0)})
    path = src.checkpoint(str(tmp_path / "ck"))
    with pytest.raises(InvalidBatch, match="exists"):
        src.checkpoint(path)  # never overwritten in place
    with open(os.path.join(path, _unit_files(path, 0)[0]), "r+b") as f:  # one flipped byte
        f.seek(10)
        byte = f.read(1)
        f.seek(10)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(CorruptPayload, match="does not match"):
        dst.restore(path)
    assert dst.service_info().num_samples == 0  # nothing of it was kept
    half = tmp_path / "half.tmp-0000"  # what a crash mid-save leaves: no manifest
    half.mkdir()
    with pytest.raises(CorruptPayload, match="manifest"):
        dst.restore(str(half))
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert [u["unit"] for u in manifest["units"]] == [0, 1]


def _bad_save_paths(root) -> dict[str, str]:
    """Paths no checkpoint can be saved to, each with the reason its error must give."""
    regular = root / "file"
    regular.write_text("not a directory")
    dangling = root / "dangling"
    dangling.symlink_to(root / "gone")
    return {
        str(dangling): "dangling symbolic link",
        str(regular / "ck"): f"Not a directory: {regular / 'ck'}.tmp-",
        str(regular / "deeper" / "ck"): f"({regular} is not a directory)",
        f"/proc/dataplane-ck-{uuid.uuid4().hex[:6]}": "No such file or directory",
        # its parent is made first, then the name is refused: the parent goes again
        str(root / "made" / ("x" * 300)): "File name too long",
    }


def test_saving_to_a_bad_path_is_a_typed_error_naming_it(client, tmp_path):
    """A dangling symlink, a path under a regular file or in /proc: CheckpointError (an
    OSError too) naming the path and the OS's reason, and nothing is left behind."""
    cases = _bad_save_paths(tmp_path)
    before = sorted(os.listdir(tmp_path))
    for path, reason in cases.items():
        with pytest.raises(CheckpointError) as info:
            client.checkpoint(path)
        assert type(info.value) is CheckpointError, type(info.value)
        assert isinstance(info.value, OSError)
        message = str(info.value)
        assert f"cannot save a checkpoint to {path}: " in message, message
        assert reason in message, message
        assert "\n" not in message
    assert sorted(os.listdir(tmp_path)) == before  # no partial directory, nothing followed
    assert not os.path.lexists(tmp_path / "gone")


def test_admin_and_cli_say_why_a_save_path_is_bad_in_one_line(service, tmp_path):
    """Over gRPC the typed error is FAILED_PRECONDITION with its message (a NUL byte in the
    path: INVALID_ARGUMENT); the CLI prints that one line and exits 1."""
    path = str(tmp_path / "dangling")
    os.symlink(tmp_path / "gone", path)
    with grpc.insecure_channel(service.admin_address) as channel:
        stub = admin_pb2_grpc.AdminServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.SaveCheckpoint(admin_pb2.SaveCheckpointRequest(directory=path), timeout=60)
        with pytest.raises(grpc.RpcError) as nul:  # no file name holds one
            stub.SaveCheckpoint(admin_pb2.SaveCheckpointRequest(directory=f"{path}\0x"), timeout=60)
    assert nul.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "NUL" in nul.value.details()
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert info.value.details().startswith(f"CheckpointError: cannot save a checkpoint to {path}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DATAPLANE_ADMIN_")}
    env["DATAPLANE_ADMIN_ADDRESS"] = service.admin_address
    cli = subprocess.run(
        [sys.executable, "-m", "dataplane_server", "checkpoint", "save", path],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 1, cli
    assert cli.stderr.strip() == (
        f"dataplane: error: FAILED_PRECONDITION: CheckpointError: cannot save a checkpoint to {path}: "
        f"File exists (a dangling symbolic link to '{tmp_path / 'gone'}'); choose a new path"
    ), cli.stderr
    assert sorted(os.listdir(tmp_path)) == ["dangling"]


def test_restoring_from_a_bad_path_is_a_typed_error(two_services, tmp_path):
    """A missing path, a dangling symlink, a path under a regular file or in /proc, and a
    checkpoint whose unit file is gone or unreadable: CorruptPayload naming the path and
    the reason, and the service stays empty."""
    src, dst = (h.client() for h in two_services)
    src.register_partition("p", ["x"], None, ["t"])
    src.put_samples([f"s{i}" for i in range(8)], "p", {"x": torch.arange(8.0)})
    good = src.checkpoint(str(tmp_path / "ck"))
    regular = tmp_path / "file"
    regular.write_text("not a directory")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    data_1, data_0 = _unit_files(good, 1)[1], _unit_files(good, 0)[1]
    no_unit_file = shutil.copytree(good, tmp_path / "no-unit-file")
    os.remove(os.path.join(no_unit_file, data_1))
    unit_file_a_dir = shutil.copytree(good, tmp_path / "unit-file-a-dir")
    os.remove(os.path.join(unit_file_a_dir, data_0))
    os.mkdir(os.path.join(unit_file_a_dir, data_0))
    cases = {
        str(tmp_path / "missing"): "No such file or directory",
        str(tmp_path / "dangling"): "No such file or directory",
        str(regular / "ck"): "Not a directory",
        f"/proc/dataplane-ck-{uuid.uuid4().hex[:6]}": "No such file or directory",
        str(no_unit_file): f"No such file or directory: '{no_unit_file}/{data_1}'",
        str(unit_file_a_dir): f"Is a directory: '{unit_file_a_dir}/{data_0}'",
    }
    for path, reason in cases.items():
        with pytest.raises(CorruptPayload) as info:
            dst.restore(path)
        assert type(info.value) is CorruptPayload, type(info.value)
        message = str(info.value)
        assert path in message, message
        assert reason in message, message
        assert dst.service_info().num_samples == 0
    assert dst.restore(good) == 8  # the service is still fit for a good one
