"""The chaos run: ``dataplane demo --async --checkpoint-dir`` killed with SIGKILL of its
whole process tree (Ray's processes included) at random points 5 times, resumed from
its directory each time, trains every prompt of the run exactly once: the same set as
an uninterrupted run with the same seed; 0 lost, 0 duplicated, 0 skipped.

The driver, the kill and the counts are ``benchmarks/chaos_resume.py`` (its benchmark
section prints the same table). What is compared is the trained log each checkpoint
holds (``trained_prompts``: step -> prompts, saved with the policy), so the run says
what its policy learned from, not what its processes printed before dying.
"""

from __future__ import annotations

import pytest

from benchmarks.chaos_resume import KILLS, chaos_run, report
from benchmarks.run import render

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def test_the_async_demo_killed_5_times_trains_every_prompt_exactly_once(tmp_path, capsys):
    result = chaos_run(str(tmp_path), kills=KILLS, steps=8, seed=37)
    with capsys.disabled():  # the table goes to CI's log, passed or not
        print("\n" + render(report(result, sum(a.seconds for a in result.attempts))))
    assert result.kills == KILLS
    assert all(a.processes_killed > 2 for a in result.attempts if a.killed)  # Ray's too
    assert sorted(result.trained) == list(range(8))  # the last checkpoint logs every step
    assert all(len(prompts) == 2 for prompts in result.trained.values())  # whole batches
    assert result.counts() == {"lost": 0, "duplicated": 0, "skipped": 0, "extra": 0}
    chaos = sorted(p for prompts in result.trained.values() for p in prompts)
    reference = sorted(p for prompts in result.reference.values() for p in prompts)
    assert chaos == reference == list(range(16))
