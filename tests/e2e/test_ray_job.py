"""`ray job submit` against a separate local Ray head runs the service as a job.

The recipe of deploy/ray_job_submit.md, end to end: a head with its dashboard
on 127.0.0.1, the service submitted as `python -m dataplane_server serve
--config FILE` with deploy/runtime_env.yaml (the repo as working_dir), a gRPC client reaching the admin
endpoint, then `ray job stop` (SIGTERM: drain, shutdown) and the head torn down.

The head runs as `ray start --head --block` in its own process group, and only
that group is stopped at the end: `ray stop` would kill every Ray on the
machine, other people's test clusters included. The head is stopped as its own
`ray start` stops it (SIGTERM to that process, which takes its processes down in
order), without the node drain Ray does first for Serve: nothing here asserts on
the teardown, and the drain alone took 30 s of every CI run. Its --temp-dir keeps the
"latest cluster" address file away from the default one, so a plain
`ray.init()` elsewhere never attaches to this head.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ray_heads import RAY, free_ports, ray_env, read, stop_group

from dataplane_server.admin_pb import admin_pb2, admin_pb2_grpc

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
HEAD_START_S = 180
JOB_START_S = 240


def http_json(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read().decode())


def poll(what: str, check, deadline_s: float, every_s: float = 0.5):
    """Call check() until it returns something truthy; fail with `what` at the deadline."""
    deadline = time.monotonic() + deadline_s
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {deadline_s}s waiting for {what}")
        time.sleep(every_s)  # poll interval


@pytest.fixture
def ray_head():
    gcs, dash, client_port, agent = free_ports(4)
    temp_dir = tempfile.mkdtemp(prefix="rj", dir="/tmp")  # short: Ray puts sockets in it
    log = open(Path(temp_dir) / "head.log", "w")  # noqa: SIM115 - closed in teardown
    head = subprocess.Popen(
        [
            RAY,
            "start",
            "--head",
            "--block",
            f"--port={gcs}",
            "--node-ip-address=127.0.0.1",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dash}",
            f"--ray-client-server-port={client_port}",
            f"--dashboard-agent-listen-port={agent}",
            "--num-cpus=4",
            f"--temp-dir={temp_dir}",
            "--disable-usage-stats",
        ],
        # No drain before the head's own shutdown: it waits up to 30 s for a Serve
        # proxy to quiesce, and this head serves nothing when it is stopped.
        env=ray_env({"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: torn down by group id below
    )
    dashboard = f"http://127.0.0.1:{dash}"

    def up():
        if head.poll() is not None:
            pytest.fail(f"ray start exited with {head.returncode}:\n{read(log.name)}")
        try:
            return http_json(f"{dashboard}/api/version")
        except (urllib.error.URLError, OSError, ValueError):
            return None

    try:
        poll("the Ray head's dashboard", up, HEAD_START_S)
        yield dashboard
    finally:
        stop_group(head, grace_s=45)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def ray_cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [RAY, *args], cwd=REPO, env=ray_env(), capture_output=True, text=True, timeout=timeout
    )


def documented_log_start() -> list[re.Pattern]:
    """deploy/ray_job_submit.md's job-log excerpt, one pattern per line: names in quotes
    and HOST:PORT addresses stand for any (the test's service has its own)."""
    text = (REPO / "deploy/ray_job_submit.md").read_text()
    after = text[text.index("The job log starts with") :]
    block = after[after.index("```text\n") + 8 : after.index("```", after.index("```text") + 7)]
    patterns = []
    for line in block.strip().splitlines():
        pattern = re.escape(line)
        pattern = re.sub(r"'[^']*'", "'[^']*'", pattern)
        pattern = re.sub(r"(?:\d+\\\.){3}\d+:\d+", r"[0-9.]+:\\d+", pattern)
        patterns.append(re.compile(pattern + "$"))
    return patterns


def assert_log_starts_as_documented(log: str) -> None:
    lines = [line for line in log.splitlines() if not re.match(r"^\d{4}-\d\d-\d\d ", line)]
    patterns = documented_log_start()
    assert len(patterns) >= 4, patterns
    starts = [i for i, line in enumerate(lines) if patterns[0].match(line)]
    assert starts, f"no line like {patterns[0].pattern} in the job log:\n{log}"
    got = lines[starts[0] : starts[0] + len(patterns)]
    assert len(got) == len(patterns), f"the job log ends early:\n{log}"
    wrong = [(p.pattern, line) for p, line in zip(patterns, got) if not p.match(line)]
    assert wrong == [], f"the job log starts otherwise than deploy/ray_job_submit.md shows:\n{log}"


def test_service_runs_as_a_ray_job(ray_head, tmp_path):
    admin_port, metrics_port = free_ports(2)
    name = f"job-{uuid.uuid4().hex[:6]}"
    config = tmp_path / "dataplane.yaml"
    config.write_text(
        f"name: {name}\n"
        "namespace: dataplane-job-test\n"
        "num_storage_units: 2\n"
        "unit_capacity_bytes: 67108864\n"
        "admin_host: 127.0.0.1\n"
        f"admin_port: {admin_port}\n"
        "metrics_host: 127.0.0.1\n"
        f"metrics_port: {metrics_port}\n"
        "drain_timeout_s: 5\n"
    )
    job_id = f"dataplane-{uuid.uuid4().hex[:8]}"
    submitted = ray_cli(
        "job",
        "submit",
        "--address",
        ray_head,
        "--submission-id",
        job_id,
        "--runtime-env",
        "deploy/runtime_env.yaml",  # working_dir: . (the recipe's own file)
        "--no-wait",
        "--",
        sys.executable,
        "-m",
        "dataplane_server",
        "serve",
        "--config",
        str(config),
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr

    def job():
        return http_json(f"{ray_head}/api/jobs/{job_id}")

    def logs() -> str:
        try:
            return http_json(f"{ray_head}/api/jobs/{job_id}/logs").get("logs", "")
        except (urllib.error.URLError, OSError, ValueError):
            return ""

    address = f"127.0.0.1:{admin_port}"
    channel = grpc.insecure_channel(address)
    health = health_pb2_grpc.HealthStub(channel)

    def serving():
        status = job()["status"]
        if status in ("FAILED", "STOPPED", "SUCCEEDED"):
            pytest.fail(f"the job ended early ({status}):\n{logs()}")
        try:
            got = health.Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError:
            return False
        return got.status == health_pb2.HealthCheckResponse.SERVING

    try:
        poll("the admin endpoint of the job to report SERVING", serving, JOB_START_S)
        assert f"admin_address={address}" in logs()
        assert_log_starts_as_documented(logs())

        info = admin_pb2_grpc.AdminServiceStub(channel).GetServiceInfo(
            admin_pb2.GetServiceInfoRequest(), timeout=10
        )
        assert (info.name, info.namespace) == (name, "dataplane-job-test")
        assert len(info.units) == 2
        assert all(u.alive for u in info.units)
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
            assert b"dataplane_up 1.0" in r.read()

        stopped = ray_cli("job", "stop", "--address", ray_head, job_id)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        poll("the job to stop", lambda: job()["status"] == "STOPPED", 120)
        # SIGTERM took the graceful path: drain, then shutdown, inside the grace period.
        poll("the drain messages in the job log", lambda: "dataplane: stopped" in logs(), 30)
        assert "signal received, draining" in logs()
        with pytest.raises(grpc.RpcError) as gone:
            health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert gone.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    finally:
        channel.close()
        if job()["status"] not in ("STOPPED", "FAILED", "SUCCEEDED"):
            ray_cli("job", "stop", "--address", ray_head, job_id, timeout=120)
