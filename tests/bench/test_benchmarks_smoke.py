"""The benchmark harness runs end to end in --quick mode and writes every section's numbers.

A smoke test only: it never asserts on speed (the machine is shared and noisy).
"""

import math

import pytest
from bench_run import run_benchmark

SECTIONS = ("store", "driver", "controller", "scale", "staleness")

pytestmark = pytest.mark.slow  # one full --quick run of the harness, minutes here


def _numbers(obj):
    """Every number anywhere inside a JSON value."""
    if isinstance(obj, bool):
        return
    if isinstance(obj, (int, float)):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _numbers(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _numbers(v)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "results.json"
    return run_benchmark("benchmarks.run", "--quick", "--repeats", "1", "--sizes", "256K", out=out)


@pytest.mark.timeout(450)
def test_every_section_is_reported(results):
    report, stdout = results
    assert report["errors"] == {}
    assert report["failed"] == []
    assert set(report["sections"]) == set(SECTIONS)
    assert "all ran" in stdout.split("## summary", 1)[1]  # and the summary table says so
    for name in SECTIONS:
        assert f"## {name}" in stdout  # a markdown table per section was printed


@pytest.mark.timeout(450)
def test_sections_hold_numbers_and_judged_targets(results):
    report, _ = results
    for name, section in report["sections"].items():
        assert section["tables"], name
        for table in section["tables"]:
            assert table["rows"], name
            assert all(len(r) == len(table["headers"]) for r in table["rows"]), name
        assert section["targets"], name
        for t in section["targets"]:
            assert t["verdict"] in ("met", "MISSED") or t["verdict"].startswith("not evaluated"), t
            if t["verdict"] in ("met", "MISSED"):
                assert isinstance(t["value"], (int, float)), t
                assert math.isfinite(t["value"]), t
        values = list(_numbers(section["data"]))
        assert values, name
        assert all(math.isfinite(v) for v in values), name


@pytest.mark.timeout(450)
def test_key_figures_are_present(results):
    report, _ = results
    s = report["sections"]
    store = s["store"]["data"]["results"]
    assert {r["kind"] for r in store} == {"simple", "complex"}
    for r in store:
        for key in (
            "ours_put_gibps",
            "ours_get_gibps",
            "ray_put_gibps",
            "ray_get_gibps",
            "memcpy_put_gibps",
            "shm_memcpy_put_gibps",
        ):
            assert r[key] > 0, key
    for r in s["driver"]["data"]["results"]:
        assert r["driver_bytes_dataplane"]["sent"] > 0
        assert r["driver_bytes_classic"]["sent"] > r["driver_bytes_dataplane"]["sent"]
        assert r["max_abs_diff_logprobs"] < 1e-4  # both paths computed the same logprobs
    fast = s["driver"]["data"]["fast_compute"]  # the GPU-speed stand-in regime
    assert {r["dp"] for r in fast["results"]} == {2, 4}
    for r in fast["results"]:
        assert r["max_abs_diff_logprobs"] == 0.0
        assert r["driver_bytes_classic"]["sent"] > r["driver_bytes_dataplane"]["sent"]
    summary = s["controller"]["data"]["summary"]
    assert summary["claim_p99_ms"] > 0
    assert summary["commit_samples_per_s"]
    scale = s["scale"]["data"]
    assert scale["footprint"]["samples"] == scale["samples"] > 0
    assert scale["bytes_per_sample_footprint"] > 0
