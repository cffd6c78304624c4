"""Gets from a unit on another Ray node (separate process: its own two-node cluster)."""

import pytest
from scenario_run import run_scenario


@pytest.mark.slow
def test_cross_node_reads_right_bytes_and_survive_a_racing_clear():
    out = run_scenario("cross_node_reads", timeout_s=400)
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
