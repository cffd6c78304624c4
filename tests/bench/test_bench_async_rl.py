"""The asyncrl benchmark's figures from demo reports (no demo run: the reports are made here).

samples/s and step time leave out step 0 (actor start-up), the lag histogram
counts every trained sample, "reached" is the first step whose 3-step mean
reward is >= 0.8, and the staleness targets are MISSED when a lag exceeds N.
"""

import pytest

from benchmarks.async_rl import REWARD_REACHED, report, summarize
from benchmarks.common import Options


def demo_report(step_s: list[float], lag_counts: list[list[int]], rewards: list[float]) -> dict:
    steps = [
        {
            "samples": sum(lags),
            "times": {"rollout_wait": t / 2, "train": t / 2},
            "lag_counts": lags,
            "stale_dropped": 1,
            "mean_reward": r,
        }
        for t, lags, r in zip(step_s, lag_counts, rewards)
    ]
    return {"steps": steps, "checks": {"a check": True}}


def test_summary_leaves_out_step_0_and_counts_every_sample_lag():
    run = demo_report([10.0, 1.0, 3.0], [[4], [2, 2], [0, 4]], [0.5, 0.85, 0.9])
    f = summarize(run)
    assert f["samples_per_s"] == pytest.approx(8 / 4.0)
    assert f["median_step_s"] == pytest.approx(2.0)
    assert f["lag_histogram"] == [6, 6]
    assert f["lag_max"] == 1
    assert f["stale_dropped"] == 3
    assert f["wall_s"] == [10.0, 11.0, 14.0]
    assert f["reached_s"] is None  # (0.5 + 0.85 + 0.9) / 3 < 0.8
    late = summarize(demo_report([1.0] * 4, [[4]] * 4, [0.5, 0.8, 0.8, 0.8]))
    assert REWARD_REACHED == 0.8
    assert late["reached_s"] == 4.0


def test_report_judges_speed_up_and_the_bound(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the plot goes to ./bench_results
    runs = {
        "sync": demo_report([5.0, 2.0, 2.0], [[4], [4], [4]], [0.5, 0.6, 0.7]),
        "async N=1": demo_report([5.0, 1.0, 1.0], [[4], [1, 3], [0, 4]], [0.5, 0.6, 0.7]),
        "async N=2": demo_report([5.0, 1.0, 1.0], [[4], [0, 0, 4], [0, 0, 0, 4]], [0.5] * 3),
    }
    section = report(runs, Options())
    verdicts = {t.name: t.met for t in section.targets}
    assert verdicts["async N=1 >= 1.5x synchronous samples/s"] is True  # 4 vs 2 samples/s
    assert verdicts["async N=1: no trained sample more than 1 versions stale"] is True
    assert verdicts["async N=2: no trained sample more than 2 versions stale"] is False  # lag 3
    [table] = section.tables
    assert [row[0] for row in table.rows] == ["sync", "async N=1", "async N=2"]
    pytest.importorskip("matplotlib")
    assert (tmp_path / "bench_results" / "async_rl_reward.png").stat().st_size > 1000
