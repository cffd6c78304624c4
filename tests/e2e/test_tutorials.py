"""The numbered tutorials in docs/tutorials/ run as printed and print what they promise.

05 runs in this process on the in-process client (no Ray); 01 and 04 run in this process
on the session's Ray (their ``ensure_local_ray`` is then
a no-op, and each starts and shuts down a service of its own name); 02 needs no Ray;
03 runs as its own process, as a user runs it, since it starts ``dataplane serve``
(with its own embedded Ray) and joins that cluster as a driver. Every tutorial file
has a test here, and the README links them in order.
"""

from __future__ import annotations

import importlib.util
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
from polling import wait_until

ROOT = Path(__file__).resolve().parents[2]
TUTORIALS = ROOT / "docs" / "tutorials"
RUN_HERE = ("01_data_path.py", "02_claim_policy.py", "04_async_rl.py", "05_paced_async_pull.py")
RUN_APART = ("03_operate_a_service.py",)


def run_here(name: str, capsys) -> str:
    """The tutorial run as ``python docs/tutorials/<name>`` would, in this process; its output."""
    runpy.run_path(str(TUTORIALS / name), run_name="__main__")
    return capsys.readouterr().out


def test_every_tutorial_is_run_here_and_numbered_in_order():
    found = sorted(p.name for p in TUTORIALS.glob("*.py"))
    assert found == sorted(RUN_HERE + RUN_APART)
    assert [int(name[:2]) for name in found] == list(range(1, len(found) + 1))
    for path in TUTORIALS.glob("*.py"):  # each explains itself before its code
        docstring = path.read_text().split('"""')[1]
        assert docstring.startswith(f"Tutorial {path.name[:2]}: "), path.name
        assert "Run it: ``.venv/bin/python docs/tutorials/" in docstring, path.name


def test_the_readme_links_the_tutorials_in_order():
    readme = (ROOT / "README.md").read_text()
    linked = list(dict.fromkeys(re.findall(r"\]\((docs/tutorials/\d\d_\w+\.py)\)", readme)))
    assert linked == [f"docs/tutorials/{n}" for n in sorted(RUN_HERE + RUN_APART)]
    index = (TUTORIALS / "README.md").read_text()
    assert re.findall(r"\]\((\d\d_\w+\.py)\)", index) == sorted(RUN_HERE + RUN_APART)


def test_the_tutorial_index_names_only_code_that_exists(monkeypatch):
    # The check README.md and docs/architecture.md pass (tests/project/test_doc_names.py),
    # run on docs/tutorials/README.md.
    spec = importlib.util.spec_from_file_location(
        "tutorial_doc_names", ROOT / "tests" / "project" / "test_doc_names.py"
    )
    assert spec is not None
    assert spec.loader is not None
    checker = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, checker)  # its dataclasses look it up there
    spec.loader.exec_module(checker)
    text = (TUTORIALS / "README.md").read_text()
    assert len(checker.code_spans(text)) > 10  # it read the spans
    assert checker.stale_names(checker.repo_index(), text) == []


def test_02_a_claim_policy_of_your_own(capsys):
    out = run_here("02_claim_policy.py", capsys).splitlines()
    assert out[0] == "alone: [1, 2]"
    assert out[1] == "claims: ['p1', 'p4'] ['p2', 'p0', 'p3']"  # shortest first: 2, 3 | 5, 7, 9
    assert out[2].startswith("refused: shortest_first: window must be an int >= 1, got 0")


def test_01_the_data_path(ray_session, capsys):
    out = run_here("01_data_path.py", capsys).splitlines()
    assert out == [
        "rank 0: ['s0', 's1']",
        "rank 1: ['s2', 's3']",
        "logprobs per sample: [3, 5, 2, 4]",  # written back per rank, read back jagged
        "freed: 4 samples",
    ]

    def gone() -> bool:  # its service was shut down (Ray forgets a killed actor's name)
        try:
            ray_session.get_actor("tutorial-01", namespace="tutorials")
        except ValueError:
            return True
        return False

    wait_until(gone, 30, "tutorial 01's controller to be gone")


def test_04_an_async_rl_loop(ray_session, capsys):
    out = run_here("04_async_rl.py", capsys).splitlines()
    steps = [
        re.fullmatch(r"step (\d): version (\d), 8 samples, lags \[([\d, ]+)\], reward .*", s)
        for s in out[:4]
    ]
    assert all(steps), out
    assert [int(m.group(2)) for m in steps] == [0, 1, 2, 3]  # one version per step
    assert all(int(lag) <= 1 for m in steps for lag in m.group(3).split(", "))
    summary = re.fullmatch(
        r"trained 32 samples in 4 steps, max lag ([01]) <= 1; (\d+) groups generated, "
        r"(\d+) samples dropped stale, (\d+) filtered out",
        out[4],
    )
    assert summary, out
    # Every third group (rewards all equal) never reaches the trainer: 8 trained groups
    # need at least 12 generated; group 0 is judged by the first claim, and whole groups go.
    assert int(summary.group(2)) >= 12
    assert int(summary.group(4)) % 4 == 0
    assert int(summary.group(4)) >= 4


def test_05_paced_admission_versions_where_and_per_rank_pulls(capsys):
    out = run_here("05_paced_async_pull.py", capsys).splitlines()
    steps = [
        re.fullmatch(
            r"step (\d): 8 samples \((\d+) resumed partial rollouts\), "
            r"tokens per rank \[(\d+), (\d+)\], lags \[([\d, ]+)\]",
            s,
        )
        for s in out[:4]
    ]
    assert all(steps), out
    assert [int(m.group(1)) for m in steps] == [0, 1, 2, 3]
    assert all(int(lag) <= 1 for m in steps for lag in m.group(5).split(", "))  # the window
    assert all(int(m.group(3)) > 0 and int(m.group(4)) > 0 for m in steps)  # both ranks pulled
    # Partial rollouts: odd groups are stored in two segments and trained whole.
    assert sum(int(m.group(2)) for m in steps) > 0
    summary = re.fullmatch(r"dropped stale: (\d+), filtered: (\d+)", out[4])
    assert summary, out
    assert int(summary.group(1)) == 0  # paced: the trainer takes each sample in its window
    filtered = int(summary.group(2))
    assert filtered >= 2  # group 0 has no reward spread and is judged by the first claim
    assert filtered % 2 == 0  # whole groups


@pytest.mark.slow
def test_03_operate_a_service():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "DATAPLANE_"))}
    proc = subprocess.run(
        [sys.executable, str(TUTORIALS / "03_operate_a_service.py")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert re.search(r"^serving: ray 127\.0\.0\.1:\d+, admin 127\.0\.0\.1:\d+$", out, re.M), out
    assert re.search(r"^holds +1 partitions, 3 samples", out, re.M), out  # dataplane status
    assert re.search(r"^saved checkpoint /\S+/ckpt$", out, re.M), out
    assert re.search(r"^restored 3 samples from /\S+/ckpt$", out, re.M), out
    assert "after restore: ['a', 'b', 'c'], sum 66" in out  # every byte came back
    assert out.rstrip().endswith("serve exited 0"), out  # drained and stopped cleanly
