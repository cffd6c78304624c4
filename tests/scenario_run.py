"""The multi-node scenarios (tests/scenarios/one_cluster.py), run once per test session.

They run on one `ray.cluster_utils.Cluster` of their own, in their own process (it
cannot share the test session's Ray), which prints one `RESULT <json>` line; each
scenario's test asserts on its part. The first test to ask pays for all three
(about 2 minutes here, more under load): its timeout must leave room for that.
"""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

TIMEOUT_S = 900  # all three scenarios; a bound on a hang, several times a loaded run


@functools.cache
def _one_cluster() -> dict | str:
    """Every scenario's observations, or why the run gave none (kept too: a failed run is
    not repeated for each test that asks)."""
    script = Path(__file__).parent / "scenarios" / "one_cluster.py"
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    try:
        proc = subprocess.run(
            [sys.executable, str(script)],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            env=env,
        )
    except subprocess.TimeoutExpired as e:
        return f"the scenarios did not end within {TIMEOUT_S}s: {e}"
    results = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not results:
        return f"exit {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(results[-1][len("RESULT ") :])


def run_scenario(name: str) -> dict:
    """What scenario ``name`` (cross_node, replication, multinode) observed."""
    got = _one_cluster()
    assert isinstance(got, dict), got
    out = got[name]
    assert "error" not in out, f"scenario {name} raised:\n{out['error']}"
    return out


MOONCAKE_MISSING_IN_CI = (
    "Mooncake's engine does not load, and CI=true: CI must run the cross-node scenarios on it "
    "(make setup installs rl-dataplane[mooncake] and Debian's libibverbs1)"
)


@functools.cache
def mooncake_loads() -> bool:
    """Whether Mooncake's engine loads here (the package and its libibverbs), so the
    scenarios' cross-node gets go through it; under CI=true it must."""
    from dataplane_client.transport.payload.mooncake import engine_environment

    engine_environment()  # before the first import: quiet logs, as the service's engines
    try:
        import mooncake.engine  # noqa: F401
    except Exception:  # noqa: BLE001 - ImportError, or OSError from a missing libibverbs
        assert os.environ.get("CI") != "true", MOONCAKE_MISSING_IN_CI
        return False
    return True


def expected_paths() -> list[str]:
    """The backends a scenario's cross-node client should have chosen here."""
    return ["mooncake-tcp"] if mooncake_loads() else ["ray"]
