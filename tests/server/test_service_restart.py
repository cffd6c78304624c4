"""The whole service killed and served again from its state directory, with real processes.

`dataplane serve --state-dir DIR` runs an embedded Ray; a pasted client puts samples,
claims some on one task, leases some on another and sets a policy version. Then every
process of the service (serve, Ray's GCS and raylet, the controller and unit workers)
gets SIGKILL at once. A second `dataplane serve --state-dir DIR` must serve every
committed sample bit for bit, the cursor, the lease, the rollout grant, the policy
version and the counts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid

import pytest
from serve_process import START_S, process_tree, read_snippet, read_until, start_serve

from dataplane_client.wire.config import DataPlaneConfig
from dataplane_server.core.unit import durable_layout

pytestmark = pytest.mark.slow

WRITE = """
import json, pickle, torch
from dataplane_client.wire.messages import StalenessSpec
client.register_partition('p', fields=['x'], consumer_tasks=['t', 'u'],
                          task_leases={'u': 3600.0},
                          staleness=StalenessSpec(max_staleness=4, admission_batch=16))
client.set_policy_version('p', 7)
ids = [f's{i}' for i in range(64)]
client.put_samples(ids, 'p', {'x': torch.arange(64 * 2048.0).reshape(64, 2048)}, version=7)
first = client.claim_meta('p', 't', ['x'], 20)
held = client.claim_meta('p', 'u', ['x'], 5)
grant = client.admit_rollouts('p', 8, lease_s=3600.0)
open('held.pkl', 'wb').write(pickle.dumps((held, grant)))
print(json.dumps({'t': sorted(first.sample_ids), 'u': sorted(held.sample_ids),
                  'samples': client.describe_partition('p').num_samples}))
"""

CHECK = """
import json, pickle, torch
held, grant = pickle.loads(open('held.pkl', 'rb').read())
ids = [f's{i}' for i in range(64)]
same = bool(torch.equal(client.get_samples(ids, 'p', ['x'])['x'],
                        torch.arange(64 * 2048.0).reshape(64, 2048)))
rest = client.claim_meta('p', 't', ['x'], 1000, blocking=False).sample_ids
again = client.claim_meta('p', 'u', ['x'], 1000, blocking=False).sample_ids
print(json.dumps({'same': same, 't_rest': sorted(rest), 'u_again': sorted(again),
                  'version': client.policy_version('p'),
                  'samples': client.describe_partition('p').num_samples,
                  'acked': client.ack(held), 'grant_held': client.release_rollouts(grant)}))
"""


def _env() -> dict:
    """Nothing of this session's Ray settings: each serve runs its own embedded Ray."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DATAPLANE_", "RAY_ADDRESS", "RAY_AUTH", "RAY_ENABLE_WINDOWS"))
    } | {"RAY_AUTH_MODE": "disabled"}


def _serve_and_run(config, state_dir, work: str) -> tuple[subprocess.Popen, dict]:
    """Start serve on ``state_dir``, run ``work`` through its pasted snippet: its JSON line."""
    serve, lines = start_serve(config, ["--num-cpus", "4", "--state-dir", str(state_dir)], _env())
    seen: list[str] = []
    try:
        assert read_until(lines, "durability=", seen) == f"durability=process state_dir={state_dir}"
        snippet = read_snippet(lines, seen)
        ran = subprocess.run(
            [sys.executable, "-c", "\n".join(snippet) + work],
            cwd=config.parent,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=START_S,
        )
        assert ran.returncode == 0, ran.stderr[-3000:]
        return serve, json.loads(ran.stdout.strip().splitlines()[-1])
    except BaseException:
        serve.kill()
        raise


def _sigkill_tree(serve: subprocess.Popen) -> None:
    """SIGKILL serve and every process below it at once (Ray's included)."""
    for pid in process_tree(serve.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    serve.wait(timeout=60)
    serve.stdout.close()


def test_every_process_killed_and_served_again_from_the_state_dir(tmp_path):
    config = tmp_path / "dataplane.yaml"
    config.write_text(
        f"name: restart-{uuid.uuid4().hex[:6]}\nnamespace: restart-test\n"
        "unit_capacity_bytes: 64MiB\nunit_warm_reserve_bytes: 0\ndrain_timeout_s: 1\n"
        "admin_enabled: false\n"
    )
    state_dir = tmp_path / "state"
    serve, before = _serve_and_run(config, state_dir, WRITE)
    _sigkill_tree(serve)
    again, after = _serve_and_run(config, state_dir, CHECK)
    try:
        assert after["same"]  # every sample, bit for bit
        assert after["samples"] == before["samples"] == 64
        assert after["t_rest"] == sorted({f"s{i}" for i in range(64)} - set(before["t"]))
        assert not set(after["u_again"]) & set(before["u"])  # the lease is still held
        assert after["version"] == 7
        assert after["acked"] == 5  # the lease acknowledged as the same lease
        assert after["grant_held"]  # the rollout grant still counted, released once
    finally:
        _sigkill_tree(again)
        durable_layout.remove_state(DataPlaneConfig(durability="process", state_dir=str(state_dir)))
