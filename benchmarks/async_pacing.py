"""Pace instead of discard: stale drops, and the bias they cause, with and without pacing.

A long-tail completion-length workload on the stand-in RL loop (``standin_rl.py``:
generation and training sleep, the data plane is real): lengths log-normal (median
``MEDIAN`` tokens, sigma ``SIGMA``, capped at ``CAP``), each sample generating for
``length x S_PER_TOKEN`` s, ``2 x BATCH`` producers, a trainer training ``BATCH``
samples per version in ``TRAIN_S`` s. The longest samples take several train steps.

Async at max staleness N, admission declared (``admission_batch=BATCH``), without and
with ``pace=True``. Without pacing the producers fill ``(N + 1) x BATCH`` with short
samples while a long one is still generating, the trainer moves on and the long one
lands stale: dropped. The trained completion lengths then differ from the generated
ones (tinker-cookbook #822: slow, hard problems are never trained), measured by the
two-sample Kolmogorov-Smirnov statistic between the two distributions (every generated
sample ends trained or dropped). With pacing, admission's room shrinks as the oldest
outstanding sample nears the end of its window, so the trainer waits for it instead.

Targets (issue 38 item 3), at N=1 with pacing: stale drops <= 1% of generated samples,
KS(trained, generated) <= 0.05. Trained samples/s is shown beside them: pacing trades
some of async's overlap for training every sample.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from benchmarks.common import BENCH_NAMESPACE, Options, Section, Table, Target, start_service
from benchmarks.standin_rl import (
    Outcome,
    Workload,
    ks_statistic,
    long_tail_lengths,
    run_async,
    run_sync,
)

BATCH = 16
TRAIN_S = 0.2
MEDIAN, SIGMA, CAP = 512, 1.2, 8192  # tokens; CAP x S_PER_TOKEN = 4 train steps
S_PER_TOKEN = 4 * TRAIN_S / CAP
TARGET_KS = 0.05
TARGET_DROPPED = 0.01  # of the generated samples
CONFIGS = (  # name, max staleness, pace
    ("N=1 unpaced", 1, False),
    ("N=1 paced", 1, True),
    ("N=2 unpaced", 2, False),
    ("N=2 paced", 2, True),
)


def workload() -> Workload:
    return Workload(
        batch=BATCH,
        slots=2 * BATCH,
        train_s=TRAIN_S,
        s_per_token=S_PER_TOKEN,
        lengths=long_tail_lengths(4096, MEDIAN, SIGMA, CAP),
    )


def run(opts: Options) -> Section:
    steps = 6 if opts.quick else 40
    configs = CONFIGS[:2] if opts.quick else CONFIGS
    handle = start_service("bench-pacing", BENCH_NAMESPACE)
    client = handle.client()
    w = workload()
    figures: dict[str, dict[str, Any]] = {}
    try:
        opts.log(f"pacing: sync, {steps} steps")
        figures["sync"] = _figures(run_sync(client, w, steps))
        for name, n, pace in configs:
            opts.log(f"pacing: {name}, {steps} steps")
            figures[name] = _figures(run_async(client, w, steps, n, pace))
    finally:
        client.close()
        handle.shutdown()
    return report(figures, steps, opts)


def _figures(out: Outcome) -> dict[str, Any]:
    return {
        "samples_per_s": out.samples_per_s,
        "generated": len(out.generated),
        "trained": len(out.trained),
        "stale_dropped": out.stale_dropped,
        "dropped_fraction": out.stale_dropped / max(1, len(out.generated)),
        "ks": ks_statistic(out.trained, out.generated),
        "mean_generated": float(np.mean(out.generated)),
        "mean_trained": float(np.mean(out.trained)),
        "p99_generated": float(np.percentile(out.generated, 99)),
        "p99_trained": float(np.percentile(out.trained, 99)),
        "admission_waits": out.admission_waits,
    }


def report(figures: dict[str, dict[str, Any]], steps: int, opts: Options) -> Section:
    section = Section("pacing")
    rows = [
        [
            name,
            f"{f['samples_per_s']:.1f}",
            f"{f['stale_dropped']} / {f['generated']}",
            f"{f['ks']:.3f}",
            f"{f['mean_generated']:.0f} / {f['mean_trained']:.0f}",
            f"{f['p99_generated']:.0f} / {f['p99_trained']:.0f}",
            f["admission_waits"],
        ]
        for name, f in figures.items()
    ]
    section.tables.append(
        Table(
            f"stand-in async RL (generation and training sleep), long-tail lengths "
            f"(log-normal, median {MEDIAN}, sigma {SIGMA}, cap {CAP} tokens = "
            f"{CAP * S_PER_TOKEN / TRAIN_S:.0f} train steps), batch {BATCH}, "
            f"{2 * BATCH} producers, {steps} steps",
            [
                "configuration",
                "trained samples/s",
                "stale dropped / generated",
                "KS(trained, generated)",
                "mean length generated / trained",
                "p99 length generated / trained",
                "admission waits",
            ],
            rows,
        )
    )
    paced = figures["N=1 paced"]
    section.targets += [
        Target(
            "N=1 paced: stale drops <= 1% of generated",
            paced["dropped_fraction"],
            TARGET_DROPPED,
            higher_is_better=False,
            detail=f"{paced['stale_dropped']} of {paced['generated']}",
        ),
        Target(
            f"N=1 paced: KS(trained, generated lengths) <= {TARGET_KS}",
            paced["ks"],
            TARGET_KS,
            higher_is_better=False,
        ),
    ]
    if opts.quick:
        section.notes.append(f"--quick: {steps} steps each; a smoke run, not a measurement")
    section.data = {"configurations": figures, "steps": steps, "batch": BATCH}
    return section
