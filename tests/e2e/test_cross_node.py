"""Gets from a unit on another Ray node (tests/scenarios/cross_node_reads.py, in a process and
cluster of its own: tests/scenario_run.py), through each cross-node backend: Mooncake's
transfer engine where it loads, Ray's object transfer, and the probe's fallback in a
process without Mooncake."""

import pytest
from scenario_run import TIMEOUT_S, expected_paths, mooncake_loads, run_scenario


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


CASES = {"all_in_order": True, "contiguous_slice": True, "shuffled_subset": True, "reversed": True}


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 60)  # the first to ask runs every scenario
def test_each_backend_reads_the_same_bytes_and_the_probe_says_which():
    out = run_scenario("cross_node")
    paths = out["paths"]
    assert [b for b, _ in paths["default"]] == expected_paths(), paths["default"]
    if mooncake_loads():
        assert paths["default"][0][1].count(":") == 1, "Mooncake's peer is the unit's ip:port"
    assert paths["ray"] == [["ray", "cross_node_transport is 'ray'"]]
    # A process that cannot import Mooncake falls back to Ray, saying why.
    (bare,) = paths["bare"]
    assert bare[0] == "ray", bare
    assert "Mooncake is not installed" in bare[1], bare
    # Every case read identically through each backend (compared with what was put).
    assert out["cases"] == CASES
    assert out["cases_ray"] == CASES
    assert out["cases_bare"] == CASES


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 60)  # the first to ask runs every scenario
def test_pulls_leave_nothing_registered_nor_leased():
    out = _through_mooncake()
    for step in ("counters_after_cases", "counters_after_corrupt", "counters_after_race"):
        c = out[step]
        # Each registered buffer is unregistered or idle in the pool: none stays lent.
        assert c["registered"] > 0, (step, c)
        assert c["registered"] - c["unregistered"] == c["pooled"], (step, c)
        assert c["lent"] == 0, (step, c)
    assert out["counters_after_corrupt"]["transfer_failures"] == 0
    # No pull failed in the race (the one failure before it is the write_failed push's).
    assert out["counters_after_race"]["transfer_failures"] == 1
    assert out["counters_after_race"]["pulled_bytes"] > out["counters_after_cases"]["pulled_bytes"]
    # Every remote read lease came back and no registered chunk outlived its use.
    assert out["unit_holdings"] == {"read_leases": 0, "orphans": 0}


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 60)  # the first to ask runs every scenario
def test_a_spoiled_pull_is_pulled_again_and_two_raise_corrupt_payload():
    out = _through_mooncake()
    once, twice = out["corrupt"]["1"], out["corrupt"]["2"]
    # One spoiled pull: the CRC-32 check catches it, the field is pulled again, right bytes.
    assert once["fired"] == 1, once
    assert once["error"] is None, once
    assert once["right_bytes"], once
    # Two in a row: CorruptPayload naming the field and the CRC-32 the unit stated.
    assert twice["fired"] == 2, twice
    assert twice["error"] == "CorruptPayload", twice
    assert "'dense'" in twice["message"], twice
    assert "CRC-32" in twice["message"], twice
    c = out["counters_after_corrupt"]
    assert c["corrupt"] - out["counters_after_cases"]["corrupt"] == 3  # 1 + 2 spoiled pulls
    assert c["corrupt_raised"] == 1


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 60)  # the first to ask runs every scenario
def test_puts_pushed_through_the_engine_land_intact_or_not_at_all():
    out = run_scenario("cross_node")
    puts = out["puts"]
    # With transfer_puts, a put of more than 1 MiB from node A is pushed by Mooncake's
    # engine where it loads (else it goes through Ray): read back bit for bit either way.
    assert puts["clean"] == {"error": None, "read_back": True, "fired": 0}
    if not mooncake_loads():
        return
    assert out["counters_after_puts"]["pushed_bytes"] >= 4 << 20
    # The unit found the pushed bytes differ from the writer's CRC-32: pushed again, intact.
    assert puts["spoiled_once"] == {"error": None, "read_back": True, "fired": 1}
    # Twice: the put fails typed before its commit, and none of it became visible.
    assert puts["spoiled_twice"] == {
        "error": "CorruptPayload",
        "read_back": "SamplesNotFound",
        "fired": 2,
    }
    c = out["counters_after_puts"]
    assert c["registered"] - c["unregistered"] == c["pooled"], c


def _through_mooncake() -> dict:
    """The cross-node scenario's figures, for a test of Mooncake's own path (skipped where
    its engine does not load: every other test checks the Ray path there)."""
    out = run_scenario("cross_node")
    if not mooncake_loads():
        pytest.skip("Mooncake's engine does not load here")
    return out


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 60)  # the first to ask runs every scenario
def test_a_registration_the_unit_refuses_is_read_through_ray():
    refused = _through_mooncake()["register_refused"]
    # The unit's engine refused the chunk the read named: the read failed typed on the
    # unit (counted there), and the reader got the right bytes through Ray instead.
    assert refused["fired"] == 1, refused
    assert refused["unit_failures"] == 1, refused
    assert (refused["error"], refused["right_bytes"]) == (None, True), refused
    c = refused["reader"]
    assert (c["pulled_bytes"], c["lent"], c["transfer_failures"]) == (0, 0, 0), c


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 60)  # the first to ask runs every scenario
def test_a_push_whose_engine_fails_after_the_remote_write_lands_once_through_ray():
    out = _through_mooncake()
    # The bytes were written into the unit's stage, then the engine reported a failure
    # (as a late timeout does): that stage is discarded uncommitted, and the put stages
    # again through Ray under a new write id; read back bit for bit, once.
    assert out["puts"]["write_failed"] == {"error": None, "read_back": True, "fired": 1}
    assert out["counters_after_puts"]["transfer_failures"] == 1
    assert out["unit_holdings"] == {"read_leases": 0, "orphans": 0}


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 60)  # the first to ask runs every scenario
def test_a_unit_killed_mid_pull_is_a_typed_error_and_leaks_nothing_in_the_reader():
    killed = _through_mooncake()["unit_killed"]
    # SIGKILLed after the first 1 MiB slice of a 4 MiB pull landed: the pull fails, the
    # get's fallback through Ray finds the unit gone, and the get raises SamplesLost
    # (replicas: 1); the destination buffer is back in the reader's pool.
    assert killed["killed_after"] == [1 << 20], killed
    assert killed["error"] == "SamplesLost", killed
    c = killed["counters"]
    assert c["lent"] == 0, c
    assert c["registered"] - c["unregistered"] == c["pooled"], c
    assert c["transfer_failures"] == 2, c  # the write_failed push's, and this pull's
