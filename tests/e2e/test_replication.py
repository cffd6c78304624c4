"""Replication (``replicas: 2``): each sample on two units of different nodes; one loss loses nothing.

The key space's part runs without Ray (milliseconds); the service's part runs on a
three-node loopback cluster in its own process (tests/scenarios/replication.py, through
tests/scenario_run.py):
a node removed during streaming writes, a unit killed after a clear, a checkpoint
and a controller restart, a writer killed between a put's two stages.
"""

import numpy as np
import pytest
from scenario_run import TIMEOUT_S, expected_paths, run_scenario

from dataplane_client.transport.placement import second_units, stage_plan
from dataplane_client.wire.config import DataPlaneConfig
from dataplane_client.wire.errors import ConfigError, InvalidBatch, SamplesLost
from dataplane_client.wire.messages import CommitRequest
from dataplane_server.controller.checkpoint import cut
from dataplane_server.core.keyspace import CommitPlan, Declaration, KeySpace
from dataplane_server.core.recovery_messages import StoredRows

DENSE = ("dense", "float32", ())


def _space(units=3) -> KeySpace:
    ks = KeySpace(lambda: 1000.0)
    ks.unit_alive = [True] * units
    ks.register("p", Declaration(["x"], None, ["t"], None))
    return ks


def _commit(ks, ids, units, replicas, field="x"):
    staged = sorted(set(units) | {r for r in replicas if r >= 0})
    request = CommitRequest(
        "p", f"w-{ids[0]}-{field}", ids, units, {field: DENSE}, None, None, False, staged, replicas
    )
    plan = ks.check_commit(request)
    if isinstance(plan, CommitPlan):
        ks.apply_commit(plan)
    return plan


# ---- the key space -------------------------------------------------------------------
def test_a_dead_unit_hands_its_rows_to_their_second_copies_and_only_rows_without_one_are_lost():
    ks = _space()
    _commit(ks, ["a", "b"], [0, 0], [1, 2])
    _commit(ks, ["c"], [0], [-1])  # written once (no other node was alive)
    _commit(ks, ["d"], [1], [0])
    part = ks.partition("p")
    ks.unit_alive[0] = False
    ks.fail_over()
    assert ks.lookup_units("p", ["a", "b", "c", "d"]) == [1, 2, 0, 1]
    assert ks.replica_units("p", ["a", "b", "c", "d"]) == [-1, -1, -1, -1]
    assert ks.locate("p", ["a", "b", "d"], ["x"]).units == [1, 2, 1]
    with pytest.raises(SamplesLost) as lost:
        ks.locate("p", ["a", "c"], ["x"])
    assert lost.value.ids == ["c"]
    assert [part.ids[r] for r in ks.lost_rows(part)] == ["c"]
    meta = ks.claim(part, "t", ["x"], 10, partial_ok=True)
    assert sorted(meta.sample_ids) == ["a", "b", "d"]


def test_a_writer_with_a_stale_pair_is_rerouted_to_the_recorded_copies():
    ks = _space()
    _commit(ks, ["a"], [0], [1])
    ks.unit_alive[0] = False
    ks.fail_over()
    moved = _commit(ks, ["a"], [0], [1], field="y")  # the writer still thinks (0, 1)
    assert moved.rerouted == {"a": 1}
    assert moved.rerouted_replicas == {}
    _commit(ks, ["a"], [1], [-1], field="y")  # as told: the survivor alone
    assert ks.partition("p").fields_of(0) == ["x", "y"]
    # Every copy gone: lost, not re-routed to a dead unit.
    ks.unit_alive[1] = False
    ks.fail_over()
    with pytest.raises(SamplesLost):
        _commit(ks, ["a"], [2], [-1], field="z")


def test_a_new_sample_whose_second_copy_is_on_a_dead_unit_is_refused():
    ks = _space()
    ks.unit_alive[2] = False
    with pytest.raises(SamplesLost):
        _commit(ks, ["a"], [0], [2])
    with pytest.raises(InvalidBatch, match="another unit"):
        _commit(ks, ["a"], [0], [0])
    bad = CommitRequest("p", "w", ["a"], [0], {"x": DENSE}, None, None, False, [0], [1])
    with pytest.raises(InvalidBatch, match="staged_units"):
        ks.check_commit(bad)  # the second copy's unit was not staged


def test_clear_frees_both_copies_and_a_checkpoint_skips_second_copies():
    ks = _space()
    _commit(ks, ["a", "b", "c"], [0, 0, 1], [1, 1, 2])
    # A checkpoint's cut names each sample on its first copy's unit only.
    assert cut(ks, 1, None).rows == {0: {"p": ["a", "b"]}, 1: {"p": ["c"]}, 2: {"p": []}}
    assert ks.clear_samples("p", ["a", "c"]) == {0: ["a"], 1: ["a", "c"], 2: ["c"]}


def test_a_rebuild_from_the_units_brings_the_second_copies_back():
    ks = KeySpace(lambda: 1000.0)
    ks.unit_alive = [True, True, True]

    def held(ids, seq):
        return StoredRows(
            ids, seq, [-1] * len(ids), [None] * len(ids), {"x": DENSE}, {"x": [True] * len(ids)}
        )

    stored = [(0, held(["a", "b"], [1, 2])), (1, held(["b", "c"], [2, 3])), (2, held(["a"], [1]))]
    part = ks.rebuild_partition("p", Declaration(["x"], None, ["t"], None), stored)
    assert part.ids == ["a", "b", "c"]  # commit order, each sample once
    assert ks.lookup_units("p", ["a", "b", "c"]) == [0, 0, 1]
    assert ks.replica_units("p", ["a", "b", "c"]) == [2, 1, -1]
    assert part.produced["x"][:3].all()


def test_the_second_copy_goes_to_the_next_alive_unit_on_another_node():
    nodes = ["n0", "n0", "n1", "n2"]
    units = np.array([0, 1, 2, 3, 0])
    assert second_units(units, [True] * 4, nodes).tolist() == [2, 2, 3, 0, 2]
    assert second_units(units, [True, True, False, True], nodes).tolist() == [3, 3, 3, 0, 3]
    assert second_units(np.array([0]), [True, True, False, False], nodes).tolist() == [-1]
    plan = stage_plan(np.array([0, 0, 2]), np.array([2, 2, 3]))
    assert {u: rows.tolist() for u, rows in plan.items()} == {0: [0, 1], 2: [0, 1, 2], 3: [2]}


# ---- configuration ---------------------------------------------------------------------
def test_replicas_is_one_or_two_and_the_in_process_client_refuses_two(monkeypatch):
    assert DataPlaneConfig().replicas == 1
    for bad in (0, 3, "2", 1.0):
        with pytest.raises(ConfigError, match="replicas"):
            DataPlaneConfig(replicas=bad)
    monkeypatch.setenv("DATAPLANE_REPLICAS", "2")
    assert DataPlaneConfig().replicas == 2
    monkeypatch.delenv("DATAPLANE_REPLICAS")
    from dataplane_server import build_data_plane_client

    with pytest.raises(ConfigError, match="in-process"):
        build_data_plane_client({"enabled": True, "impl": "in_process", "service": {"replicas": 2}})


# ---- the service on three nodes ---------------------------------------------------------
@pytest.fixture(scope="module")
def scenario() -> dict:
    return run_scenario("replication")


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 60)  # the first to ask runs every scenario
def test_start_refuses_two_copies_on_one_node(scenario):
    assert "replicas: 2 needs storage units on at least two nodes" in scenario["one_node_refused"]


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 60)  # the first to ask runs every scenario
def test_a_node_removed_during_streaming_writes_loses_nothing(scenario):
    out = scenario["node_loss"]
    assert out["primaries_on_doomed_before"] > 0, "the removed node held first copies"
    assert out["primaries_on_doomed_after"] == 0, "their second copies took over"
    _holds(out, unit_nodes=3, committed=120, put_errors=[], samples_lost_raised=[])
    _holds(out, writer_done=True, readable_bit_for_bit=True, service_info_shows_dead=True)
    _holds(out, claimed_all=True, lost_counted=0, consumption_done=True)
    # The reads after the loss went through Mooncake's engine where it loads (the removed
    # node's unit, whose probe failed, through Ray's path).
    assert expected_paths()[0] in out["paths"]


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 60)  # the first to ask runs every scenario
def test_a_unit_killed_after_a_controller_restart_loses_nothing(scenario):
    out = scenario["unit_kill"]
    assert out["checkpoint_samples"] == 30, "a checkpoint holds each sample once"
    assert out["victim_primaries"] > 0
    _holds(out, both_copies_held=True, clear_removed_both=True, checkpoint_readable=True)
    _holds(out, samples_lost_raised=[], readable_after_kill=True, claimed_all=True)
    _holds(out, lost_counted=0, write_back_after_kill=True)


def _holds(out: dict, **expected) -> None:
    """The scenario's figures named here are these (a failure shows every one that is not)."""
    assert {name: out[name] for name in expected} == expected


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 60)  # the first to ask runs every scenario
def test_a_writer_killed_between_its_two_stages_leaves_nothing_half_visible(scenario):
    out = scenario["stages"]
    assert out["stage_errors"] == []
    assert out["staged"] == [["write-a", "write-b"], ["write-b"]]
    # A commit naming both copies while one was never staged: refused, nothing visible, and
    # the stage it pinned on the other unit is not left waiting for a deadline.
    assert out["half_commit_refused"] == "SamplesNotFound"
    assert out["visible_after_half_commit"] == [0, 0]
    # The dead writers' stages are gone from both units (bytes back to where they were).
    assert out["reclaimed_on_both"]
    assert out["read_of_unwritten"] == ["SamplesNotFound", "SamplesNotFound"]
