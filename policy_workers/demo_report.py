"""What the demo prints: the per-step table (80 columns), the checks and a summary.

Kept apart from ``demo.py`` so the recipe reads top to bottom without
formatting code, and so the layout is tested without running the demo.
"""

from __future__ import annotations

from dataclasses import dataclass, field

WIDTH = 80  # a default terminal: nothing printed here is wider

# Every column of the two tables: TABLE HEADER WIDTH FORMAT ("_" in a header is a space).
# "step" is the per-step table; "loop" the training loop's, whose "async" columns (how
# off-policy each batch was) print only for --async: a synchronous run is on-policy.
_SPEC = """
step  step           4  d
step  samples        7  d
step  tokens         6  d
step  classic_KB    10  .1f
step  driver_KB      9  .1f
step  wait_s         6  .2f
step  pass_s         6  .2f
step  loss           8  .4f
step  kl             7  .1e
step  reward         6  .3f
loop  step           4  d
loop  refit_s        7  .3f
loop  step_s         6  .2f
loop  samples/s      9  .1f
async lag_max        7  d
async lag_mean       8  .2f
async stale_dropped 13  d
async admit_waits   11  d
"""


def _columns(table: str) -> tuple[tuple[str, int, str], ...]:
    """(header, width, format of the value) of one table's columns, separated by one space."""
    rows = (line.split() for line in _SPEC.strip().splitlines())
    return tuple(
        (name.replace("_", " "), int(width), "{:" + fmt + "}")
        for t, name, width, fmt in rows
        if t == table
    )


_COLUMNS = _columns("step")
_LOOP_COLUMNS = _columns("loop")
_ASYNC_COLUMNS = _columns("async")

LEGEND = (
    "classic KB: tensors the classic driver would have gathered and scattered this",
    "  step, measured on this step's tensors (rollout fields, each DP rank's batch,",
    "  the logprobs written back). driver KB: all this driver (de)serialized:",
    "  metas, a reward and an advantage per sample, train metrics. Those are per",
    "  sample and classic KB grows with tokens, so a run as small as --small can",
    "  show driver KB above classic KB; the summary counts the tensors alone.",
    "wait s: waiting for rollouts; pass s: logprob passes, advantages, train step.",
    "loss: the train step's (clipped policy gradient + KL penalty); kl: its mean",
    "  per-token KL(policy || reference); reward: the step's mean reward, the share",
    "  of generated tokens with the parity of the prompt's last token (random: 0.5).",
)

LOOP_LEGEND = ("refit s: the new weights into every rollout actor; step s: wait + pass + refit.",)

ASYNC_LEGEND = (
    "lag: policy versions between a trained sample's generation and its training",
    "  step (0 = on-policy). stale dropped: samples the store dropped as too stale;",
    "  admit waits: rollout starts that waited for the store's admission.",
)


def versions(n: int) -> str:
    """'1 version', '2 versions'."""
    return f"{n} version" if n == 1 else f"{n} versions"


@dataclass
class StepReport:
    step: int
    samples: int
    tokens: int
    classic_bytes: int  # what the classic driver path would have moved (measured)
    driver_bytes: int  # what this driver serialized or deserialized, all of it
    driver_tensor_bytes: int  # of which tensors: a reward and an advantage per sample
    store_bytes: int  # what the storage units received and served
    times: dict[str, float] = field(default_factory=dict)
    loss: float = float("nan")
    grad_norm: float = float("nan")
    kl: float = float("nan")  # mean per-token KL(policy || reference) of the train step
    mean_reward: float = float("nan")
    lag_max: int = 0  # policy versions behind, over the batch's samples
    lag_mean: float = 0.0
    lag_counts: list[int] = field(default_factory=list)  # samples per lag (0, 1, ...)
    stale_dropped: int = 0  # samples the store dropped as too stale during this step
    admission_waits: int = 0  # rollout starts that waited for admission during this step
    # generated tokens a weight update interrupted during this step (--async): thrown away
    # and generated again, or kept in the store and resumed (--partial-rollouts)
    tokens_discarded: int = 0
    tokens_resumed: int = 0

    @property
    def step_s(self) -> float:
        return sum(self.times.values())


def _passes_s(times: dict[str, float]) -> float:
    """The logprob passes, advantages and train step: everything but waiting and refitting."""
    return sum(v for k, v in times.items() if k not in ("rollout_wait", "refit"))


def _row(values: list[str], columns=_COLUMNS) -> str:
    return " ".join(v.rjust(w) for v, (_, w, _) in zip(values, columns))


def _formatted(values, columns) -> str:
    return _row([fmt.format(v) for v, (_, _, fmt) in zip(values, columns)], columns)


def header_line() -> str:
    return _row([name for name, _, _ in _COLUMNS])


def row_line(r: StepReport) -> str:
    """One step's row, printed as soon as the step finishes."""
    values = (
        r.step,
        r.samples,
        r.tokens,
        r.classic_bytes / 1e3,
        r.driver_bytes / 1e3,
        r.times["rollout_wait"],
        _passes_s(r.times),
        r.loss,
        r.kl,
        r.mean_reward,
    )
    return _row([fmt.format(v) for v, (_, _, fmt) in zip(values, _COLUMNS)])


def table_lines(reports: list[StepReport]) -> list[str]:
    return [header_line(), *map(row_line, reports)]


def loop_table_lines(reports: list[StepReport], async_columns: bool = False) -> list[str]:
    """The training loop's table; the lag, stale and admission columns only for --async."""
    columns = _LOOP_COLUMNS + (_ASYNC_COLUMNS if async_columns else ())
    lines = [_row([name for name, _, _ in columns], columns)]
    for r in reports:
        values = (
            r.step,
            r.times.get("refit", 0.0),
            r.step_s,
            r.samples / r.step_s if r.step_s > 0 else float("nan"),
            r.lag_max,
            r.lag_mean,
            r.stale_dropped,
            r.admission_waits,
        )
        lines.append(_formatted(values[: len(columns)], columns))
    return lines


def interruption_lines(reports: list[StepReport]) -> list[str]:
    """--async: the generated tokens weight updates interrupted, per update (one per step);
    --partial-rollouts aims at none discarded."""
    updates = max(len(reports), 1)
    discarded = sum(r.tokens_discarded for r in reports)
    resumed = sum(r.tokens_resumed for r in reports)
    return [
        "generated tokens a weight update interrupted (--partial-rollouts keeps them):",
        f"  discarded: {discarded / updates:.1f} per update ({discarded} in all)",
        f"  kept in the store and resumed: {resumed / updates:.1f} per update ({resumed} in all)",
    ]


def summary_lines(
    reports: list[StepReport], max_logprob_diff: float, tolerance: float, samples_lost: int
) -> list[str]:
    """The closing lines a newcomer reads: what the driver did not carry, and that it is right."""
    classic = sum(r.classic_bytes for r in reports)
    tensors = sum(r.driver_tensor_bytes for r in reports)
    other = sum(r.driver_bytes - r.driver_tensor_bytes for r in reports)
    match = "match" if max_logprob_diff <= tolerance else "DO NOT match"
    return [
        f"Summary: the classic driver path would have moved {classic / 1e3:.1f} KB of tensors;",
        f"  this driver moved {tensors / 1e3:.1f} KB of them (a reward and an advantage per "
        "sample):",
        f"  {(classic - tensors) / 1e3:.1f} KB went rollout -> store -> worker without it.",
        f"  Keys and metrics it (de)serialized: {other / 1e3:.1f} KB (per sample, not per token).",
        f"  Logprobs from the store {match} a direct computation "
        f"(max diff {max_logprob_diff:.1e}).",
        f"  Samples lost: {samples_lost}.",
    ]


def report_lines(
    reports: list[StepReport],
    checks: dict[str, bool],
    async_columns: bool = False,
    *,
    max_logprob_diff: float,
    tolerance: float,
    samples_lost: int,
    backoffs: int,
    with_table: bool = True,
) -> list[str]:
    """Everything after the run; ``with_table=False`` when the rows went out live;
    ``async_columns`` for an --async run (how off-policy each batch was)."""
    lines = ["", *table_lines(reports)] if with_table else []
    lines += ["", *LEGEND, ""]
    lines += [*loop_table_lines(reports, async_columns), "", *LOOP_LEGEND]
    lines += [*(ASYNC_LEGEND if async_columns else ()), ""]
    lines.append(f"rollout back-offs on a full store: {backoffs}")
    lines += interruption_lines(reports) if async_columns else []
    lines += [f"[{'PASS' if ok else 'FAIL'}] {name}" for name, ok in checks.items()]
    lines += ["", *summary_lines(reports, max_logprob_diff, tolerance, samples_lost)]
    return lines
