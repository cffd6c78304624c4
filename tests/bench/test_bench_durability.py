"""The durability benchmark section runs at its --quick size through the real harness.

Speed is not asserted (a shared machine); what is: every level measured its three rates,
the service came back with every sample it held, and the disk of the machine level is
stated.
"""

import pytest
from bench_run import run_benchmark

from benchmarks.durability import LEVELS


@pytest.mark.slow
def test_the_section_measures_every_level_and_a_restart(tmp_path):
    report, _ = run_benchmark(
        "benchmarks.run",
        "--only",
        "durability",
        "--quick",
        "--repeats",
        "1",
        out=tmp_path / "durability.json",
        timeout=600,
    )
    assert report["failed"] == []
    data = report["sections"]["durability"]["data"]
    assert set(data["levels"]) == set(LEVELS)
    for rates in data["levels"].values():
        assert min(rates.values()) > 0
    assert data["restart"]["samples"] == 10_000  # all back (the section asserts it)
    assert data["restart"]["serve_again_s"] > 0
    assert not data["machine_disk"].startswith("?")  # findmnt named the file system
