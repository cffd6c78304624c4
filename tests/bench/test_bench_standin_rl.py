"""The stand-in RL loop (``benchmarks/standin_rl.py``) and the sections built on it:
``pacing`` (stale drops, KS) and the asyncrl section's GPU-calibrated rows.

Without Ray: the KS statistic, the long-tail lengths, the calibration's ideal overlap,
and the tables and targets judged from made-up figures. With the session's Ray: a tiny
long-tail run through a real service, where paced admission drops nothing and trains
every generated sample (a property of pacing, not of timing). Never asserts on speed.
"""

import pytest

from benchmarks import async_pacing, async_regime
from benchmarks.async_rl import report
from benchmarks.common import Options
from benchmarks.standin_rl import Workload, ks_statistic, long_tail_lengths, run_async, run_sync


def test_ks_statistic_is_the_largest_gap_between_the_two_distribution_functions():
    assert ks_statistic([1, 2, 3], [3, 2, 1]) == 0.0
    assert ks_statistic([1, 2], [5, 6, 7]) == 1.0
    assert ks_statistic([1, 2, 3, 4], [3, 4, 5, 6]) == pytest.approx(0.5)


def test_long_tail_lengths_are_seeded_capped_and_positive():
    a = long_tail_lengths(2000, 512, 1.2, 8192, seed=3)
    assert a == long_tail_lengths(2000, 512, 1.2, 8192, seed=3)
    assert min(a) >= 1
    assert max(a) == 8192  # the tail reaches the cap
    assert sorted(a)[1000] < 1024  # and the median stays near 512


def test_the_calibration_is_the_published_runs_phase_times():
    assert round(async_regime.GEN_S, 6) == 0.321
    assert round(async_regime.TRAIN_S, 6) == 0.374
    ideal = async_regime.ideal_samples_per_s()
    assert ideal["async"] / ideal["sync"] == pytest.approx(695 / 374)


def _standin(samples_per_s, of_ideal, dropped=0):
    return {
        "samples_per_s": samples_per_s,
        "ideal_samples_per_s": samples_per_s / of_ideal,
        "of_ideal": of_ideal,
        "median_step_s": 0.4,
        "stale_dropped": dropped,
    }


def test_the_asyncrl_table_puts_real_cpu_and_stand_in_rows_side_by_side(tmp_path, monkeypatch):
    from test_bench_async_rl import demo_report

    monkeypatch.chdir(tmp_path)
    runs = {
        name: demo_report([5.0, 2.0, 2.0], [[4], [4], [4]], [0.5, 0.6, 0.7])
        for name in ("sync", "async N=1", "async N=2")
    }
    standin = {
        "stand-in sync": _standin(10.0, 0.95),
        "stand-in async N=1": _standin(14.0, 0.7, dropped=70),
        "stand-in async N=1 paced": _standin(19.0, 0.92),
    }
    section = report(runs, Options(), standin)
    table = section.tables[1]
    assert [r[0] for r in table.rows] == ["real CPU (demo)"] * 3 + [
        "GPU-calibrated stand-in (sleeps)"
    ] * 3
    verdicts = {t.name: t.met for t in section.targets}
    assert verdicts["stand-in async N=1 paced >= 0.9 of ideal overlap"] is True
    assert verdicts["stand-in async N=1 paced >= 1.5x stand-in sync"] is True  # 1.9x
    assert section.data["standin"] is standin


def test_the_pacing_targets_judge_the_paced_n1_run():
    base = {
        "samples_per_s": 1.0,
        "generated": 100,
        "trained": 100,
        "mean_generated": 1.0,
        "mean_trained": 1.0,
        "p99_generated": 1.0,
        "p99_trained": 1.0,
        "admission_waits": 0,
    }
    figures = {
        "N=1 unpaced": {**base, "stale_dropped": 30, "dropped_fraction": 0.3, "ks": 0.2},
        "N=1 paced": {**base, "stale_dropped": 2, "dropped_fraction": 0.02, "ks": 0.01},
    }
    section = async_pacing.report(figures, 5, Options())
    assert [t.met for t in section.targets] == [False, True]  # 2% dropped; KS 0.01
    assert [r[0] for r in section.tables[0].rows] == ["N=1 unpaced", "N=1 paced"]


@pytest.fixture(scope="module")
def client(module_services):
    c = module_services("bench-standin").client()
    yield c
    c.close()


TINY = Workload(
    batch=4,
    slots=8,
    train_s=0.01,
    s_per_token=0.06 / 8192,
    lengths=long_tail_lengths(64, 512, 1.5, 8192),
)


def test_paced_async_trains_every_generated_sample(client):
    out = run_async(client, TINY, steps=6, max_staleness=1, pace=True)
    assert out.stale_dropped == 0
    assert len(out.trained) >= 6 * TINY.batch
    assert sorted(out.trained) == sorted(out.generated)
    assert ks_statistic(out.trained, out.generated) == 0.0


def test_unpaced_async_trains_or_drops_every_generated_sample(client):
    out = run_async(client, TINY, steps=6, max_staleness=1, pace=False)
    assert len(out.trained) + out.stale_dropped == len(out.generated)


def test_sync_trains_each_batch_it_generated(client):
    out = run_sync(client, TINY, steps=3)
    assert out.stale_dropped == 0
    assert sorted(out.trained) == sorted(out.generated)
    assert len(out.trained) == 3 * TINY.batch
