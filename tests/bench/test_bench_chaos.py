"""The chaos section's parts that need no demo run: its counts and verdicts from made-up
trained logs, and the kill of a whole process tree (children that left the process
group or the session included). The run itself: ``tests/e2e/test_chaos_resume.py``."""

from __future__ import annotations

import subprocess

import psutil
from polling import wait_until

from benchmarks.chaos_resume import Attempt, ChaosResult, kill_tree, report, step_rows


def _result(trained: dict[int, list[int]]) -> ChaosResult:
    attempts = [Attempt(None, 9.0, 4.0, 1, True, 12), Attempt("step-1", 8.0, 3.0, 2, False)]
    return ChaosResult(4, {0: [0, 1], 1: [2, 3]}, trained, attempts, reference_s=7.0)


def test_a_clean_run_meets_every_target_and_each_fault_is_named():
    clean = report(_result({0: [0, 1], 1: [2, 3]}), 20.0, kills=1)
    assert not clean.missed
    assert clean.data["counts"] == {"lost": 0, "duplicated": 0, "skipped": 0, "extra": 0}
    [summary, attempts] = clean.tables
    assert summary.rows[0][:8] == [1, 4, 4, 0, 0, 0, "yes", "yes"]
    assert [row[2] for row in attempts.rows] == ["yes", "no (finished)"]

    twice = report(_result({0: [0, 1], 1: [1, 3]}), 20.0)  # prompt 1 twice, 2 never
    verdicts = {t.name: t.met for t in twice.targets}
    assert twice.data["counts"] == {"lost": 1, "duplicated": 1, "skipped": 1, "extra": 0}
    assert verdicts["prompts duplicated across the kills"] is False
    assert verdicts["prompts skipped across the kills"] is False
    assert verdicts["trained set equals the uninterrupted run's"] is False
    assert verdicts["SIGKILLs of the whole process tree"] is False  # 1 of 5


def test_step_rows_are_the_demo_table_rows_only():
    text = (
        "step samples tokens classic KB driver KB wait s pass s     loss      kl reward\n"
        "   0       4     36        2.5       3.4  17.70   0.21   0.1000 0.0e+00  0.367\n"
        "checkpoint after step 0: /tmp/x/step-1\n"
        "   1       4     34        2.8       3.4   0.05   0.32  -0.1110 2.0e-05  0.438\n"
        "   0 samples claimed after step 2 handed back; 4 prompts left to generate\n"
    )
    assert [row.split()[0] for row in step_rows(text)] == ["0", "1"]


def test_kill_tree_kills_children_that_left_the_group_and_the_session():
    # a child in the session, one in its own process group, one in its own session
    script = "sleep 300 & (set -m; sleep 300) & setsid sleep 300 & wait"
    proc = subprocess.Popen(["bash", "-c", script], start_new_session=True)
    root = psutil.Process(proc.pid)
    wait_until(lambda: len(root.children(recursive=True)) >= 3, 30, "the three sleeps")
    tree = [root, *root.children(recursive=True)]
    assert kill_tree(proc) >= 4
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in tree)
