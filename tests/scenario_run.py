"""Runs a multi-node scenario script (tests/scenarios/NAME.py) in its own process.

Each scenario starts its own `ray.cluster_utils.Cluster` on loopback, so it cannot share
the test session's Ray; it prints one `RESULT <json>` line that the test asserts on.
"""

import json
import os
import subprocess
import sys
from pathlib import Path


def run_scenario(name: str, timeout_s: float) -> dict:
    script = Path(__file__).parent / "scenarios" / f"{name}.py"
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=timeout_s, env=env
    )
    results = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert results, proc.stdout[-3000:]
    return json.loads(results[-1][len("RESULT ") :])
