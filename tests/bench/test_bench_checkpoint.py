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
    shares = data["data"]["load"]
    default = data["data"]["default_copy_share"]
    assert set(shares) == {"1", f"{default:g}"}, shares  # full speed beside the default pacing
    for load in shares.values():
        for phase in ("without", "during"):
            assert load["median"][phase]["puts_per_s"] > 0
            assert load["median"][phase]["claims_per_s"] > 0
    for stored in data["data"]["incremental"]:
        for row in stored["incremental"]:
            assert row["new_bytes"] <= row["bytes_written"] < row["new_bytes"] + (1 << 20)
            assert row["bytes_linked"] >= stored["stored_bytes"]
    names = {t["name"] for t in data["targets"]}
    for verb in ("puts", "claims"):
        assert (
            f"{verb} during a checkpoint / without (copy share {default:g}, the default)" in names
        )
