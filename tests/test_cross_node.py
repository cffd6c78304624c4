"""Gets from a unit on another Ray node (separate process: its own two-node cluster)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_cross_node_reads_right_bytes_and_survive_a_racing_clear():
    script = Path(__file__).parent / "scenarios" / "cross_node_reads.py"
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=400, env=env
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert lines, proc.stdout[-3000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    assert out["reader_elsewhere"], "the reader must sit on another node than the unit"
    # Every field kind, selected fields, rows in order, a slice, a shuffled subset, reversed.
    assert out["cases"] == {
        "all_in_order": True,
        "contiguous_slice": True,
        "shuffled_subset": True,
        "reversed": True,
    }
    race = out["race"]
    assert race["other_error"] == [], "a get racing a clear raises only typed errors"
    assert race["torn"] == 0, "every row a get returns is one whole version"
    assert race["ok"] > 0, "some gets must have succeeded"
    assert out["race_rewrites"] > 0, "the clears must have raced the gets"
