"""Units on several Ray nodes; losing a node loses exactly its samples (separate process: own cluster)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_multinode_spread_and_node_loss():
    script = Path(__file__).parent / "scenarios" / "multinode.py"
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert lines, proc.stdout[-3000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    assert len(set(out["unit_nodes"])) == 2, "units must sit on different nodes"
    assert out["cross_node_roundtrip"]
    assert out["doomed"], "the lost node held some samples"
    assert out["lost_reported"] == out["doomed"], (
        "SamplesLost lists exactly the lost node's samples"
    )
    assert out["survivors_readable"]
    assert out["second_client_lost"]
    assert out["new_units"] == [1 - out["doomed_unit"]], "new puts go to the surviving unit"
    assert out["new_readable"]
    assert out["claim_skips_lost"], "claims hand out survivors only"
    assert out["partition_done"], "lost samples are terminal: the known-size partition is done"
    assert out["unsatisfiable_claim"] == out["doomed"], "the claim fails naming the lost ids"
    assert out["detect_s"] is not None, "service_info shows the dead unit without a read"
    assert out["detect_s"] < 30
