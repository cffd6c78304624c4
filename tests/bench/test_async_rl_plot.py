"""The asyncrl benchmark's reward plot says what it draws: its x axis starts at 0 (the
first step's start, as its label says) and each point sits at its step's end, so a run
whose first step takes 10 s (starting the rollout actors) shows a curve beginning at 10 s
with the gap in view (docs/async_rl_reward.png once read as starting at 11-12 s)."""

import pytest

from benchmarks.async_rl import plot_rewards, summarize
from benchmarks.common import Options

plt = pytest.importorskip("matplotlib.pyplot")


def test_the_reward_plot_axis_starts_at_the_first_steps_start(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the plot goes to ./bench_results
    steps = [
        {
            "samples": 4,
            "times": {"rollout_wait": t},
            "lag_counts": [4],
            "stale_dropped": 0,
            "mean_reward": r,
        }
        for t, r in ((10.0, 0.5), (1.0, 0.6), (2.0, 0.8))
    ]
    figures = {"sync": summarize({"steps": steps, "checks": {"a check": True}})}
    drawn = []
    monkeypatch.setattr(plt, "close", drawn.append)  # keep the figure to look at it
    path = plot_rewards(figures, Options())
    assert path is not None
    assert (tmp_path / path).stat().st_size > 1000
    [ax] = drawn[0].axes
    curve = ax.get_lines()[0]
    assert list(curve.get_xdata()) == [10.0, 11.0, 13.0]  # each step's end
    assert ax.get_xlim()[0] == 0  # the origin the label names is in view
    label = ax.get_xlabel()
    assert "since the first step started" in label
    assert "each step's end" in label
