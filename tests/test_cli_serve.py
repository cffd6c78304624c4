"""`dataplane serve` as an operator runs it: embedded Ray, discovery, drain on SIGTERM.

What it prints must be enough to connect: the Ray address, the admin and
metrics endpoints, and a snippet that is pasted, as printed, into another
process here (whose environment knows nothing: no RAY_AUTH_MODE, no loopback
setting) and puts, claims and reads back. Ray 2.60 turns token auth on for a new
local cluster; the snippet sets RAY_AUTH_MODE=token itself. The embedded Ray is on
127.0.0.1: its node IP, and every socket its processes listen on (read with
``ss -ltnp``), except the GCS port, which Ray 2.60 binds on every interface (the
documented exception, deploy/README.md). With ``drain_checkpoint_dir`` set, SIGTERM
ends in a whole checkpoint holding what the pasted snippet wrote.
"""

from __future__ import annotations

import hashlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from dataplane_server.core import checkpoint

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
START_S = 180
# How ss writes a loopback listener: IPv4, IPv4-mapped IPv6 (gRPC's), IPv6.
LOOPBACK = {"127.0.0.1", "[::ffff:127.0.0.1]", "[::1]"}


def _pump(pipe, lines: queue.Queue) -> None:
    for line in pipe:
        lines.put(line.rstrip("\n"))
    lines.put(None)


def read_until(lines: queue.Queue, prefix: str, seen: list[str]) -> str:
    """Lines up to the first that starts with ``prefix`` (kept in ``seen``)."""
    while True:
        try:
            line = lines.get(timeout=START_S)
        except queue.Empty:
            pytest.fail(f"no {prefix!r} line within {START_S}s; got:\n" + "\n".join(seen))
        if line is None:
            pytest.fail(f"serve ended before {prefix!r}; got:\n" + "\n".join(seen))
        seen.append(line)
        if line.startswith(prefix):
            return line


def _assert_checkpoint_holds(path: str, partition: str, samples: int) -> None:
    """A whole, loadable checkpoint: manifest and state verified, unit files as listed."""
    files, state = checkpoint.read(path)
    assert os.path.basename(path).startswith("drain-")
    for f in files:
        data = (Path(path) / f.name).read_bytes()
        assert hashlib.sha256(data).hexdigest() == f.sha256
    assert sum(f.nbytes for f in files) >= samples * 4 * 4  # the float32 rows at least
    assert partition in state  # the state is keyed by partition id


def read_snippet(lines: queue.Queue, seen: list[str]) -> list[str]:
    """The indented lines after "connect from another process", dedented."""
    read_until(lines, "connect from another process", seen)
    snippet = []
    while (line := lines.get(timeout=START_S)) is not None and line.startswith("    "):
        seen.append(line)
        snippet.append(line[4:])
    seen.append(str(line))
    return snippet


def _process_tree(root: int) -> set[int]:
    """``root`` and every process below it (Ray's GCS, raylet, workers), from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the process ended while we looked
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        tree.add(pid)
        todo += children.get(pid, [])
    return tree


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
    serve = subprocess.Popen(
        [sys.executable, "-m", "dataplane_server", "serve", "--config", str(config)]
        + ["--num-cpus", "4"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_pump, args=(serve.stdout, lines), daemon=True).start()
    seen: list[str] = []
    try:
        ray_address = read_until(lines, "ray_address=", seen).split("=", 1)[1]
        assert ray_address.startswith("127.0.0.1:")  # the embedded Ray is on loopback
        assert read_until(lines, "admin_address=", seen).startswith("admin_address=127.0.0.1:")
        snippet = read_snippet(lines, seen)
        assert f'address="{ray_address}"' in snippet[-1]
        assert 'os.environ["RAY_AUTH_MODE"] = "token"  # before ray is imported' in snippet

        # Every socket of this Ray's processes is on 127.0.0.1 but the GCS port.
        sockets = listening_sockets(_process_tree(serve.pid))
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
