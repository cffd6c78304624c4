"""The README's main job, in a small configuration, end to end in its own process.

One run with ``--keep-serving``: the checks pass, the table and every other
line fit 80 columns, no warning is printed, the summary says what the driver
did not carry, the service answers ``dataplane status`` after training, and
SIGTERM ends it with exit 0. The report layout and the flags are checked
without running the demo.
"""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from policy_workers.demo import group_advantages, parse_args
from policy_workers.demo_report import WIDTH, StepReport, report_lines, table_lines

SERVING = "The service stays up: dataplane status --address "


def _lines_of(stream, into: queue.Queue) -> None:
    for line in stream:
        into.put(line.rstrip("\n"))
    into.put(None)


def _read_until(lines: queue.Queue, marker: str, deadline: float, seen: list[str]) -> str:
    """Collect lines until one starts with ``marker``; that line is returned."""
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            break
        seen.append(line)
        if line.startswith(marker):
            return line
    raise AssertionError(f"no line starting with {marker!r}; output so far:\n" + "\n".join(seen))


@pytest.mark.slow
def test_small_demo_runs_keeps_serving_and_its_checks_pass(tmp_path):
    out = tmp_path / "demo.json"
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_AUTH_MODE", None)  # the demo's own choice is under test
    args = ["--small", "--no-progress", "--keep-serving", "--json", str(out)]
    stderr_path = tmp_path / "stderr.txt"
    with open(stderr_path, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "policy_workers.demo", *args],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
        )
        try:
            lines: queue.Queue = queue.Queue()
            threading.Thread(target=_lines_of, args=(proc.stdout, lines), daemon=True).start()
            seen: list[str] = []
            serving = _read_until(lines, SERVING, time.monotonic() + 420, seen)
            address = serving[len(SERVING) :].strip()

            # the service is still up after training: the CLI the demo points to answers
            status = subprocess.run(
                [sys.executable, "-m", "dataplane_server", "status", "--address", address],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert status.returncode == 0, status.stdout + status.stderr
            assert proc.poll() is None  # still serving

            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=120) == 0
            while (line := lines.get(timeout=10)) is not None:
                seen.append(line)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    stdout = "\n".join(seen)
    stderr = stderr_path.read_text()

    report = json.loads(out.read_text())
    assert report["checks"], report
    assert all(report["checks"].values()), report["checks"]
    assert [s["samples"] for s in report["steps"]] == [4, 4]
    assert report["max_reference_logprob_diff"] <= 1e-5
    assert report["samples_lost"] == 0
    # the KL term is on: after the first update the policy has moved from the reference
    assert report["steps"][0]["kl"] == pytest.approx(0.0, abs=1e-9)
    assert report["steps"][1]["kl"] > 0
    for step in report["steps"]:
        # the driver moved 8 bytes of tensors per sample (reward + advantage), nothing per token
        assert step["driver_tensor_bytes"] == 8 * step["samples"]
        assert step["classic_bytes"] > step["driver_tensor_bytes"]

    assert "[PASS]" in stdout
    assert "[FAIL]" not in stdout
    assert "admin endpoint 127.0.0.1:" in stdout
    assert "Samples lost: 0." in stdout
    assert "match a direct computation" in stdout
    assert "went rollout -> store -> worker without it" in stdout
    too_wide = [line for line in seen if len(line) > WIDTH]
    assert not too_wide, too_wide
    assert "WARNING" not in stdout + stderr, stderr
    assert "is_fx_tracing" not in stderr, stderr


def _report(step: int, classic: int) -> StepReport:
    return StepReport(
        step=step,
        samples=4096,
        tokens=987_654,
        classic_bytes=classic,
        driver_bytes=1_234_567,
        driver_tensor_bytes=8 * 4096,
        store_bytes=classic,
        times={"rollout_wait": 123.456, "ref_logprobs": 99.5, "train": 400.0},
        loss=-12.3456,
        grad_norm=1.0,
        kl=1.5e-3,
        mean_reward=0.5,
    )


def test_report_fits_80_columns_even_with_large_figures():
    reports = [_report(0, 9_876_543_210), _report(99, 1_000)]
    checks = {"a check with a name as long as the demo's longest": True}
    lines = report_lines(
        reports, checks, max_logprob_diff=3e-7, tolerance=1e-5, samples_lost=0, backoffs=12
    )
    assert max(len(line) for line in lines) <= WIDTH, [line for line in lines if len(line) > WIDTH]
    header, first, _ = table_lines(reports)
    assert header.split()[:3] == ["step", "samples", "tokens"]
    # columns stay aligned: every value ends where its header ends
    assert len(first) == len(header)
    assert "9876543.2" in first  # classic KB
    assert "Samples lost: 0." in lines[-1]
    assert any("match a direct computation" in line for line in lines)


def test_summary_says_when_logprobs_do_not_match():
    lines = report_lines(
        [_report(0, 10_000)], {}, max_logprob_diff=1e-3, tolerance=1e-5, samples_lost=2, backoffs=0
    )
    assert any("DO NOT match" in line for line in lines)
    assert lines[-1].strip() == "Samples lost: 2."


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
    assert args.kl_penalty > 0  # the demo trains with the KL term on by default
    assert not args.keep_serving
    for bad in (["--dp", "0"], ["--kl-penalty", "-1"], ["--kl-penalty", "nan"]):
        with pytest.raises(SystemExit) as e:
            parse_args(bad)
        assert e.value.code == 2
