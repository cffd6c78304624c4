"""Chaos: the async demo killed with SIGKILL again and again, resumed each time; every
prompt is trained exactly once.

``dataplane demo --async --checkpoint-dir DIR`` runs in its own process (its own
local Ray, service, policy workers and rollout actor). At a random point after
its set-up (a random number of step rows, 0 or 1, then a random delay) the whole
process tree is killed with SIGKILL: the demo, every process it started and every
process of its session (Ray's GCS, raylet, workers and actors), all stopped first
so that none escapes. The next attempt is ``--resume DIR``. After ``kills`` kills
the last attempt runs to the end. Beside it, one uninterrupted run with the same
flags (the same seed) is the reference.

What is checked, from the trained log the demo writes into each checkpoint
(``trained_prompts``: step -> the prompts it trained, saved with the policy):
the last checkpoint's log covers every step; lost: prompts the uninterrupted run
trained that the chaos run did not; duplicated: trainings of a prompt beyond its
first; skipped: prompts of the dataset (``steps x prompts_per_step``) never
trained. All three must be 0 and the trained set the reference's.

    python -m benchmarks.run --only chaos
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks.common import Options, Section, Table, Target

KILLS = 5
STEPS = 10
WORKLOAD = [  # the smallest run with a staleness window: a tiny model, one worker, one actor
    "--async",
    "--max-staleness",
    "1",
    "--prompts-per-step",
    "2",
    "--generations",
    "2",
    "--dp",
    "1",
    "--tp",
    "1",
    "--rollout-actors",
    "1",
    "--prompt-len",
    "4",
    "--min-new-tokens",
    "4",
    "--max-new-tokens",
    "8",
]
MAX_KILL_DELAY_S = 1.5  # after the trigger row: inside a step, its save or the next wait
ATTEMPT_TIMEOUT_S = 600.0
SET_UP = "set up in "  # the demo's line once Ray, the service and the policy are up


@dataclass
class Attempt:
    resumed_from: str | None  # the step-<n> checkpoint it resumed from; None: a fresh run
    seconds: float  # from its start to its end (or kill)
    set_up_s: float | None  # from its start to its set-up line
    steps_trained: int  # step rows it printed
    killed: bool
    processes_killed: int = 0


@dataclass
class ChaosResult:
    dataset: int  # prompts 0 .. dataset - 1
    reference: dict[int, list[int]]  # the uninterrupted run's log: step -> prompts
    trained: dict[int, list[int]]  # the chaos run's last checkpoint's log
    attempts: list[Attempt] = field(default_factory=list)
    reference_s: float = 0.0

    @property
    def kills(self) -> int:
        return sum(a.killed for a in self.attempts)

    def counts(self) -> dict[str, int]:
        trainings = [p for prompts in self.trained.values() for p in prompts]
        reference = {p for prompts in self.reference.values() for p in prompts}
        return {
            "lost": len(reference - set(trainings)),
            "duplicated": len(trainings) - len(set(trainings)),
            "skipped": len(set(range(self.dataset)) - set(trainings)),
            "extra": len(set(trainings) - set(range(self.dataset))),
        }


def chaos_run(
    workdir: str,
    kills: int = KILLS,
    steps: int = STEPS,
    seed: int = 0,
    extra: tuple[str, ...] = (),
) -> ChaosResult:
    """The reference run, then the chaos run in ``workdir`` (module docstring); ``extra``:
    more demo flags for both (``--partial-rollouts``)."""
    flags = [*WORKLOAD, *extra, "--steps", str(steps)]
    rng = random.Random(seed)
    reference_dir = os.path.join(workdir, "reference")
    t0 = time.perf_counter()
    _attempt(flags, reference_dir, kill_at=None, rng=rng, workdir=workdir)
    reference_s = time.perf_counter() - t0
    chaos_dir = os.path.join(workdir, "chaos")
    attempts = []
    # A kill lands at the latest as the last step's row appears, so killed attempts do not
    # finish the run; one killed right after the last save did (then there is no more to do).
    while _next_step(chaos_dir) < steps:
        trigger = None if len(attempts) >= kills else rng.randint(0, 1)
        attempts.append(_attempt(flags, chaos_dir, trigger, rng, workdir))
        if not attempts[-1].killed:
            break
    return ChaosResult(
        dataset=steps * int(flags[flags.index("--prompts-per-step") + 1]),
        reference=trained_log(reference_dir),
        trained=trained_log(chaos_dir),
        attempts=attempts,
        reference_s=reference_s,
    )


def trained_log(checkpoint_dir: str) -> dict[int, list[int]]:
    """The trained log of ``checkpoint_dir``'s latest run checkpoint."""
    from policy_workers.async_resume import TRAINED
    from policy_workers.demo_checkpoint import find_run, read_run

    saved = read_run(find_run(checkpoint_dir))[TRAINED]
    return {int(k): prompts for k, prompts in saved.items()}


def _next_step(checkpoint_dir: str) -> int:
    """The step a run resumed from ``checkpoint_dir`` would train first (0: none saved)."""
    from policy_workers.demo_checkpoint import find_run, read_run
    from policy_workers.errors import CheckpointNotFound

    try:
        return int(read_run(find_run(checkpoint_dir))["next_step"])
    except CheckpointNotFound:
        return 0


def _attempt(
    flags: list[str], checkpoint_dir: str, kill_at: int | None, rng: random.Random, workdir: str
) -> Attempt:
    """One demo process: resumed from ``checkpoint_dir`` when it holds a run checkpoint;
    killed (its whole tree) ``kill_at`` step rows after its set-up plus a random delay,
    or as its last step's row appears if sooner; or (``None``) left to finish, which it
    must do with exit code 0."""
    first = _next_step(checkpoint_dir)
    last_row = int(flags[flags.index("--steps") + 1]) - first
    resumed_from = f"step-{first}" if first else None
    cmd = [sys.executable, "-m", "policy_workers.demo", "--no-progress", *flags]
    cmd += ["--checkpoint-dir", checkpoint_dir]
    if resumed_from:
        cmd += ["--resume", checkpoint_dir]
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)  # the demo starts its own local Ray
    log_fd, log_path = tempfile.mkstemp(prefix="chaos-attempt-", suffix=".log", dir=workdir)
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=log_fd, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    os.close(log_fd)
    delay = rng.uniform(0.0, MAX_KILL_DELAY_S)
    killed, killed_n, set_up_at, kill_time = False, 0, None, None
    deadline = t0 + ATTEMPT_TIMEOUT_S
    while proc.poll() is None:
        if time.perf_counter() > deadline:
            kill_tree(proc)
            raise RuntimeError(
                f"demo attempt ran past {ATTEMPT_TIMEOUT_S:.0f} s: {_tail(log_path)}"
            )
        text = _read(log_path)
        if set_up_at is None and SET_UP in text:
            set_up_at = time.perf_counter() - t0
        armed = kill_at is not None and set_up_at is not None and kill_time is None
        if armed and len(step_rows(text)) >= kill_at:
            kill_time = time.perf_counter() + delay
        due = kill_time is not None and time.perf_counter() >= kill_time
        if due or (kill_at is not None and len(step_rows(text)) >= last_row):
            killed_n, killed = kill_tree(proc), True
            break
        time.sleep(0.02)  # pacing the poll of the log and the process
    seconds = time.perf_counter() - t0
    text = _read(log_path)
    if not killed and proc.returncode != 0:
        raise RuntimeError(f"demo attempt exited {proc.returncode}: {_tail(log_path)}")
    return Attempt(resumed_from, seconds, set_up_at, len(step_rows(text)), killed, killed_n)


def step_rows(text: str) -> list[str]:
    """The demo's per-step table rows (a step number, then its samples)."""
    rows = []
    for line in text.splitlines():
        cells = line.split()
        if len(cells) >= 9 and cells[0].isdigit() and cells[1].isdigit():
            rows.append(line)
    return rows


def kill_tree(proc: subprocess.Popen) -> int:
    """SIGKILL ``proc``, every process descended from it and every process of its session
    (Ray's included): all are stopped first, so none starts another or escapes, then
    killed; returns how many once every one is gone."""
    import psutil

    def tree() -> set[psutil.Process]:
        found: set[psutil.Process] = set()
        try:
            root = psutil.Process(proc.pid)
            found = {root, *root.children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
        for p in psutil.process_iter():
            try:
                if os.getsid(p.pid) == proc.pid:
                    found.add(p)
            except (ProcessLookupError, PermissionError):
                continue
        return found

    victims: set[psutil.Process] = set()
    while new := tree() - victims:  # until a pass finds none not yet stopped
        for p in new:
            _signal(p, signal.SIGSTOP)
        victims |= new
    for p in victims:
        _signal(p, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    while alive := [p for p in victims if _running(p)]:  # a zombie is dead, not yet reaped
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes survived SIGKILL: {[p.pid for p in alive]}")
        time.sleep(0.02)  # pacing the poll of the process table
    return len(victims)


def _running(p: Any) -> bool:
    import psutil

    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _signal(p: Any, sig: int) -> None:
    import psutil

    try:
        p.send_signal(sig)
    except psutil.NoSuchProcess:
        pass


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def _tail(path: str) -> str:
    return _read(path)[-3000:]


# ---- the benchmark section -------------------------------------------------------------


def run(opts: Options, extra: tuple[str, ...] = ()) -> Section:
    """The harness's entry: one chaos run (``--quick``: fewer steps), its tables."""
    with tempfile.TemporaryDirectory(prefix="bench-chaos-") as tmp:
        opts.log(f"chaos: dataplane demo {' '.join((*WORKLOAD, *extra))}, {KILLS} kills")
        t0 = time.perf_counter()
        result = chaos_run(tmp, steps=8 if opts.quick else STEPS, extra=extra)
        return report(result, time.perf_counter() - t0)


def report(result: ChaosResult, wall_s: float, kills: int = KILLS) -> Section:
    """The tables and targets of a chaos run that asked for ``kills`` kills."""
    section = Section("chaos")
    counts = result.counts()
    same_steps = result.trained == result.reference
    trained_set = {p for prompts in result.trained.values() for p in prompts}
    reference_set = {p for prompts in result.reference.values() for p in prompts}
    chaos_s = sum(a.seconds for a in result.attempts)
    set_ups = [a.set_up_s for a in result.attempts if a.set_up_s is not None]
    section.tables.append(
        Table(
            f"dataplane demo {' '.join(WORKLOAD)}: SIGKILL of the whole process tree at random "
            "points, resumed from its checkpoint directory each time",
            [
                "kills",
                "prompts",
                "trained",
                "lost",
                "duplicated",
                "skipped",
                "same set as uninterrupted",
                "same steps as uninterrupted",
                "chaos s",
                "uninterrupted s",
                "mean set-up s",
            ],
            [
                [
                    result.kills,
                    result.dataset,
                    len(trained_set),
                    counts["lost"],
                    counts["duplicated"],
                    counts["skipped"],
                    "yes" if trained_set == reference_set else "NO",
                    "yes" if same_steps else "no",
                    chaos_s,
                    result.reference_s,
                    sum(set_ups) / max(len(set_ups), 1),
                ]
            ],
        )
    )
    section.tables.append(
        Table(
            "the attempts",
            ["#", "resumed from", "killed", "step rows", "processes killed", "s", "set-up s"],
            [
                [
                    i,
                    a.resumed_from or "-",
                    "yes" if a.killed else "no (finished)",
                    a.steps_trained,
                    a.processes_killed,
                    a.seconds,
                    "-" if a.set_up_s is None else a.set_up_s,
                ]
                for i, a in enumerate(result.attempts)
            ],
        )
    )
    for name in ("lost", "duplicated", "skipped"):
        section.targets.append(Target(f"prompts {name} across the kills", counts[name], 0, False))
    section.targets.append(Target("SIGKILLs of the whole process tree", result.kills, kills, True))
    section.targets.append(
        Target(
            "trained set equals the uninterrupted run's",
            float(trained_set == reference_set),
            1,
            True,
        )
    )
    section.data = {
        "dataset": result.dataset,
        "counts": counts,
        "kills": result.kills,
        "trained": result.trained,
        "reference": result.reference,
        "attempts": [a.__dict__ for a in result.attempts],
        "wall_s": wall_s,
    }
    section.notes.append(
        "same steps: each step trained the same prompts as in the uninterrupted run (not "
        "promised with --max-staleness >= 1: which admitted groups a step claims depends "
        "on timing; the set over the run is)."
    )
    return section


if __name__ == "__main__":
    import argparse

    from benchmarks.run import render

    parser = argparse.ArgumentParser(description="the chaos run alone: tables on stdout")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--partial-rollouts", action="store_true", help="the demo keeps partial rollouts"
    )
    args = parser.parse_args()
    extra = ("--partial-rollouts",) if args.partial_rollouts else ()
    print(render(run(Options(quick=args.quick), extra)))
