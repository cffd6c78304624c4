"""The `dataplane` CLI, run as a subprocess against the live service's admin endpoint.

Tables for people, `--json` for scripts, and one clear line plus a distinct
exit code when the endpoint is unreachable or a watch stream drops (3) or the
token is missing or wrong (4). Usage errors and the parts that need no service
are in test_cli_usage.py.
"""

from __future__ import annotations

import json
import os
import queue
import re
import socket
import subprocess
import sys
import threading
import urllib.request
import uuid
from pathlib import Path

import pytest
import torch
from cli_run import run_dataplane
from prometheus_client.parser import text_string_to_metric_families

from dataplane_client.wire.errors import UnknownPartition

REPO = Path(__file__).resolve().parents[2]
TOKEN = "cli-token"


def dataplane(*args: str, address: str | None = None, timeout: float = 60):
    env = {"DATAPLANE_ADMIN_ADDRESS": address} if address else None
    return run_dataplane(*args, env=env, timeout=timeout)


class LineReader:
    """Lines of a child's pipe with a deadline per line (a thread does the blocking reads)."""

    def __init__(self, pipe):
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, args=(pipe,), daemon=True).start()

    def _pump(self, pipe) -> None:
        for line in pipe:
            self._lines.put(line)
        self._lines.put("")  # end of stream

    def next(self, timeout_s: float) -> str:
        try:
            return self._lines.get(timeout=timeout_s)
        except queue.Empty:
            pytest.fail(f"no line from the child within {timeout_s}s")


def ok(proc) -> str:
    assert proc.returncode == 0, (
        f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    )
    return proc.stdout


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
    assert "durability memory" in out  # the level, and no state directory at memory
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
    (train,) = d["consumption"]
    assert (train["task"], train["consumed"], train["total"], train["done"]) == (
        "train",
        0,
        5,
        False,
    )
    assert (train["lease_s"], train["leased"], train["redeliveries"]) == (None, 0, 0)


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


def test_samples_shows_leased_samples_as_leased_with_their_holder(addr, client):
    """Claimed under a lease and not acknowledged: `samples` listed them as ready, with no
    holder; they are leased, by the claim that holds them, until acknowledged."""
    pid = f"cli-lease-{uuid.uuid4().hex[:8]}"
    client.register_partition(
        pid, fields=["x"], consumer_tasks=["train"], task_leases={"train": 600.0}
    )
    client.put_samples(["a", "b", "c"], pid, {"x": torch.zeros(3, 2)})
    held = client.claim_meta(pid, "train", ["x"], 2)
    lease = held.extra_info["lease_id"]

    def listed(*status: str) -> dict[str, dict]:
        page = json.loads(ok(dataplane("samples", pid, *status, "--json", "--address", addr)))
        return {s["sample_id"]: s for s in page["samples"]}

    every = listed()
    for sid in held.sample_ids:
        assert every[sid]["status"] == "leased"
        assert every[sid]["leased_by"] == {"train": lease}
    (free,) = set("abc") - set(held.sample_ids)
    assert (every[free]["status"], every[free]["leased_by"]) == ("ready", {})
    assert set(listed("--status", "ready")) == {free}
    assert set(listed("--status", "leased")) == set(held.sample_ids)
    table = ok(dataplane("samples", pid, "--address", addr))
    assert "STATUS" in table.splitlines()[0]
    assert "HELD_BY" in table.splitlines()[0]
    row = next(line for line in table.splitlines() if line.startswith(held.sample_ids[0]))
    assert "leased" in row
    assert f"train:{lease}" in row
    one = ok(dataplane("sample", pid, held.sample_ids[0], "--address", addr))
    assert f"leased (train: lease {lease})" in one
    client.ack(held)
    after = listed()
    assert {every_id: s["status"] for every_id, s in after.items()} == {
        **dict.fromkeys(held.sample_ids, "consumed"),
        free: "ready",
    }


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


def test_clear_ids_then_the_whole_partition(addr, client):
    pid = f"cli-clear-{uuid.uuid4().hex[:8]}"
    client.register_partition(pid, fields=["x"])
    client.put_samples(["a", "b", "c"], pid, {"x": torch.ones(3, 8)})
    out = ok(dataplane("clear", pid, "a", "--address", addr))
    assert out.strip() == f"cleared partition {pid} (1 samples)"
    assert client.describe_partition(pid).num_samples == 2
    out = ok(dataplane("clear", pid, "--address", addr))
    assert out.strip() == f"cleared partition {pid} (2 samples)"
    # Clearing a whole partition deletes it (the contract of clear_samples(None, p)).
    with pytest.raises(UnknownPartition):
        client.describe_partition(pid)


def test_delete(addr, client):
    pid = f"cli-delete-{uuid.uuid4().hex[:8]}"
    client.register_partition(pid, fields=["x"])
    client.put_samples(["a", "b"], pid, {"x": torch.ones(2, 8)})
    out = ok(dataplane("delete", pid, "--address", addr))
    assert out.startswith(f"deleted partition {pid} (2 samples, ")
    assert out.rstrip().endswith("freed)")
    with pytest.raises(UnknownPartition):
        client.describe_partition(pid)
    again = dataplane("delete", pid, "--address", addr)
    assert again.returncode == 1
    assert "NOT_FOUND" in again.stderr
    assert pid in again.stderr


def test_watch_table_fits_80_columns_and_shows_rates(addr, part):
    out = ok(dataplane("watch", "--interval", "0.2", "--count", "3", "--address", addr))
    lines = out.splitlines()
    assert len(lines) == 4
    assert max(len(line) for line in lines) <= 80, lines
    assert lines[0].split() == [
        "TIME",
        "SAMPLES",
        "STORED",
        "PUT/s",
        "GET/s",
        "REQ/s",
        "PUTQ",
        "WAIT",
        "ERR/s",
    ]
    # The four rates (PUT/s, GET/s, REQ/s, ERR/s) need two snapshots: "-" on the first line.
    assert lines[1].split().count("-") == 4
    assert lines[2].split().count("-") == 0
    assert lines[3].split().count("-") == 0


def test_watch_exits_3_when_the_stream_drops(admin_server):
    server = admin_server()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DATAPLANE_ADMIN_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "dataplane_server", "watch", "--interval", "0.1"]
        + ["--address", server.address],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = LineReader(proc.stdout)
    try:
        assert lines.next(timeout_s=60).startswith("TIME")
        assert lines.next(timeout_s=60).strip()  # a first snapshot: the stream is up
        server.stop(grace_s=5)
        rc = proc.wait(timeout=60)
        stderr = proc.stderr.read()
        assert rc == 3, stderr
        assert stderr.startswith("dataplane: error: the watch stream from")
        assert stderr.count("\n") == 1
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()


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


def test_wrong_or_missing_token(client, admin_server):
    server = admin_server(admin_token=TOKEN)
    pid = f"cli-auth-{uuid.uuid4().hex[:8]}"
    client.register_partition(pid, fields=["x"])
    client.put_samples(["a"], pid, {"x": torch.ones(1, 2)})
    at = ("--address", server.address)
    # Service info holds no sample data: it answers without the token (the stored
    # bytes come from the partitions, a guarded read: the token shows them).
    assert "? (needs the token) stored" in ok(dataplane("status", *at))
    tokenless = json.loads(ok(dataplane("status", "--json", *at)))
    assert tokenless["stored_bytes"] is None
    assert tokenless["allocated_bytes"] == tokenless["bytes"]
    for command in (["partitions"], ["samples", pid], ["sample", pid, "a"], ["clear", pid]):
        for token in ([], ["--token", "wrong"]):
            proc = dataplane(*command, *token, *at)
            assert proc.returncode == 4, (command, token, proc.stderr)
            assert "refused the token" in proc.stderr
            assert proc.stderr.count("\n") == 1
    assert client.describe_partition(pid).num_samples == 1
    got = json.loads(ok(dataplane("clear", pid, "--token", TOKEN, "--json", *at)))
    assert got["cleared_samples"] == 1


def test_no_address_given():
    proc = dataplane("partitions")
    assert proc.returncode == 2
    assert "DATAPLANE_ADMIN_ADDRESS" in proc.stderr


def test_describe_shows_a_versioned_partitions_async_rl_state(addr, client):
    from dataplane_client import StalenessSpec

    pid = f"cli-async-{uuid.uuid4().hex[:8]}"
    spec = StalenessSpec(max_staleness={"train": 1}, admission_batch=4)
    client.register_partition(pid, fields=["x"], consumer_tasks=["train"], staleness=spec)
    for v in range(3):
        client.put_samples([f"v{v}"], pid, {"x": torch.zeros(1)}, tags=[{"weight_version": v}])
    client.set_policy_version(pid, 2)
    assert client.admit_rollouts(pid, 3) is not None
    client.append_tokens(["p0"], pid, {"tokens": [torch.arange(3)]}, 2, start=True)
    out = ok(dataplane("describe", pid, "--address", addr))
    assert "policy version  2 (tag weight_version)" in out
    assert "dropped stale   train: 1; evicted 0" in out
    assert "3 granted in flight (1 grants), 3 untrained, bound 8" in out
    assert "partial         1 rollouts in progress" in out
    d = json.loads(ok(dataplane("describe", pid, "--json", "--address", addr)))
    st = d["staleness"]
    assert (st["version"], st["dropped_stale"], st["recently_dropped"]) == (2, {"train": 1}, ["v0"])
    assert {int(v): n for v, n in st["ready_by_version"].items()} == {1: 1, 2: 2}
    assert st["partial_in_progress"] == 1
    plain = json.loads(ok(dataplane("describe", "--json", "--address", addr, part_of(client))))
    assert plain.get("staleness") is None


def part_of(client):
    """A partition registered without versions (describe shows no async-RL state)."""
    pid = f"cli-plain-{uuid.uuid4().hex[:8]}"
    client.register_partition(pid, fields=["x"], consumer_tasks=["train"])
    return pid


def test_status_partitions_watch_and_metrics_agree_on_stored_bytes(addr, part, service):
    """One definition: "stored" is the samples' own bytes, everywhere; "allocated" (the
    units' whole chunks, what capacity limits) is a second, labelled figure. status once
    said 4.0 MiB where partitions and watch said 320 B, unlabelled."""
    from dataplane_server.cli.render import human_bytes

    parts = json.loads(ok(dataplane("partitions", "--json", "--address", addr)))
    stored = sum(p["bytes"] for p in parts)
    info = json.loads(ok(dataplane("status", "--json", "--address", addr)))
    allocated = info["bytes"]
    assert 0 < stored <= allocated
    # --json names both figures (it once had only the allocated one, as "bytes")
    assert (info["stored_bytes"], info["allocated_bytes"]) == (stored, allocated)
    status = ok(dataplane("status", "--address", addr))
    holds = next(line for line in status.splitlines() if line.startswith("holds"))
    assert f"{human_bytes(stored)} stored, {human_bytes(allocated)} allocated" in holds
    assert "ALLOCATED" in status  # the unit table's column
    assert "STORED" in ok(dataplane("partitions", "--address", addr)).splitlines()[0]
    [snapshot] = [
        json.loads(line)
        for line in ok(dataplane("watch", "--json", "--count", "1", "--address", addr)).splitlines()
    ]
    assert int(snapshot["bytes"]) == stored
    scrape = urllib.request.urlopen(f"http://{service.metrics_address}/metrics", timeout=10)
    families = {f.name: f for f in text_string_to_metric_families(scrape.read().decode())}
    assert sum(s.value for s in families["dataplane_partition_stored_bytes"].samples) == stored
    assert sum(s.value for s in families["dataplane_unit_stored_bytes"].samples) == stored
    assert sum(s.value for s in families["dataplane_unit_allocated_bytes"].samples) == allocated


def test_a_reader_that_goes_away_ends_the_cli_quietly(addr, part):
    """`dataplane status | head -3`: the reader closes the pipe; the CLI ends without a
    BrokenPipeError traceback, with the shell's exit code for SIGPIPE (128 + 13). The
    read end is closed before the child writes, so its first write meets a closed pipe."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DATAPLANE_ADMIN_")}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "dataplane_server", "status", "--address", addr],
            cwd=REPO,
            env=env,
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert proc.returncode == 141, proc.stderr
    assert proc.stderr == ""


def test_status_and_metrics_show_the_path_cross_node_readers_chose(addr, service):
    """A reader's capability probe reports its choice to each unit it reaches across nodes:
    here the probe of a process that sees both units on another node and is told to use
    Ray (``cross_node_transport: "ray"``): status names the path and why, per unit, and so
    does ``dataplane_payload_path_choices_total``."""
    import ray
    from polling import wait_until

    from dataplane_client.transport.payload import probe
    from dataplane_server.admin.sources import ActorSources

    units = ActorSources(service.config.name, "dataplane").units()
    reason = "cross_node_transport is 'ray'"
    paths = probe.choose(units, ["elsewhere"] * 2, [False] * 2, [True] * 2, "here", "ray")
    assert [(p.backend, p.detail) for p in paths] == [("ray", reason)] * 2
    ray.get([u.ping.remote() for u in units])  # the reports (not awaited) arrived before

    def chosen() -> list:
        info = json.loads(ok(dataplane("status", "--json", "--address", addr)))
        return [u["payload_paths"] for u in info["units"]]

    wait_until(lambda: all(chosen()), timeout_s=30, what="both units to show the choice")
    for per_unit in chosen():
        assert {(p["path"], p["detail"]) for p in per_unit} == {("ray", reason)}
        assert per_unit[0]["readers"] >= 1
    text = ok(dataplane("status", "--address", addr))
    assert re.search(r"^  unit 0: ray x\d+  \(cross_node_transport is 'ray'\)$", text, re.M), text
    scrape = urllib.request.urlopen(f"http://{service.metrics_address}/metrics", timeout=10)
    families = {f.name: f for f in text_string_to_metric_families(scrape.read().decode())}
    samples = families["dataplane_payload_path_choices"].samples
    got = {(s.labels["unit"], s.labels["path"], s.labels["reason"]) for s in samples}
    assert got == {("0", "ray", reason), ("1", "ray", reason)}
