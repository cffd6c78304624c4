"""Gets from a unit on another Ray node (tests/scenarios/cross_node_reads.py, in a process and
cluster of its own: tests/scenario_run.py)."""

import pytest
from scenario_run import TIMEOUT_S, run_scenario


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 60)  # the first to ask runs every scenario
def test_cross_node_reads_right_bytes_and_survive_a_racing_clear():
    out = run_scenario("cross_node")
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
