"""The regime where async pays: GPU-calibrated STAND-INS, so the data plane's overhead shows.

On this machine's two cores the demo's rollout actor and trainer take turns on the
same CPUs, which caps what overlapping them can give (the asyncrl section's real CPU
rows). On GPUs, generation and training run on devices the data plane does not use.
Here they are stand-ins that sleep (``standin_rl.py``: no CPU used, clearly not a
model) for the wall time of a published GPU run, and everything else is the real data
plane: admission, puts, releases, blocking claims, version bumps.

**The calibration** (published): verl's one-step-off-policy recipe README
(github.com/volcengine/verl, ``recipe/one_step_off_policy/README.md``, "Experimental
Results", last updated 07/17/2025): DAPO on Qwen2.5-Math-7B, 2 nodes x 16 H20 GPUs,
the "colocate sync, VLLM+FSDP2" row, per step: ``gen`` 321 s, ``old_log_prob`` 88 s,
``update_actor`` 286 s. Generation is the stand-in's 321 ms per batch, training
``old_log_prob + update_actor`` = 374 ms per step (1 ms per published second; the
step's other ~54 s, reward and advantages, are left out). Generation is 46% of
generation plus training.

**Ideal overlap**: synchronous, a step is generation then training, 695 ms; async at
N=1, the next batch generates while this one trains, so a step is the longer of the
two, 374 ms: 1.86x. The published async row itself gained less (+23%), since it split
the GPUs between the two (generation took 458 s on 4 of the 16); the stand-in assumes
separate devices for each at the sync run's speeds, which is what isolates the data
plane's own cost.

Targets (issue 38 item 6), judged on async N=1 with paced admission: >= 0.9 of ideal
overlap, and >= 1.5x sync. Unpaced async N=1 is shown beside it: its declared bound,
``(N + 1) x batch`` started and not trained, lets producers start two batches while the
trainer trains one, and the second is a version too old by the time the trainer reaches
it: half the generation is dropped stale (the ``stale dropped`` column). Paced, admission
counts the batch the trainer already took at this version (``StalenessSpec(pace=True)``).
"""

from __future__ import annotations

from typing import Any

from benchmarks.common import BENCH_NAMESPACE, Options, Target, start_service
from benchmarks.standin_rl import Outcome, Workload, run_async, run_sync

SCALE_S = 1e-3  # stand-in seconds per published second
GEN_S = 321 * SCALE_S  # verl one-step-off README, colocate sync VLLM+FSDP2: gen
TRAIN_S = (88 + 286) * SCALE_S  # old_log_prob + update_actor
BATCH = 8
JUDGED = "stand-in async N=1 paced"  # the configuration the targets judge (docstring)
TARGET_OF_IDEAL = 0.9
TARGET_X_SYNC = 1.5
SOURCE = (
    "verl recipe/one_step_off_policy/README.md, colocate sync VLLM+FSDP2: gen 321 s, "
    "old_log_prob 88 s + update_actor 286 s per step (Qwen2.5-Math-7B DAPO, 16 H20)"
)


def workload() -> Workload:
    """Every sample generates for one batch's generation time (a batch generates at once)."""
    return Workload(batch=BATCH, slots=BATCH, train_s=TRAIN_S, s_per_token=GEN_S, lengths=(1,))


def ideal_samples_per_s() -> dict[str, float]:
    return {"sync": BATCH / (GEN_S + TRAIN_S), "async": BATCH / max(GEN_S, TRAIN_S)}


def measure(opts: Options) -> dict[str, dict[str, Any]]:
    """Sync, async N=1 and async N=1 paced on the stand-in workload, one service."""
    steps = 4 if opts.quick else 20
    handle = start_service("bench-async-regime", BENCH_NAMESPACE)
    client = handle.client()
    w = workload()
    try:
        runs = {
            "stand-in sync": run_sync(client, w, steps),
            "stand-in async N=1": run_async(client, w, steps, 1, pace=False),
            "stand-in async N=1 paced": run_async(client, w, steps, 1, pace=True),
        }
    finally:
        client.close()
        handle.shutdown()
    ideal = ideal_samples_per_s()
    return {
        name: _figures(out, ideal["sync" if name.endswith("sync") else "async"])
        for name, out in runs.items()
    }


def _figures(out: Outcome, ideal: float) -> dict[str, Any]:
    steady = sorted(out.step_s[1:] or out.step_s)
    return {
        "samples_per_s": out.samples_per_s,
        "ideal_samples_per_s": ideal,
        "of_ideal": out.samples_per_s / ideal,
        "median_step_s": steady[len(steady) // 2],
        "stale_dropped": out.stale_dropped,
    }


def targets(figures: dict[str, dict[str, Any]]) -> list[Target]:
    sync = figures["stand-in sync"]["samples_per_s"]
    n1 = figures[JUDGED]
    return [
        Target(
            f"stand-in async N=1 paced >= {TARGET_OF_IDEAL:g} of ideal overlap",
            n1["of_ideal"],
            TARGET_OF_IDEAL,
            True,
            detail=f"{n1['samples_per_s']:.1f} vs ideal {n1['ideal_samples_per_s']:.1f} samples/s",
        ),
        Target(
            f"stand-in async N=1 paced >= {TARGET_X_SYNC:g}x stand-in sync",
            n1["samples_per_s"] / sync,
            TARGET_X_SYNC,
            True,
            "x",
            detail=f"{n1['samples_per_s']:.1f} vs {sync:.1f} samples/s",
        ),
    ]
