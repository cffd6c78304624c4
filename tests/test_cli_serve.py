"""`dataplane serve` as an operator runs it: embedded Ray, discovery, drain on SIGTERM.

What it prints must be enough to connect: the Ray address, the admin and
metrics endpoints, and a snippet that is pasted, as printed, into another
process here and reaches the service. Ray 2.60 turns token auth on for a new
local cluster, so serve says RAY_AUTH_MODE=token is needed, and the snippet
runs with it set, as the hint says. With ``drain_checkpoint_dir`` set, SIGTERM
ends in a whole checkpoint holding what the pasted snippet wrote.
"""

from __future__ import annotations

import hashlib
import os
import queue
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


def test_serve_prints_a_snippet_that_connects_and_drains_on_sigterm(tmp_path):
    name = f"serve-{uuid.uuid4().hex[:6]}"
    config = tmp_path / "dataplane.yaml"
    config.write_text(
        f"name: {name}\nnamespace: serve-test\nunit_capacity_bytes: 64MiB\n"
        "unit_warm_reserve_bytes: 0\ndrain_timeout_s: 2\n"
        f"drain_checkpoint_dir: {tmp_path / 'drained'}\n"
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DATAPLANE_", "RAY_ADDRESS", "RAY_AUTH_MODE"))
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
        read_until(lines, "connect from another process", seen)
        snippet = [read_until(lines, "    ", seen) for _ in range(3)]
        assert f'ray.init(address="{ray_address}")' in snippet[1]
        hint = read_until(lines, "Ray token auth is on", seen)
        assert "RAY_AUTH_MODE=token" in hint

        # The snippet, pasted as printed, in a process that knows nothing else.
        # It also writes two samples, which the drain checkpoint must then hold.
        code = "\n".join(line.strip() for line in snippet) + (
            "\nimport torch"
            "\nclient.register_partition('kept', fields=['x'], consumer_tasks=['t'])"
            "\nclient.put_samples(['a', 'b'], 'kept', {'x': torch.arange(8.0).reshape(2, 4)})"
            "\nprint(client.service_info().name)"
        )
        pasted = subprocess.run(
            [sys.executable, "-c", code],
            cwd=tmp_path,  # not the repo: nothing but the installed package
            env=env | {"RAY_AUTH_MODE": "token"},
            capture_output=True,
            text=True,
            timeout=START_S,
        )
        assert pasted.returncode == 0, pasted.stderr[-3000:]
        assert pasted.stdout.strip().splitlines()[-1] == name

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
