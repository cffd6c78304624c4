"""The driver section's second regime: compute as fast as a GPU's, so data movement decides.

On the tiny CPU model compute is 97% of a logprob pass and the two paths tie. On a
GPU cluster the forward is fast and moving the batch is what the step waits for
(a NeMo-RL user reports 135 s of a 946 s step in Ray transfer). This regime runs
the same pass as ``driver_path`` (same ``TQPolicy`` methods, same
``PolicyWorker`` code: shard over DP ranks; classic ships tensors through the
driver and gathers ``[B, S]`` logprobs, dataplane ships metas, workers fetch
their slice and write ``prev_logprobs`` back) with the model's forward replaced
by a stand-in: logprobs computed from ``input_ids`` by one elementwise op, plus
a fixed cost per token (``BENCH_DRIVER_NS_PER_TOKEN``, default 0). The stand-in
waits rather than spins: a GPU kernel leaves the host's CPU free.

Sizes are GRPO steps: 512 prompts x 16 generations = 8,192 samples of up to
4,096 tokens (lengths uniform in max/2..max), with the fields NeMo-RL's classic
driver holds for the pass (``input_ids``, ``token_mask``, ``generation_logprobs``,
``advantages``, ``input_lengths``, ``sample_mask``), at DP=2 and DP=4.
Data movement = wall time - the slowest rank's compute.
"""

from __future__ import annotations

import os
import time
from typing import Any

import ray
import torch

from benchmarks.common import MiB, Options, Section, Table, Target, median, ratio, start_service
from benchmarks.driver_path import (
    NAMESPACE,
    compare_paths,
    make_policy,
    make_rollouts,
    padded,
    summary_line,
    write_rollouts,
)

SERVICE_NAME = "bench-driver-fast"
DP_SIZES = (2, 4)
# (samples, max tokens): 128 prompts x 16 at 2k; 512 x 16 at 2k and at 4k
FULL_LEVELS = [(2048, 2048), (8192, 2048), (8192, 4096)]
QUICK_LEVELS = [(16, 64), (32, 64)]
NS_PER_TOKEN_ENV = "BENCH_DRIVER_NS_PER_TOKEN"
MOVEMENT_SPEEDUP_TARGET = 5.0
FLAT_DRIVER_RSS_MIB = 16.0  # keys only: a few hundred KiB at 8,192 samples


def ns_per_token() -> float:
    """The stand-in's compute cost per token, from the environment (default 0)."""
    text = os.environ.get(NS_PER_TOKEN_ENV, "0")
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{NS_PER_TOKEN_ENV}={text!r} is not a number of nanoseconds") from None
    if not value >= 0:  # also refuses nan
        raise ValueError(f"{NS_PER_TOKEN_ENV}={text!r}: the cost per token must be >= 0")
    return value


def standin_worker_cls(cost_ns_per_token: float) -> type:
    """PolicyWorker with no model: ``get_logprobs`` is the stand-in (classic and dataplane
    paths both call it on this rank's padded slice)."""
    from dataplane_client.batching.batched_data_dict import BatchedDataDict
    from policy_workers.worker import PolicyWorker

    class StandInComputeWorker(PolicyWorker):
        def setup(self) -> None:
            self.device = torch.device("cpu")  # nothing to build: no model

        def get_logprobs(
            self, data: BatchedDataDict, micro_batch_size: int | None = None
        ) -> BatchedDataDict:
            return BatchedDataDict({"logprobs": standin_logprobs(data, cost_ns_per_token)})

    return StandInComputeWorker


def standin_logprobs(data: Any, cost_ns_per_token: float) -> torch.Tensor:
    """``[B, S]`` float32 that depends on every input token, 0 past each row's length,
    after waiting ``cost_ns_per_token`` per real token."""
    ids, lengths = data["input_ids"], data["input_lengths"]
    if cost_ns_per_token > 0:
        time.sleep(int(lengths.sum()) * cost_ns_per_token * 1e-9)
    valid = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
    return torch.where(valid, ids.to(torch.float32) * -1e-3, 0.0)


def padded_batch_bytes(data: Any) -> int:
    """The classic driver's batch: every field, padded to ``[B, S]``."""
    return sum(v.numel() * v.element_size() for v in data.values())


def classic_bytes_moved(data: Any) -> int:
    """What the classic pass carries: the padded batch out, ``[B, S]`` float32 logprobs back."""
    return padded_batch_bytes(data) + data["input_ids"].numel() * 4


def dataplane_bytes_moved(tokens: int) -> int:
    """What the data-plane pass carries: ``input_ids`` (int64) in, ``prev_logprobs`` (float32)
    out, jagged: real tokens only."""
    return tokens * (8 + 4)


def data_movement_s(row: dict[str, Any], path: str) -> float:
    """Median over the timed passes of wall time minus the slowest rank's compute."""
    walls, phases = row["seconds"][path], row["worker_phases_s"][path]
    return median([w - p.get("compute", 0.0) for w, p in zip(walls, phases)])


def run(
    opts: Options,
    section: Section,
    *,
    dp_sizes: tuple[int, ...] = DP_SIZES,
    levels: list[tuple[int, int]] | None = None,
) -> None:
    """Measure every (DP, level) and add this regime's tables, targets and data to ``section``.

    ``levels``: (samples, max tokens) pairs; default by ``opts.quick``.
    """
    cost = ns_per_token()
    levels = levels or (QUICK_LEVELS if opts.quick else FULL_LEVELS)
    repeats = max(1, min(opts.repeats, 3))
    tasks = tuple(f"logprob-dp{dp}" for dp in dp_sizes)
    handle = start_service(SERVICE_NAME, NAMESPACE)
    policies: dict[int, Any] = {}
    results = []
    try:
        longest = max(length for _, length in levels)
        for dp in dp_sizes:
            policies[dp] = make_policy(
                longest, service=SERVICE_NAME, dp=dp, worker_cls=standin_worker_cls(cost)
            )
        client = handle.client()
        for batch, max_len in levels:
            partition = f"fast-{batch}x{max_len}"
            seed = batch + max_len
            tokens = ray.get(
                write_rollouts.remote(
                    SERVICE_NAME,
                    NAMESPACE,
                    partition,
                    batch,
                    max_len,
                    seed,
                    min_len=max_len // 2,
                    consumer_tasks=tasks,
                )
            )
            data = padded(make_rollouts(batch, max_len, seed, min_len=max_len // 2))
            lengths = data["input_lengths"].tolist()
            for dp, task in zip(dp_sizes, tasks):
                row = {
                    "dp": dp,
                    "batch": batch,
                    "max_len": max_len,
                    "tokens": tokens,
                    "tensor_bytes_classic_batch": padded_batch_bytes(data),
                    "tensor_bytes_moved_classic": classic_bytes_moved(data),
                    "tensor_bytes_moved_dataplane": dataplane_bytes_moved(tokens),
                    **compare_paths(
                        policies[dp], client, partition, task, data, repeats, lengths=lengths
                    ),
                }
                results.append(row)
                opts.log(f"driver fast compute DP={dp} B={batch}x{max_len}: {summary_line(row)}")
            del data
            client.clear_samples(None, partition)
    finally:
        for policy in policies.values():
            policy.shutdown()
        handle.shutdown()
    _report(section, results, repeats, cost, dp_sizes)


def _driver_total(row: dict[str, Any], path: str) -> int:
    d = row[f"driver_bytes_{path}"]
    return d["sent"] + d["received"]


def _report(
    section: Section, results: list[dict], repeats: int, cost: float, dp_sizes: tuple[int, ...]
) -> None:
    rows = []
    for r in results:
        t_cl, t_dp = median(r["seconds"]["classic"]), median(r["seconds"]["dataplane"])
        m_cl, m_dp = data_movement_s(r, "classic"), data_movement_s(r, "dataplane")
        rows.append(
            [
                r["dp"],
                r["batch"],
                r["max_len"],
                r["tokens"],
                r["tensor_bytes_moved_classic"] / MiB,
                r["tensor_bytes_moved_dataplane"] / MiB,
                _driver_total(r, "classic") / MiB,
                _driver_total(r, "dataplane") / 1024,
                median(r["peak_rss_delta_bytes"]["classic"]) / MiB,
                median(r["peak_rss_delta_bytes"]["dataplane"]) / MiB,
                t_cl,
                t_dp,
                ratio(t_cl, t_dp),
                m_cl,
                m_dp,
                ratio(m_cl, m_dp),
                r["max_abs_diff_logprobs"],
            ]
        )
    section.tables.append(
        Table(
            f"logprob pass, compute replaced by a GPU-speed stand-in ({cost:g} ns/token), "
            f"TP=1 (median of {repeats}; classic and dataplane interleaved)",
            [
                "DP",
                "batch",
                "max len",
                "tokens",
                "classic tensor MiB moved",
                "dataplane tensor MiB moved",
                "classic driver MiB",
                "dataplane driver KiB",
                "classic peak RSS +MiB",
                "dataplane peak RSS +MiB",
                "classic s",
                "dataplane s",
                "speed-up",
                "classic data movement s",
                "dataplane data movement s",
                "data-movement speed-up",
                "max |diff|",
            ],
            rows,
        )
    )
    largest = max((r["batch"] * r["max_len"] for r in results), default=0)
    for r in (r for r in results if r["batch"] * r["max_len"] == largest):
        m_cl, m_dp = data_movement_s(r, "classic"), data_movement_s(r, "dataplane")
        size = f"DP={r['dp']}, {r['batch']:,} x {r['max_len']:,} tokens"
        section.targets.append(
            Target(
                f"stand-in compute: data movement >= {MOVEMENT_SPEEDUP_TARGET:g}x faster "
                f"than classic ({size})",
                ratio(m_cl, m_dp),
                MOVEMENT_SPEEDUP_TARGET,
                True,
                "x",
                detail=f"classic {m_cl:.3f}s vs dataplane {m_dp:.3f}s",
            )
        )
        rss_cl = median(r["peak_rss_delta_bytes"]["classic"]) / MiB
        rss_dp = median(r["peak_rss_delta_bytes"]["dataplane"]) / MiB
        section.targets.append(
            Target(
                f"stand-in compute: dataplane driver peak RSS growth flat ({size})",
                rss_dp,
                FLAT_DRIVER_RSS_MIB,
                False,
                "MiB",
                detail=f"classic +{rss_cl:.1f} MiB; padded batch "
                f"{r['tensor_bytes_classic_batch'] / MiB:,.0f} MiB",
            )
        )
    prof = []
    for r in results:
        for path in ("classic", "dataplane"):
            ph = r["worker_phases_s"][path]
            med = {
                k: median([p.get(k, 0.0) for p in ph]) for k in ("fetch", "compute", "write_back")
            }
            wall = median(r["seconds"][path])
            prof.append(
                [
                    r["dp"],
                    f"{r['batch']}x{r['max_len']}",
                    path,
                    wall,
                    med["fetch"],
                    med["compute"],
                    med["write_back"],
                    wall - sum(med.values()),
                ]
            )
    section.profile_tables.append(
        Table(
            "stand-in compute: one logprob pass, seconds (worker phases: slowest rank; "
            "rest = driver sharding, dispatch, Ray transfer, gather)",
            ["DP", "level", "path", "wall", "worker fetch", "worker compute", "write-back", "rest"],
            prof,
        )
    )
    section.notes.append(
        f"stand-in compute: {cost:g} ns per token ({NS_PER_TOKEN_ENV}); tensor MiB moved = "
        "classic: the padded batch out and [B, S] float32 logprobs back; dataplane: jagged "
        "input_ids in and prev_logprobs out; data movement = wall - slowest rank's compute"
    )
    section.data["fast_compute"] = {
        "ns_per_token": cost,
        "dp_sizes": list(dp_sizes),
        "repeats": repeats,
        "results": results,
    }
