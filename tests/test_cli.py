"""The `dataplane` CLI, run as a subprocess against the live service's admin endpoint.

Tables for people, `--json` for scripts, and one clear line plus a distinct
exit code when the endpoint is unreachable (3) or refuses the token (4).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from dataplane_client.config import DataPlaneConfig

REPO = Path(__file__).resolve().parents[1]
TOKEN = "cli-token"


def dataplane(*args: str, address: str | None = None, timeout: float = 60):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DATAPLANE_ADMIN_")}
    if address:
        env["DATAPLANE_ADMIN_ADDRESS"] = address
    return subprocess.run(
        [sys.executable, "-m", "dataplane_server", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def ok(proc) -> str:
    assert proc.returncode == 0, (
        f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    )
    return proc.stdout


@pytest.fixture(scope="module")
def addr(service):
    return service.admin_address


@pytest.fixture(scope="module")
def part(client):
    """5 samples: 4 with both fields, 1 still missing "score"."""
    pid = f"cli-{uuid.uuid4().hex[:8]}"
    client.register_partition(pid, fields=["input_ids", "score"], consumer_tasks=["train"])
    client.put_samples(
        ["a", "b", "c", "d"],
        pid,
        {
            "input_ids": [torch.arange(5 + i, dtype=torch.int64) for i in range(4)],
            "score": torch.tensor([0.25, 0.5, 0.75, 1.0]),
        },
        tags=[{"step": 7}] * 4,
    )
    client.put_samples(["e"], pid, {"input_ids": [torch.arange(3)]})
    return pid


def test_status_table_and_json(addr, service):
    out = ok(dataplane("status", "--address", addr))
    assert service.config.name in out
    assert "UNIT" in out
    assert "NODE_IP" in out
    assert "CAPACITY" in out
    info = json.loads(ok(dataplane("status", "--json", address=addr)))  # address from the env
    assert info["name"] == service.config.name
    assert [u["index"] for u in info["units"]] == [0, 1]
    assert isinstance(info["capacity_bytes"], int)  # int64 stays a number in --json


def test_partitions_and_describe(addr, part):
    table = ok(dataplane("partitions", "--address", addr))
    assert "PARTITION" in table
    assert part in table
    rows = json.loads(ok(dataplane("partitions", "--json", "--address", addr)))
    (row,) = [r for r in rows if r["partition_id"] == part]
    assert row["num_samples"] == 5
    assert row["consumer_tasks"] == ["train"]

    table = ok(dataplane("describe", part, "--address", addr))
    assert "FIELD" in table
    assert "jagged" in table
    assert "dense" in table
    d = json.loads(ok(dataplane("describe", part, "--json", "--address", addr)))
    fields = {f["name"]: f for f in d["fields"]}
    assert fields["input_ids"]["layout"] == "jagged"
    assert fields["input_ids"]["dtype"] == "int64"
    assert (fields["input_ids"]["produced"], fields["score"]["produced"]) == (5, 4)
    assert d["expected_samples"] is None
    assert d["consumption"] == [{"task": "train", "consumed": 0}]


def test_samples_paging_and_status_filter(addr, part):
    first = json.loads(
        ok(dataplane("samples", part, "--page-size", "3", "--json", "--address", addr))
    )
    assert first["total"] == 5
    assert len(first["samples"]) == 3
    assert first["next_page_token"]
    table = ok(
        dataplane(
            "samples",
            part,
            "--page-size",
            "3",
            "--page-token",
            first["next_page_token"],
            "--address",
            addr,
        )
    )
    assert "SAMPLE_ID" in table
    assert "2 shown, 5 in all" in table
    assert "next page" not in table
    seen = {s["sample_id"] for s in first["samples"]}
    assert seen | {line.split()[0] for line in table.splitlines()[1:3]} == set("abcde")
    pending = json.loads(
        ok(dataplane("samples", part, "--status", "pending", "--json", "--address", addr))
    )
    assert [s["sample_id"] for s in pending["samples"]] == ["e"]


def test_sample_preview(addr, part):
    out = ok(dataplane("sample", part, "c", "--max-elems", "3", "--address", addr))
    assert "input_ids" in out
    assert "0,1,2 ..." in out
    assert '"step": 7' in out
    got = json.loads(ok(dataplane("sample", part, "c", "--json", "--address", addr)))
    previews = {p["name"]: p for p in got["previews"]}
    assert previews["input_ids"]["values"] == [0, 1, 2, 3, 4, 5, 6]
    assert previews["score"]["values"] == [0.75]
    assert got["sample"]["tags"] == {"step": 7}


def test_watch_json_lines(addr, part):
    out = ok(dataplane("watch", "--interval", "0.05", "--count", "2", "--json", "--address", addr))
    snaps = [json.loads(line) for line in out.splitlines()]
    assert len(snaps) == 2
    assert any(p["partition_id"] == part for p in snaps[-1]["partitions"])
    assert snaps[-1]["put_bytes_total"] > 0


def test_clear(addr, client):
    pid = f"cli-clear-{uuid.uuid4().hex[:8]}"
    client.register_partition(pid, fields=["x"])
    client.put_samples(["a", "b"], pid, {"x": torch.ones(2, 8)})
    out = ok(dataplane("clear", pid, "--address", addr))
    assert out.strip() == f"cleared partition {pid} (2 samples)"
    assert client.describe_partition(pid)["num_samples"] == 0


def test_unknown_partition_is_a_one_line_error(addr):
    proc = dataplane("describe", "no-such-partition", "--address", addr)
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1
    assert "NOT_FOUND" in proc.stderr
    assert "no-such-partition" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unreachable_endpoint(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nothing listens there
    proc = dataplane("status", "--address", f"127.0.0.1:{port}", "--timeout", "2", timeout=30)
    assert proc.returncode == 3
    assert proc.stderr.startswith("dataplane: error: cannot reach the admin endpoint")
    assert proc.stderr.count("\n") == 1
    assert proc.stdout == ""


def test_wrong_or_missing_token(service, client):
    from dataplane_server.admin.server import AdminServer
    from dataplane_server.admin.sources import ActorSources

    cfg = DataPlaneConfig(
        name=service.config.name, namespace=service.config.namespace, admin_token=TOKEN
    )
    server = AdminServer(cfg, ActorSources(cfg.name, cfg.namespace))
    server.start()
    pid = f"cli-auth-{uuid.uuid4().hex[:8]}"
    client.register_partition(pid, fields=["x"])
    client.put_samples(["a"], pid, {"x": torch.ones(1, 2)})
    try:
        proc = dataplane("clear", pid, "--token", "wrong", "--address", server.address)
        assert proc.returncode == 4
        assert "refused the token" in proc.stderr
        assert proc.stderr.count("\n") == 1
        assert client.describe_partition(pid)["num_samples"] == 1
        got = json.loads(
            ok(dataplane("clear", pid, "--token", TOKEN, "--json", "--address", server.address))
        )
        assert got["cleared_samples"] == 1
    finally:
        server.stop(grace_s=0)


def test_no_address_given():
    proc = dataplane("partitions")
    assert proc.returncode == 1
    assert "DATAPLANE_ADMIN_ADDRESS" in proc.stderr
