"""The checkpoint benchmark section (``benchmarks/checkpoint_cut.py``) runs at its --quick
size in a process of its own and writes its tables, targets and raw figures. Never
asserts on speed: only that every figure is there and each incremental checkpoint wrote
about its new bytes while linking what its parent held."""

import pytest
from bench_run import run_benchmark

pytestmark = pytest.mark.slow  # a service of its own and a dozen checkpoints: a minute here


def test_the_checkpoint_section_reports_load_and_incremental_figures(tmp_path):
    data, stdout = run_benchmark("benchmarks.checkpoint_cut", "--quick", out=tmp_path / "c.json")
    assert "puts during a checkpoint / without" in stdout
    titles = [t["title"] for t in data["tables"]]
    assert any("incremental" in t for t in titles), titles
    load = data["data"]["load"]["median"]
    for phase in ("without", "during"):
        assert load[phase]["puts_per_s"] > 0
        assert load[phase]["claims_per_s"] > 0
    for stored in data["data"]["incremental"]:
        for row in stored["incremental"]:
            assert row["new_bytes"] <= row["bytes_written"] < row["new_bytes"] + (1 << 20)
            assert row["bytes_linked"] >= stored["stored_bytes"]
    assert {t["name"] for t in data["targets"]} >= {
        "puts during a checkpoint / without",
        "claims during a checkpoint / without",
    }
