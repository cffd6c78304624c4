"""The README's main job, in a small configuration, end to end in its own process."""

import json
import os
import subprocess
import sys

import pytest
import torch

from policy_workers.demo import group_advantages, parse_args


def test_small_demo_runs_and_its_checks_pass(tmp_path):
    out = tmp_path / "demo.json"
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "policy_workers.demo",
            "--small",
            "--no-progress",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=420,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["checks"], report
    assert all(report["checks"].values()), report["checks"]
    assert [s["samples"] for s in report["steps"]] == [4, 4]
    assert report["max_reference_logprob_diff"] <= 1e-5
    assert "[PASS]" in proc.stdout
    assert "admin endpoint 127.0.0.1:" in proc.stdout


def test_group_advantages_are_normalised_within_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 4.0])
    adv = group_advantages(rewards, ["a", "a", "b", "b", "c", "c"])
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 0.0, 0.0, -1.0, 1.0]), atol=1e-4)


def test_small_flag_and_bad_flags():
    args = parse_args(["--small"])
    assert (args.steps, args.prompts_per_step, args.generations, args.dp, args.tp) == (
        2,
        2,
        2,
        2,
        1,
    )
    with pytest.raises(SystemExit) as e:
        parse_args(["--dp", "0"])
    assert e.value.code == 2
