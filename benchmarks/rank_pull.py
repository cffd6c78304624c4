"""Per-rank streaming pull against the driver-planned path: one logprob pass at DP=4 (TP=1)
on CPU, over long-tailed sequence lengths, two ways (issue 38, item 4).

- ``planned``: the driver claims the step's keys with ``seqlen_balanced``
  (``dp_size=4``), ``TQPolicy`` cuts them into one meta per rank
  (``shard_meta_for_dp``) and ships them; each worker fetches its slice.
- ``streamed``: the driver ships every worker the same ``StreamStep``; each rank pulls
  its own micro-batches under the token budget (``policy_workers/rank_stream.py``).

Per size: one instrumented pass per path counts the driver's bytes (the planned one
includes its ``claim_meta``); the results are compared (max |difference| of the stored
logprobs); then timed passes, interleaved, each after the task's consumption is reset
(not timed). Balance: the spread of the ranks' token sums, (max - min) / mean, and for
the streamed path the largest spread against its stated bound, ``max(token_budget,
longest sample)``.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from benchmarks.common import Options, Section, Table, Target, median, ratio
from benchmarks.driver_path import (
    DP,
    VOCAB,
    _require_demo_extra,
    count_driver_bytes,
    service_with_policy,
)

SERVICE_NAME = "bench-rank-pull"
# (samples per step, longest sample, token budget per claim)
FULL = [(256, 512, 4096), (1024, 512, 8192)]
QUICK = [(32, 64, 64)]


def long_tail(n: int, max_len: int, seed: int) -> list[int]:
    """Sequence lengths with a long tail (lognormal, median ~max_len / 6), 8..max_len."""
    rng = np.random.default_rng(seed)
    return [int(x) for x in np.clip(rng.lognormal(np.log(max_len / 6), 0.9, n), 8, max_len)]


def _put(client: Any, partition: str, lengths: list[int], seed: int) -> list[str]:
    gen = torch.Generator().manual_seed(seed)
    ids = [f"{partition}-{i}" for i in range(len(lengths))]
    client.register_partition(
        partition, fields=["input_ids"], consumer_tasks=["planned", "streamed"]
    )
    rows = [torch.randint(1, VOCAB, (n,), generator=gen) for n in lengths]
    client.put_samples(ids, partition, {"input_ids": rows})
    return ids


def _spread(tokens: list[int]) -> float:
    return (max(tokens) - min(tokens)) / (sum(tokens) / len(tokens))


def _planned(policy: Any, client: Any, partition: str, n: int) -> list[int]:
    """One planned pass; the ranks' token sums."""
    meta = client.claim_meta(
        partition,
        "planned",
        ["input_ids"],
        n,
        claim_policy="seqlen_balanced",
        policy_options={"dp_size": DP},
    )
    policy.get_logprobs_from_meta(meta, overwrite=True)
    metas = policy._shard_meta(meta, kind="logprob", batch_size=None)
    return [sum(m.sequence_lengths) for m in metas]


def _stored(client: Any, partition: str, ids: list[str]) -> list[torch.Tensor]:
    got = client.get_samples(ids, partition, ["prev_logprobs"])["prev_logprobs"]
    return list(got.unbind()) if isinstance(got, torch.Tensor) else list(got)


def measure(policy: Any, client: Any, n: int, max_len: int, budget: int, repeats: int) -> dict:
    partition = f"rank-pull-{n}"
    lengths = long_tail(n, max_len, seed=n)
    ids = _put(client, partition, lengths, seed=n)
    step = policy.stream_step(partition, "streamed", ["input_ids"], n, budget)

    def reset() -> None:
        client.reset_consumption(partition, "planned")
        client.reset_consumption(partition, "streamed")

    with count_driver_bytes() as planned_bytes:
        planned_tokens = _planned(policy, client, partition, n)
    planned_rows = _stored(client, partition, ids)
    with count_driver_bytes() as streamed_bytes:
        reports = policy.get_logprobs_streamed(step, overwrite=True)
    streamed_rows = _stored(client, partition, ids)
    max_diff = max(float((a - b).abs().max()) for a, b in zip(planned_rows, streamed_rows))

    times: dict[str, list[float]] = {"planned": [], "streamed": []}
    spreads: dict[str, list[float]] = {"planned": [], "streamed": []}
    streamed_gaps: list[int] = []
    micro_batches: list[float] = []
    for _ in range(repeats):
        for path in ("planned", "streamed"):
            reset()
            t0 = time.perf_counter()
            if path == "planned":
                tokens = _planned(policy, client, partition, n)
            else:
                reports = policy.get_logprobs_streamed(step, overwrite=True)
                tokens = [r["tokens"] for r in reports]
                streamed_gaps.append(max(tokens) - min(tokens))
                micro_batches.append(float(np.mean([r["micro_batches"] for r in reports])))
            times[path].append(time.perf_counter() - t0)
            spreads[path].append(_spread(tokens))
    client.delete_partition(partition)
    return {
        "samples": n,
        "tokens": sum(lengths),
        "max_len": max_len,
        "token_budget": budget,
        "bound": max(budget, max(lengths)),
        "seconds": times,
        "spread": spreads,
        "planned_tokens_first_pass": planned_tokens,
        "streamed_token_gap": streamed_gaps,
        "micro_batches_per_rank": micro_batches,
        "rounds_last_pass": [r["rounds"] for r in reports],
        "driver_bytes_planned": planned_bytes.to_dict(),
        "driver_bytes_streamed": streamed_bytes.to_dict(),
        "max_abs_diff_logprobs": max_diff,
    }


def run(opts: Options) -> Section:
    _require_demo_extra()
    section = Section("rankpull")
    sizes = QUICK if opts.quick else FULL
    repeats = max(1, min(opts.repeats, 3))
    results = []
    longest = max(max_len for _, max_len, _ in sizes)
    with service_with_policy(longest, service=SERVICE_NAME) as (client, policy):
        for n, max_len, budget in sizes:
            row = measure(policy, client, n, max_len, budget, repeats)
            results.append(row)
            opts.log(
                f"rankpull B={n}: planned {median(row['seconds']['planned']):.3f}s, "
                f"streamed {median(row['seconds']['streamed']):.3f}s"
            )
    _report(section, results, repeats)
    return section


def _report(section: Section, results: list[dict], repeats: int) -> None:
    rows = []
    for r in results:
        pb, sb = r["driver_bytes_planned"], r["driver_bytes_streamed"]
        t_p, t_s = median(r["seconds"]["planned"]), median(r["seconds"]["streamed"])
        rows.append(
            [
                r["samples"],
                r["tokens"],
                r["token_budget"],
                t_p,
                t_s,
                ratio(t_p, t_s),
                (pb["sent"] + pb["received"]) / 1024,
                (sb["sent"] + sb["received"]) / 1024,
                100 * max(r["spread"]["planned"]),
                100 * max(r["spread"]["streamed"]),
                max(r["streamed_token_gap"]) / r["bound"],
                median(r["micro_batches_per_rank"]),
                r["max_abs_diff_logprobs"],
            ]
        )
    section.tables.append(
        Table(
            f"logprob pass, DP={DP} TP=1 on CPU, long-tailed lengths: driver-planned "
            f"(seqlen_balanced + shard_meta_for_dp) vs per-rank streaming pull (median of "
            f"{repeats}, interleaved)",
            [
                "samples",
                "tokens",
                "token budget",
                "planned s",
                "streamed s",
                "planned / streamed",
                "planned driver KiB",
                "streamed driver KiB",
                "planned spread %",
                "streamed spread %",
                "streamed gap / bound",
                "micro-batches per rank",
                "max |diff|",
            ],
            rows,
        )
    )
    if results:
        worst = max(max(r["streamed_token_gap"]) / r["bound"] for r in results)
        section.targets.append(
            Target(
                "streamed: ranks' token sums within max(token_budget, longest sample)",
                worst,
                1.0,
                False,
                "x bound",
                detail="largest (max - min) of the ranks' token sums over the bound, every pass",
            )
        )
        worst_diff = max(r["max_abs_diff_logprobs"] for r in results)
        section.targets.append(
            Target(
                "streamed logprobs equal the planned path's (max |diff|)",
                worst_diff,
                1e-5,
                False,
                "",
            )
        )
    section.data["results"] = results
    section.notes.append(
        "spread = (max - min) / mean of the DP ranks' token sums in one pass (largest over the "
        "passes); driver bytes = pickle-5 size of ray.put values, .remote() arguments and "
        "ray.get results in the driver during one pass (planned: its claim_meta included; "
        "streamed: the StreamStep to every worker and the ranks' reports back)"
    )
