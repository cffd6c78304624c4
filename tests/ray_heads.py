"""A separate local Ray head for tests that run one (``ray start --head`` in its own
process group): free loopback ports, the environment it runs in, stopping its group,
reading its log. Used by tests/e2e/test_ray_job.py and tests/server/test_cli_serve.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

RAY = str(Path(sys.executable).parent / "ray")


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def ray_env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "DATAPLANE_"))}
    env.update(
        {
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            # The supervisor waits this long after SIGTERM before SIGKILL: room to drain.
            "RAY_JOB_STOP_WAIT_TIME_S": "60",
            "RAY_USAGE_STATS_ENABLED": "0",
            # A throwaway cluster on loopback: no token, so it works whether or not
            # ~/.ray/auth_token exists (Ray turns token auth on when that file does).
            "RAY_AUTH_MODE": "disabled",
        }
    )
    env.update(extra or {})
    return env


def stop_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the group's leader (ray start --block then stops its cluster's processes,
    raylet first, GCS last), then SIGKILL whatever is left of the group after grace_s.

    Only the leader: a SIGTERM to the whole group ends the GCS at once, and the
    leader's own shutdown then waits about 30 s on processes still asking that GCS."""
    pgid = proc.pid  # start_new_session: the group id is the leader's pid
    try:
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader once it exits
            os.killpg(pgid, 0)  # raises ProcessLookupError once the group is gone
            time.sleep(0.2)  # poll interval
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def read(path: str) -> str:
    try:
        return Path(path).read_text()[-4000:]
    except OSError:
        return ""
