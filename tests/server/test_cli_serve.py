"""`dataplane serve` as an operator runs it: embedded Ray, discovery, drain on SIGTERM.

What it prints must be enough to connect: the Ray address, the admin and
metrics endpoints, and a snippet that is pasted, as printed, into another
process here (whose environment knows nothing: no RAY_AUTH_MODE, no loopback
setting) and puts, claims and reads back. Ray 2.60 turns token auth on for a new
local cluster; the snippet sets RAY_AUTH_MODE=token itself. The embedded Ray is on
127.0.0.1: its node IP, and every socket its processes listen on (read with
``ss -ltnp``), except the GCS port, which Ray 2.60 binds on every interface (the
documented exception, deploy/README.md). With ``drain_checkpoint_dir`` set, SIGTERM
ends in a whole checkpoint holding what the pasted snippet wrote. With ``--address``
it joins a head on 127.0.0.1 on loopback, or ends as one error line within
``--timeout``.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import crc32c
import pytest
from polling import wait_until
from ray_heads import RAY, free_ports, ray_env, read, stop_group
from serve_process import REPO, START_S, process_tree, read_snippet, read_until, start_serve

from dataplane_server.core import checkpoint

pytestmark = pytest.mark.slow

# How ss writes a loopback listener: IPv4, IPv4-mapped IPv6 (gRPC's), IPv6.
LOOPBACK = {"127.0.0.1", "[::ffff:127.0.0.1]", "[::1]"}


def _assert_checkpoint_holds(path: str, partition: str, samples: int) -> None:
    """A whole, loadable checkpoint: manifest and state verified, unit files as listed."""
    files, state = checkpoint.read(path)
    assert os.path.basename(path).startswith("drain-")
    for f in files:
        data = (Path(path) / f.name).read_bytes()
        assert f"crc32c:{crc32c.crc32c(data):08x}" == f.digest  # computed apart from the code
    assert sum(f.nbytes for f in files) >= samples * 4 * 4  # the float32 rows at least
    assert partition in state  # the state is keyed by partition id


def listening_sockets(pids: set[int]) -> list[tuple[str, str]]:
    """``(local address, process name)`` of every TCP socket ``pids`` listen on (ss -ltnp)."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = []
    for row in out.splitlines():
        cols = row.split()
        for name, pid in re.findall(r'\("([^"]+)",pid=(\d+)', row):
            if int(pid) in pids:
                found.append((cols[3], name))
    return found


PASTED_WORK = """
import torch
client.register_partition('kept', fields=['x'], consumer_tasks=['t'])
client.put_samples(['a', 'b'], 'kept', {'x': torch.arange(8.0).reshape(2, 4)})
meta = client.claim_meta('kept', 't', ['x'], 2)
print(sorted(meta.sample_ids), client.get_data(meta)['x'].sum().item())
print(client.service_info().name)
"""


def test_serve_prints_a_snippet_that_connects_and_drains_on_sigterm(tmp_path):
    name = f"serve-{uuid.uuid4().hex[:6]}"
    config = tmp_path / "dataplane.yaml"
    config.write_text(
        f"name: {name}\nnamespace: serve-test\nunit_capacity_bytes: 64MiB\n"
        "unit_warm_reserve_bytes: 0\ndrain_timeout_s: 2\n"
        f"drain_checkpoint_dir: {tmp_path / 'drained'}\n"
    )
    # Nothing of the test session's Ray settings: serve must keep to loopback on its own.
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(
            ("DATAPLANE_", "RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
        )
    }
    serve, lines = start_serve(config, ["--num-cpus", "4"], env)
    seen: list[str] = []
    try:
        ray_address = read_until(lines, "ray_address=", seen).split("=", 1)[1]
        assert ray_address.startswith("127.0.0.1:")  # the embedded Ray is on loopback
        assert read_until(lines, "admin_address=", seen).startswith("admin_address=127.0.0.1:")
        snippet = read_snippet(lines, seen)
        assert f'address="{ray_address}"' in snippet[-1]
        assert 'os.environ["RAY_AUTH_MODE"] = "token"  # before ray is imported' in snippet

        # Every socket of this Ray's processes is on 127.0.0.1 but the GCS port.
        sockets = listening_sockets(process_tree(serve.pid))
        assert {name for _, name in sockets} >= {"gcs_server", "raylet"}, sockets
        gcs_port = ray_address.rsplit(":", 1)[1]
        elsewhere = [
            (address, name)
            for address, name in sockets
            if address.rsplit(":", 1)[0] not in LOOPBACK and address.rsplit(":", 1)[1] != gcs_port
        ]
        assert elsewhere == [], f"listening beyond loopback: {elsewhere}"

        # The snippet, pasted as printed, in a process that knows nothing else: it puts,
        # claims and reads back. The drain checkpoint must then hold the two samples.
        pasted = subprocess.run(
            [sys.executable, "-c", "\n".join(snippet) + PASTED_WORK],
            cwd=tmp_path,  # not the repo: nothing but the installed package
            env=env,
            capture_output=True,
            text=True,
            timeout=START_S,
        )
        assert pasted.returncode == 0, pasted.stderr[-3000:]
        assert pasted.stdout.strip().splitlines()[-2:] == ["['a', 'b'] 28.0", name]

        serve.send_signal(signal.SIGTERM)
        read_until(lines, "dataplane: signal received, draining", seen)
        saved = read_until(lines, "dataplane: drain checkpoint saved to ", seen).split(" to ", 1)
        read_until(lines, "dataplane: stopped", seen)
        assert serve.wait(timeout=120) == 0
        _assert_checkpoint_holds(saved[1], partition="kept", samples=2)
    finally:
        if serve.poll() is None:
            serve.kill()
        serve.wait()
        serve.stdout.close()


# ------------------------------------------ serve --address: joining a cluster, or not
# A head on 127.0.0.1 (what another `serve`, or `ray start --node-ip-address
# 127.0.0.1`, runs) is joined on loopback, its address given or found by `auto`; an
# address that cannot be joined is one `dataplane: error` line naming it, exit 1, within
# --timeout, and a SIGTERM during the join ends it at once. Ray used to replace
# 127.0.0.1 with the machine's address and retry for minutes, printing nothing of ours.
JOIN_S = 60  # serving on a joined head takes seconds; the old code never got there
FAIL_S = 30  # a failure is seconds (Python and Ray's import); the old code hung


@pytest.fixture(scope="module")
def loopback_head():
    """A Ray head on 127.0.0.1 for this module (test_ray_job's way: ``ray start --head
    --block`` in its own process group, its own --temp-dir); its GCS address."""
    gcs, client_server, agent = free_ports(3)
    temp_dir = tempfile.mkdtemp(prefix="rs", dir="/tmp")  # short: Ray puts sockets in it
    log = Path(temp_dir) / "head.log"
    with open(log, "w") as out:
        head = subprocess.Popen(
            [RAY, "start", "--head", "--block", f"--port={gcs}", "--node-ip-address=127.0.0.1"]
            + ["--include-dashboard=false", f"--ray-client-server-port={client_server}"]
            + [f"--dashboard-agent-listen-port={agent}", "--num-cpus=4"]
            + [f"--temp-dir={temp_dir}", "--disable-usage-stats"],
            env=ray_env({"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, stopped as one below
        )

    def started() -> bool:
        if head.poll() is not None:
            pytest.fail(f"ray start exited with {head.returncode}:\n{read(str(log))}")
        return "Ray runtime started" in read(str(log))

    try:
        wait_until(started, START_S, "the Ray head to start", interval_s=0.2)
        yield f"127.0.0.1:{gcs}"
    finally:
        stop_group(head, grace_s=45)
        shutil.rmtree(temp_dir, ignore_errors=True)


def serve_env(**extra: str) -> dict:
    """Nothing of this session's Ray settings (serve must keep to loopback on its own);
    no token auth, as the test head has none."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DATAPLANE_", "RAY_ADDRESS", "RAY_AUTH", "RAY_ENABLE_WINDOWS"))
    }
    return {**env, "RAY_AUTH_MODE": "disabled", **extra}


def serve_config(tmp_path, name: str) -> Path:
    config = tmp_path / "dataplane.yaml"
    config.write_text(
        f"name: {name}\nnamespace: serve-join-test\nunit_capacity_bytes: 64MiB\n"
        "unit_warm_reserve_bytes: 0\ndrain_timeout_s: 1\nadmin_port: 0\nmetrics_port: 0\n"
    )
    return config


@pytest.mark.parametrize("how", ["address", "auto"])
def test_serve_joins_a_loopback_head(loopback_head, tmp_path, how):
    args, env = ["--address", loopback_head], serve_env()
    if how == "auto":  # found as Ray finds it: RAY_ADDRESS first
        args, env = ["--address", "auto"], serve_env(RAY_ADDRESS=loopback_head)
    config = serve_config(tmp_path, f"join-{how}-{uuid.uuid4().hex[:6]}")
    serve, lines = start_serve(config, args, env)
    seen: list[str] = []
    try:
        deadline = time.monotonic() + JOIN_S
        read_until(lines, "dataplane: serving", seen, deadline)
        assert read_until(lines, "ray_address=", seen, deadline) == f"ray_address={loopback_head}"
        serve.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        read_until(lines, "dataplane: stopped", seen, stopped + FAIL_S)
        assert serve.wait(timeout=FAIL_S) == 0
        assert time.monotonic() - stopped < FAIL_S
        assert not [line for line in seen if "dataplane: error" in line], seen
    finally:
        if serve.poll() is None:
            serve.kill()
        serve.wait()
        serve.stdout.close()


def serve_refused(tmp_path, *args: str, env: dict | None = None) -> tuple[str, float]:
    """Run serve that cannot join: its one error line (exit 1, nothing on stdout) and
    how long it took."""
    config = serve_config(tmp_path, f"refused-{uuid.uuid4().hex[:6]}")
    started = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "dataplane_server", "serve", "--config", str(config), *args],
            cwd=REPO,
            env=env or serve_env(),
            capture_output=True,
            text=True,
            timeout=FAIL_S,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"serve {' '.join(args)} still running after {FAIL_S}s: {exc.stderr!r}")
    took = time.monotonic() - started
    assert proc.returncode == 1, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert proc.stdout == "", proc.stdout
    assert proc.stderr.count("\n") == 1, proc.stderr  # one line: no Ray retries, no traceback
    assert proc.stderr.startswith("dataplane: error: "), proc.stderr
    return proc.stderr, took


def dead_address() -> str:
    """A loopback address nothing listens on."""
    return f"127.0.0.1:{free_ports(1)[0]}"


def test_serve_to_an_address_nothing_answers_is_one_error_line(tmp_path):
    address = dead_address()
    err, took = serve_refused(tmp_path, "--address", address, "--timeout", "5")
    assert f"cannot reach a Ray cluster at {address!r}" in err
    assert took < 20, took  # refused at once, not after retries


@pytest.fixture
def silent_address():
    """A loopback port that accepts connections and never says anything: a cluster
    that cannot be joined. Yields its address and the connections it accepted."""
    accepted: list[socket.socket] = []
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)

        def accept() -> None:
            with contextlib.suppress(OSError):  # closed at the end
                while True:
                    accepted.append(server.accept()[0])

        threading.Thread(target=accept, daemon=True).start()
        try:
            yield f"127.0.0.1:{server.getsockname()[1]}", accepted
        finally:
            server.shutdown(socket.SHUT_RDWR)
            for conn in accepted:
                conn.close()


def test_serve_gives_up_joining_at_its_timeout(tmp_path, silent_address):
    address, _ = silent_address
    err, took = serve_refused(tmp_path, "--address", address, "--timeout", "3")
    assert f"cannot join the Ray cluster at {address!r} within 3 s (--timeout)" in err
    assert 3 <= took < 3 + 20, took


def test_sigterm_while_joining_ends_serve_at_once(tmp_path, silent_address):
    address, accepted = silent_address
    config = serve_config(tmp_path, f"sigterm-{uuid.uuid4().hex[:6]}")
    serve = subprocess.Popen(
        [sys.executable, "-m", "dataplane_server", "serve", "--config", str(config)]
        + ["--address", address],
        cwd=REPO,
        env=serve_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # The reachability check connects first, then Ray's own client: Ray is joining.
        wait_until(lambda: len(accepted) >= 2, FAIL_S, "serve to start joining")
        serve.send_signal(signal.SIGTERM)
        out, err = serve.communicate(timeout=5)  # it waited for Ray's retries (25 s)
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.communicate()
    assert serve.returncode == 1, (serve.returncode, out, err)
    assert err.startswith(f"dataplane: error: SIGTERM while joining the Ray cluster at {address!r}")
    assert err.count("\n") == 1, err
    assert out == "", out


def test_serve_auto_to_a_dead_cluster_is_one_error_line(tmp_path):
    # `auto` resolves as Ray resolves it: RAY_ADDRESS first, which isolates this test
    # from any Ray on the machine (a `ray start` here, other tests' clusters).
    address = dead_address()
    err, took = serve_refused(tmp_path, "--address", "auto", env=serve_env(RAY_ADDRESS=address))
    assert f"cannot reach a Ray cluster at {address!r}" in err
    assert "'auto'" in err
    assert took < 20, took
