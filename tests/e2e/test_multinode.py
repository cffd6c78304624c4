"""Units on several Ray nodes; losing a node loses exactly its samples (tests/scenarios/multinode.py,
in a process and cluster of its own: tests/scenario_run.py)."""

import pytest
from scenario_run import TIMEOUT_S, expected_paths, run_scenario


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 60)  # the first to ask runs every scenario
def test_multinode_spread_and_node_loss():
    out = run_scenario("multinode")
    assert len(set(out["unit_nodes"])) == 2, "units must sit on different nodes"
    assert out["cross_node_roundtrip"]
    # Through Mooncake's engine where it loads (the node loss below happens on that path).
    assert [p for p in out["paths"] if p != "shm"] == expected_paths()
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
