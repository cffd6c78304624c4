"""Async RL: the demo's GRPO workload synchronous vs ``--async`` at N = 1 and 2, side by side.

Each configuration is one ``dataplane demo --learn`` run in its own process (its
own local Ray), one after the other on the same machine: the parity task that
the synchronous demo learns in 30 steps (``README.md``, "It learns"), with
one rollout actor, so a step's rollouts (~0.5 s of generation) take about as
long as its passes and train step. Synchronous: every step waits for its
rollouts, generated after the previous step's refit. ``--async --max-staleness
N``: the actor generates continuously, admitted by the store within N versions.

Per configuration, from the demo's JSON report: samples/s over the steps after
the first (step 0 includes starting the actors and their first generation),
the median step time, the version-lag histogram of every trained sample, stale
samples dropped, and the mean reward per step against the run's wall clock
(from the first step's start), plotted as a PNG beside the JSON.

Targets: async N=1 >= 1.5x the synchronous samples/s (AsyncFlow reports 1.59x
on average, AReaL up to 2.77x on large clusters); no trained sample more than
N versions stale. On a machine of 2 shared cores the rollout actor and the
trainer compete for the same cores, which caps what overlap can give.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from benchmarks import async_regime
from benchmarks.common import Options, Section, Table, Target, ratio

TARGET_X_SYNC = 1.5
CONFIGS = {  # name -> demo flags after --learn
    "sync": [],
    "async N=1": ["--async", "--max-staleness", "1"],
    "async N=2": ["--async", "--max-staleness", "2"],
}
WORKLOAD = ["--learn", "--rollout-actors", "1"]
QUICK_STEPS = 6
REWARD_REACHED = 0.8  # "reached": the first step whose mean over 3 steps is at least this


def run(opts: Options) -> Section:
    """The harness's entry: one demo run per configuration, then the tables and the plot."""
    steps = ["--steps", str(QUICK_STEPS)] if opts.quick else []
    runs = {}
    with tempfile.TemporaryDirectory(prefix="bench-async-rl-") as tmp:
        for name, flags in CONFIGS.items():
            opts.log(f"asyncrl: dataplane demo {' '.join(WORKLOAD + flags + steps)}")
            runs[name] = _demo(WORKLOAD + flags + steps, os.path.join(tmp, "report.json"))
    opts.log("asyncrl: GPU-calibrated stand-ins (sleeping), sync and async N=1")
    return report(runs, opts, async_regime.measure(opts))


def _demo(flags: list[str], json_path: str) -> dict[str, Any]:
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)  # the demo starts its own local Ray
    cmd = [sys.executable, "-m", "policy_workers.demo", "--no-progress", "--json", json_path]
    proc = subprocess.run(cmd + flags, capture_output=True, text=True, timeout=1200, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"demo {flags} failed:\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}")
    with open(json_path) as f:
        return json.load(f)


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """One configuration's figures from its demo report (module docstring)."""
    steps = run["steps"]
    step_s = [sum(s["times"].values()) for s in steps]
    steady = steps[1:] or steps
    steady_s = step_s[1:] or step_s
    lags: list[int] = []
    for s in steps:
        for lag, count in enumerate(s["lag_counts"]):
            lags += [lag] * count
    clock, rewards = [], []
    elapsed = 0.0
    for s, t in zip(steps, step_s):
        elapsed += t
        clock.append(elapsed)
        rewards.append(s["mean_reward"])
    return {
        "samples_per_s": sum(s["samples"] for s in steady) / sum(steady_s),
        "median_step_s": statistics.median(steady_s),
        "lag_histogram": [lags.count(lag) for lag in range(max(lags) + 1)],
        "lag_max": max(lags),
        "stale_dropped": sum(s["stale_dropped"] for s in steps),
        "wall_s": clock,
        "rewards": rewards,
        "reached_s": reached(clock, rewards),
        "checks_passed": all(run["checks"].values()),
    }


def reached(clock: list[float], rewards: list[float], window: int = 3) -> float | None:
    """Wall-clock seconds at the first step whose mean reward over the last ``window``
    steps is >= REWARD_REACHED (None: never)."""
    for i in range(window - 1, len(rewards)):
        if sum(rewards[i - window + 1 : i + 1]) / window >= REWARD_REACHED:
            return clock[i]
    return None


def report(
    runs: dict[str, dict[str, Any]],
    opts: Options,
    standin: dict[str, dict[str, Any]] | None = None,
) -> Section:
    """The demo runs' table and targets; with ``standin`` (``async_regime.measure``) the
    GPU-calibrated stand-in rows beside the real CPU ones, in one table, and their targets."""
    section = Section("asyncrl")
    figures = {name: summarize(r) for name, r in runs.items()}
    sync = figures["sync"]["samples_per_s"]
    rows = []
    for name, f in figures.items():
        rows.append(
            [
                name,
                f["samples_per_s"],
                ratio(f["samples_per_s"], sync),
                f["median_step_s"],
                " ".join(f"{lag}:{n}" for lag, n in enumerate(f["lag_histogram"])),
                f["stale_dropped"],
                f["wall_s"][-1],
                "-" if f["reached_s"] is None else f"{f['reached_s']:.1f}",
                f["rewards"][-1],
            ]
        )
    section.tables.append(
        Table(
            f"dataplane demo {' '.join(WORKLOAD)}: synchronous vs --async (one run each; "
            "samples/s and step time over the steps after the first)",
            [
                "configuration",
                "samples/s",
                "x sync",
                "median step s",
                "lag histogram (lag:samples)",
                "stale dropped",
                "wall s",
                f"s to reward >= {REWARD_REACHED}",
                "last reward",
            ],
            rows,
        )
    )
    n1 = figures["async N=1"]["samples_per_s"]
    section.targets.append(
        Target(
            f"async N=1 >= {TARGET_X_SYNC:g}x synchronous samples/s",
            ratio(n1, sync),
            TARGET_X_SYNC,
            True,
            "x",
            detail=f"async N=1 {n1:.1f} vs sync {sync:.1f} samples/s",
        )
    )
    for name, bound in (("async N=1", 1), ("async N=2", 2)):
        section.targets.append(
            Target(
                f"{name}: no trained sample more than {bound} versions stale",
                float(figures[name]["lag_max"]),
                float(bound),
                False,
                " versions",
            )
        )
    if standin is not None:
        section.tables.append(regime_table(figures, standin))
        section.targets += async_regime.targets(standin)
        section.notes.append(f"stand-in calibration: {async_regime.SOURCE}")
    png = plot_rewards(figures, opts)
    if png:
        section.notes.append(f"reward against wall-clock time: {png}")
    if opts.quick:
        section.notes.append(f"--quick: {QUICK_STEPS} steps each; a smoke run, not a measurement")
    section.data = {"configurations": figures, "workload": WORKLOAD, "cpus": os.cpu_count()}
    if standin is not None:
        section.data["standin"] = standin
    return section


def regime_table(figures: dict[str, dict[str, Any]], standin: dict[str, dict[str, Any]]) -> Table:
    """Real CPU (the demo: model, rollouts and training on these cores) and the stand-in
    (generation and training sleep for a published GPU run's times), side by side."""
    rows = []
    sync = figures["sync"]["samples_per_s"]
    for name, f in figures.items():
        rows.append(
            ["real CPU (demo)", name, f["samples_per_s"], ratio(f["samples_per_s"], sync)]
            + ["-", "-", f["median_step_s"], f["stale_dropped"]]
        )
    sync = standin["stand-in sync"]["samples_per_s"]
    for name, f in standin.items():
        rows.append(
            ["GPU-calibrated stand-in (sleeps)", name, f["samples_per_s"]]
            + [ratio(f["samples_per_s"], sync), f["ideal_samples_per_s"], f["of_ideal"]]
            + [f["median_step_s"], f["stale_dropped"]]
        )
    return Table(
        "where async pays: real CPU runs vs stand-ins for GPU kernels (generation "
        f"{async_regime.GEN_S * 1e3:.0f} ms per batch, training {async_regime.TRAIN_S * 1e3:.0f} "
        "ms per step, from a published GPU run; samples/s over the steps after the first)",
        [
            "workload",
            "configuration",
            "samples/s",
            "x sync",
            "ideal samples/s",
            "of ideal",
            "median step s",
            "stale dropped",
        ],
        rows,
    )


def plot_rewards(figures: dict[str, dict[str, Any]], opts: Options) -> str | None:
    """Mean reward per step against wall-clock seconds, one line per configuration, as a
    PNG in bench_results/ (None when matplotlib is missing: the tables still stand)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display
        import matplotlib.pyplot as plt
    except ImportError:
        opts.log("asyncrl: matplotlib not installed (pip install -e '.[bench]'): no plot")
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, f in figures.items():
        ax.plot(f["wall_s"], f["rewards"], marker=".", label=name)
    ax.axhline(0.5, color="grey", linestyle=":", label="random policy")
    # Each point sits at its step's end; the first step starts the rollout actors and waits
    # for their first generation, so the curves begin seconds after 0, which stays in view.
    ax.set_xlim(left=0)
    ax.set_xlabel(
        "wall-clock seconds since the first step started; a point at each step's end\n"
        "(the first step includes starting the rollout actors)"
    )
    ax.set_ylabel("mean reward of the step's batch")
    ax.set_title("dataplane demo --learn: synchronous vs --async")
    ax.legend()
    os.makedirs("bench_results", exist_ok=True)
    path = os.path.join("bench_results", "async_rl_reward.png")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path
