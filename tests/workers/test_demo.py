"""The README's main job, in a small configuration, end to end in its own process.

One run with ``--keep-serving``: the checks pass, the table and every other
line fit 80 columns, no warning is printed, the summary says what the driver
did not carry, the service answers ``dataplane status`` after training, and
SIGTERM ends it with exit 0. The report layout and the flags are checked
without running the demo.

Checkpoint and resume: a straight run saving after every step, and a second
run resumed from its mid-run checkpoint (step 1's rollouts partly in the store
checkpoint, the rest regenerated), end with bit-identical weights and optimizer
state, and the resumed step logs the same loss, KL and reward, exactly.
``--resume`` takes the run's flags from the checkpoint and refuses conflicting ones.
"""

import hashlib
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

from policy_workers.demo import (
    Tally,
    add_run_checks,
    fit,
    group_advantages,
    learned_check,
    parse_args,
)
from policy_workers.demo_checkpoint import RUN_FLAGS
from policy_workers.demo_report import (
    LEGEND,
    WIDTH,
    StepReport,
    header_line,
    report_lines,
    row_line,
    table_lines,
)

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


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Shared by this module's demo runs: the first one's checkpoints are the straight
    run the resume test compares with (one demo run fewer in CI)."""
    return tmp_path_factory.mktemp("demo-runs")


@pytest.mark.slow
def test_small_demo_runs_keeps_serving_and_its_checks_pass(tmp_path, runs):
    out = runs / "straight.json"
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_AUTH_MODE", None)  # the demo's own choice is under test
    args = ["--small", "--no-progress", "--keep-serving", "--json", str(out)]
    args += ["--checkpoint-dir", str(runs / "straight")]
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
    # refit after every step: each step trained on samples of the policy it updated
    assert [(s["lag_max"], s["lag_mean"]) for s in report["steps"]] == [(0, 0.0), (0, 0.0)]
    assert all(s["times"]["refit"] > 0 for s in report["steps"])
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
    # Each row went out as its step finished: before that step's checkpoint line, not
    # with the report after the run.
    header = next(
        i for i, line in enumerate(seen) if line.split()[:3] == ["step", "samples", "tokens"]
    )
    assert seen[header + 1].split()[0] == "0", seen[header:]
    saved = next(i for i, line in enumerate(seen) if line.startswith("checkpoint after step 0"))
    assert header + 1 < saved
    assert sum(line.split()[:3] == ["step", "samples", "tokens"] for line in seen) == 1
    too_wide = [line for line in seen if len(line) > WIDTH]
    assert not too_wide, too_wide
    assert "WARNING" not in stdout + stderr, stderr
    assert "is_fx_tracing" not in stderr, stderr
    # Ray's error line for a restartable actor whose constructor arguments sit in the
    # starter's object store (it was printed while the controller got unit handles).
    assert "constructor arguments in the object store" not in stdout + stderr, stderr


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


def test_legend_explains_why_a_small_run_can_show_driver_kb_above_classic_kb():
    # --small measured 4.4 driver KB against 4.2 classic KB per step, unexplained.
    legend = " ".join(LEGEND)
    assert "--small" in legend
    assert "driver KB above classic KB" in legend
    assert max(len(line) for line in LEGEND) <= WIDTH


def test_rows_print_one_by_one_as_the_table_would():
    reports = [_report(0, 1_000), _report(1, 2_000)]
    assert [header_line(), *map(row_line, reports)] == table_lines(reports)
    after = report_lines(
        reports,
        {},
        max_logprob_diff=0.0,
        tolerance=1e-5,
        samples_lost=0,
        backoffs=0,
        with_table=False,
    )
    assert header_line() not in after  # the rows went out live: not printed twice


def test_summary_says_when_logprobs_do_not_match():
    lines = report_lines(
        [_report(0, 10_000)], {}, max_logprob_diff=1e-3, tolerance=1e-5, samples_lost=2, backoffs=0
    )
    assert any("DO NOT match" in line for line in lines)
    assert lines[-1].strip() == "Samples lost: 2."


def test_a_synchronous_run_prints_no_async_columns_and_the_legend_names_every_column():
    """A synchronous run printed thirty rows of all-zero lag / stale / admit columns; the
    legend said nothing of reward, loss and KL."""
    reports = [_report(0, 1_000), _report(1, 2_000)]

    figures = {"max_logprob_diff": 0.0, "tolerance": 1e-5, "samples_lost": 0, "backoffs": 0}

    def printed(async_columns: bool) -> str:
        lines = report_lines(reports, {}, async_columns, **figures)
        assert max(len(line) for line in lines) <= WIDTH
        return "\n".join(lines)

    sync, run_async = printed(False), printed(True)
    for async_only in ("lag max", "lag mean", "stale dropped", "admit waits", "lag:"):
        assert async_only not in sync, async_only
        assert async_only in run_async, async_only
    legend = " ".join(LEGEND)
    for column in ("loss:", "kl:", "reward:"):
        assert column in legend, column


def test_the_learn_check_prints_the_mean_it_measured_and_says_version_right():
    reports = [_report(k, 1_000) for k in range(12)]
    for k, r in enumerate(reports):
        r.mean_reward = 0.9 if k >= 2 else 0.1  # the last 10: 0.9
    name, passed = learned_check(reports)
    assert passed
    assert "0.900 >= 0.7" in name
    assert len(f"[PASS] {name}") <= WIDTH
    reports[-1].mean_reward = 0.0  # the mean falls to 0.81
    assert "0.810" in learned_check(reports)[0]
    tally = Tally(reports=reports)
    add_run_checks(tally, samples_lost=0, per_step=reports[0].samples, max_staleness=1)
    assert "no trained sample was more than 1 version stale" in tally.checks
    add_run_checks(tally, samples_lost=0, per_step=reports[0].samples, max_staleness=2)
    assert "no trained sample was more than 2 versions stale" in tally.checks


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
    bad_flags = (
        ["--dp", "0"],
        ["--kl-penalty", "-1"],
        ["--kl-penalty", "nan"],
        ["--lr", "0"],
        ["--max-staleness", "1"],  # without --async: the synchronous demo is on-policy
        ["--async", "--max-staleness", "-1"],
        ["--partial-rollouts"],  # without --async: no weight update interrupts a rollout
        ["--minibatches", "3"],  # 16 samples do not split into 3 equal minibatches
        ["--small", "--learn"],
        ["--vocab-size", "4"],
    )
    for bad in bad_flags:
        with pytest.raises(SystemExit) as e:
            parse_args(bad)
        assert e.value.code == 2


HELP_PROBE = """
import json, sys
from dataplane_server.cli import main
try:
    main(["demo", "--help"])
except SystemExit as e:
    code = e.code
heavy = [m for m in ("torch", "transformers", "ray") if m in sys.modules]
print(json.dumps({"code": code, "heavy": heavy}), file=sys.stderr)
"""


def test_demo_help_imports_no_torch_and_explains_every_flag_with_its_default():
    """`dataplane demo --help` took 11 s importing torch before parsing: it must import
    neither torch, transformers nor Ray (measured in sys.modules, not timed)."""
    proc = subprocess.run(
        [sys.executable, "-c", HELP_PROBE], capture_output=True, text=True, timeout=120
    )
    probe = json.loads(proc.stderr.strip().splitlines()[-1])
    assert probe == {"code": 0, "heavy": []}, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "usage: dataplane demo" in text
    # The description is a whole sentence (it was cut: "... on an embedded local default.").
    description = text.split("options:")[0].split("]")[-1].strip()
    assert description.endswith("."), description
    assert "GRPO" in description, description
    helps = _option_helps(proc.stdout)
    from policy_workers.demo import build_parser

    for action in build_parser()._actions:
        flag = action.option_strings[0]
        if action.dest == "help":
            continue
        assert action.help, f"{flag} has no help"
        if action.default not in (None, False):
            assert f"(default: {action.default})" in helps[flag], (flag, helps[flag])
    for flag, default in (
        ("--steps", 3),
        ("--prompts-per-step", 4),
        ("--prompt-len", 8),
        ("--min-new-tokens", 8),
        ("--max-new-tokens", 32),
        ("--dp", 2),
        ("--tp", 2),
        ("--rollout-actors", 2),
        ("--packing", "sequence"),
    ):
        assert f"(default: {default})" in helps[flag], (flag, helps[flag])
    assert "progress bars" in helps["--no-progress"]


def test_the_top_level_help_says_what_the_demo_does():
    """`dataplane --help` listed the demo as "from policy_workers.demo"."""
    proc = subprocess.run(
        [sys.executable, "-m", "dataplane_server", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    demo = text.split(" demo ", 1)[1]
    assert demo.startswith("train a tiny model with GRPO end to end through the data plane"), demo
    assert "from policy_workers" not in text


def _option_helps(help_text: str) -> dict[str, str]:
    """argparse's options section as {first flag: its whole entry, on one line}."""
    entries: dict[str, str] = {}
    flag = None
    for line in help_text.split("options:", 1)[1].splitlines():
        if line.startswith("  -"):
            flag = line.split()[0].rstrip(",")
            entries[flag] = ""
        if flag is not None:
            entries[flag] += " " + " ".join(line.split())
    return entries


def _run_demo(args: list[str], tmp_path, name: str) -> tuple[dict, list[str]]:
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_AUTH_MODE", None)
    out = tmp_path / f"{name}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "policy_workers.demo", "--no-progress", "--json", str(out), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert not [line for line in lines if len(line) > WIDTH]
    report = json.loads(out.read_text())
    assert all(report["checks"].values()), report["checks"]
    return report, lines


def _tensors(part_dir) -> dict[str, object]:
    """Every rank file of a policy checkpoint part, loaded."""
    return {f.name: torch.load(f, weights_only=True) for f in sorted(part_dir.glob("rank-*.pt"))}


def _assert_same(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.slow
@pytest.mark.timeout(1500)  # up to two demo runs, each ~2-5 min on a loaded 2-core machine
def test_a_run_resumed_from_a_checkpoint_ends_bit_for_bit_like_the_straight_run(tmp_path, runs):
    straight_dir, resumed_dir = runs / "straight", tmp_path / "resumed"
    if (runs / "straight.json").exists():  # the serving test above made it
        straight = json.loads((runs / "straight.json").read_text())
    else:  # run alone (-k)
        straight, _ = _run_demo(
            ["--small", "--checkpoint-dir", str(straight_dir)], runs, "straight"
        )
    assert [os.path.basename(p) for p in straight["checkpoints"]] == ["step-1", "step-2"]
    # no --small: the flags come from the checkpoint (rollout actors do not shape the data)
    resumed, lines = _run_demo(
        ["--resume", str(straight_dir / "step-1"), "--checkpoint-dir", str(resumed_dir)],
        tmp_path,
        "resumed",
    )
    assert resumed["first_step"] == 1
    assert any(line.startswith("resumed at step 1: policy loaded") for line in lines)
    assert [s["step"] for s in resumed["steps"]] == [1]
    for key in ("samples", "tokens", "loss", "grad_norm", "kl", "mean_reward"):
        assert resumed["steps"][0][key] == straight["steps"][1][key], key  # exact, not approx
    for part in ("weights", "optimizer"):
        a = _tensors(straight_dir / "step-2" / "policy" / part)
        b = _tensors(resumed_dir / "step-2" / "policy" / part)
        assert len(a) == 2  # DP=2
        _assert_same(a, b, part)
    print(
        f"\nresumed step 1: loss {resumed['steps'][0]['loss']!r}, "
        f"{resumed['restored_samples']} samples restored from the store checkpoint"
    )


def _fake_run(root, next_step: int, **flags) -> str:
    """A run checkpoint directory with empty parts (enough for parse_args)."""
    defaults = parse_args([])
    base = {name: getattr(defaults, name) for name in RUN_FLAGS}
    base.update(steps=2, prompts_per_step=2, generations=2, dp=2, tp=1, packing="sequence")
    base.update(flags)
    run = root / f"step-{next_step}"
    parts = {}
    for part in ("store", "policy/weights", "policy/optimizer"):
        (run / part).mkdir(parents=True)
        (run / part / "manifest.json").write_text("{}")
        digest = hashlib.sha256(b"{}").hexdigest()
        parts[part] = {"path": part, "manifest_sha256": digest}
    manifest = {
        "format": 1,
        "kind": "dataplane-demo-run",
        "next_step": next_step,
        "flags": base,
        "parts": parts,
    }
    (run / "manifest.json").write_text(json.dumps(manifest))
    return str(run)


def test_resume_takes_the_run_flags_from_the_checkpoint_and_refuses_conflicts(tmp_path, capsys):
    _fake_run(tmp_path, 1)
    latest = _fake_run(tmp_path, 3, steps=5)
    args = parse_args(["--resume", str(tmp_path)])  # a --checkpoint-dir: its latest step
    assert args.resume_manifest["next_step"] == 3
    assert (args.steps, args.dp, args.tp, args.generations) == (5, 2, 1, 2)
    assert parse_args(["--resume", latest, "--steps", "7"]).steps == 7  # a run may go on longer

    bad = [
        (["--resume", latest, "--dp", "4"], "--dp 4 here, the checkpoint was run with 2"),
        (["--resume", _fake_run(tmp_path / "done", 2)], "already trained all 2 steps"),
        (["--resume", str(tmp_path / "nothing")], "no demo checkpoint at"),
    ]
    for argv, message in bad:
        with pytest.raises(SystemExit) as e:
            parse_args(argv)
        assert e.value.code == 2
        assert message in capsys.readouterr().err
    (tmp_path / "step-3" / "store" / "manifest.json").write_text("{ }")
    with pytest.raises(SystemExit):
        parse_args(["--resume", latest])
    assert "its manifest is not the one saved" in capsys.readouterr().err


def test_async_saves_and_resumes_and_a_resume_keeps_its_staleness(tmp_path, capsys):
    args = parse_args(["--async", "--max-staleness", "1", "--checkpoint-dir", str(tmp_path)])
    assert args.async_mode
    assert args.checkpoint_dir == str(tmp_path)
    latest = _fake_run(tmp_path, 2, steps=4, async_mode=True, max_staleness=1)
    resumed = parse_args(["--resume", latest])
    assert (resumed.async_mode, resumed.max_staleness) == (True, 1)
    with pytest.raises(SystemExit):
        parse_args(["--resume", latest, "--async", "--max-staleness", "2"])
    assert "--max-staleness 2 here, the checkpoint was run with 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a synchronous run does not go on asynchronously
        parse_args(["--resume", _fake_run(tmp_path / "sync", 1), "--async"])
    assert "--async True here, the checkpoint was run with False" in capsys.readouterr().err


def test_long_lines_are_cut_in_the_middle_to_80_columns():
    line = "checkpoint after step 3: /" + "very/long/" * 20 + "step-4"
    cut = fit(line)
    assert len(cut) == WIDTH
    assert cut.startswith("checkpoint after step 3:")
    assert cut.endswith("step-4")
    assert fit("short") == "short"


@pytest.mark.slow
@pytest.mark.timeout(600)  # ~80 s alone on 2 cores; a bound on a hang
def test_the_learn_configuration_learns_the_parity_task(tmp_path):
    """With refit after every step the policy is trained on its own samples: the mean
    reward rises from a random policy's ~0.5 to the --learn check's bound."""
    from policy_workers.demo import LEARN_STEPS, LEARNED_OVER, LEARNED_REWARD

    report, lines = _run_demo(["--learn"], tmp_path, "learn")
    rewards = [s["mean_reward"] for s in report["steps"]]
    assert len(rewards) == LEARN_STEPS
    assert rewards[0] < 0.6  # it starts as a random policy
    assert sum(rewards[-LEARNED_OVER:]) / LEARNED_OVER >= LEARNED_REWARD
    assert any(
        line.startswith("[PASS] it learned: the last 10 steps' mean reward") for line in lines
    )
    print(f"\n--learn mean rewards: {[round(r, 2) for r in rewards]}")


@pytest.mark.slow
@pytest.mark.timeout(1500)  # up to two demo runs on a loaded 2-core machine
def test_async_with_max_staleness_0_trains_exactly_what_the_synchronous_demo_trains(tmp_path, runs):
    """One group admitted per prompt and version, after the refit: the same batches, the
    same updates, bit for bit (and the bound's check passes, every lag 0)."""
    if (runs / "straight.json").exists():  # the serving test above made it (--small)
        sync = json.loads((runs / "straight.json").read_text())
    else:  # run alone (-k)
        sync, _ = _run_demo(["--small"], runs, "straight")
    async0, lines = _run_demo(["--small", "--async", "--max-staleness", "0"], tmp_path, "async0")
    keys = ("samples", "tokens", "loss", "grad_norm", "kl", "mean_reward", "classic_bytes")
    assert [[s[k] for k in keys] for s in async0["steps"]] == [
        [s[k] for k in keys] for s in sync["steps"]
    ]
    assert [s["lag_max"] for s in async0["steps"]] == [0, 0]
    assert async0["checks"]["no trained sample was more than 0 versions stale"]  # plural
    assert "  async: generating continuously, at most 0 versions stale" in lines


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_async_with_max_staleness_1_never_trains_a_sample_more_than_1_version_stale(tmp_path):
    report, lines = _run_demo(["--small", "--async", "--max-staleness", "1"], tmp_path, "async1")
    lags = [s["lag_max"] for s in report["steps"]]
    assert len(lags) == 2  # --small: 2 steps
    assert max(lags) <= 1, lags
    assert "[PASS] no trained sample was more than 1 version stale" in lines
    print(
        f"\n--async --max-staleness 1: lag max per step {lags}, stale dropped "
        f"{[s['stale_dropped'] for s in report['steps']]}"
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_async_with_partial_rollouts_reports_what_weight_updates_interrupted(tmp_path):
    """--partial-rollouts: no generated token is thrown away at a weight update (whether a
    refit lands mid-generation in a run this small is up to timing: the actor-level test,
    tests/workers/test_resumed_generation.py, forces it); the report says so per update."""
    args = ["--small", "--async", "--max-staleness", "1", "--partial-rollouts"]
    report, lines = _run_demo(args, tmp_path, "partial")
    assert [s["tokens_discarded"] for s in report["steps"]] == [0, 0]
    assert "[PASS] no trained sample was more than 1 version stale" in lines
    assert any("kept in the store and resumed" in line for line in lines), lines
    print(f"\n--partial-rollouts: tokens resumed {[s['tokens_resumed'] for s in report['steps']]}")
