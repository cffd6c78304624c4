"""`dataplane demo`: an end-to-end GRPO data flow on an embedded local default.

Reads top to bottom, like a training recipe:

1. a local Ray on loopback, the data-plane service (its admin endpoint printed);
2. a TQPolicy: DP x TP workers running a tiny transformers model;
3. async rollout actors that stream finished GRPO groups into one partition per
   step, the next step's rollouts running while the current step trains;
4. per step, the driver claims complete groups (keys only), runs reference and
   policy logprob passes through the data plane, reads back only the rewards,
   writes group-normalised advantages, trains one step, clears the partition;
5. a table per step and pass/fail checks; exit code 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import time
from dataclasses import dataclass, field

import torch


@dataclass
class StepReport:
    step: int
    samples: int
    tokens: int
    store_bytes: int  # bytes the storage units received and served during the step
    driver_bytes: int  # bytes the driver serialized or deserialized for the step
    times: dict = field(default_factory=dict)
    loss: float = float("nan")
    grad_norm: float = float("nan")
    mean_reward: float = float("nan")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dataplane demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument(
        "--generations", type=int, default=4, help="completions per prompt (GRPO group size)"
    )
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--min-new-tokens", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--rollout-actors", type=int, default=2)
    p.add_argument("--packing", choices=["none", "dynamic", "sequence"], default="sequence")
    p.add_argument(
        "--mb-tokens", type=int, default=256, help="tokens per microbatch (dynamic/sequence)"
    )
    p.add_argument(
        "--model-path", default=None, help="local transformers checkpoint (default: tiny model)"
    )
    p.add_argument("--num-storage-units", type=int, default=2)
    p.add_argument("--small", action="store_true", help="a quick configuration (CI)")
    p.add_argument(
        "--json", dest="json_out", default=None, help="also write the report as JSON here"
    )
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.small:
        args.steps, args.prompts_per_step, args.generations = 2, 2, 2
        args.dp, args.tp, args.rollout_actors, args.max_new_tokens = 2, 1, 1, 16
    for name in ("steps", "prompts_per_step", "generations", "dp", "tp", "rollout_actors"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.min_new_tokens > args.max_new_tokens:
        p.error("--min-new-tokens must be <= --max-new-tokens")
    return args


def _nbytes(obj) -> int:
    return len(pickle.dumps(obj, protocol=5))


def _store_bytes(handle) -> int:
    import ray

    snaps = ray.get([u.metrics_snapshot.remote() for u in handle.units])
    return int(
        sum(
            s["stats"]["counters"].get("put_bytes_total", 0)
            + s["stats"]["counters"].get("get_bytes_total", 0)
            for s in snaps
        )
    )


def group_advantages(rewards: torch.Tensor, group_ids: list[str]) -> torch.Tensor:
    """GRPO: each reward minus its group's mean, over the group's std (0 when the group agrees)."""
    adv = torch.zeros_like(rewards)
    for gid in dict.fromkeys(group_ids):
        idx = torch.tensor([i for i, g in enumerate(group_ids) if g == gid])
        r = rewards[idx]
        adv[idx] = (r - r.mean()) / (r.std(unbiased=False) + 1e-6)
    return adv


class Progress:
    """tqdm bars, or nothing with --no-progress / no terminal."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def bar(self, total: int, desc: str):
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, disable=not self.enabled, leave=False, file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import ray

    from dataplane_client.config import DataPlaneConfig
    from dataplane_client.errors import ClaimTimeout
    from dataplane_client.materialize import materialize
    from dataplane_server import ensure_local_ray, start
    from policy_workers.config import (
        DynamicBatchingConfig,
        ModelConfig,
        PolicyConfig,
        SequencePackingConfig,
    )
    from policy_workers.model import build_hf_model, reference_logprobs
    from policy_workers.rollout import GRPO_FIELDS, RolloutActor, RolloutConfig
    from policy_workers.tq_policy import TQPolicy, contains_tensor

    group = args.generations
    per_step = args.prompts_per_step * group
    workers = args.dp * args.tp
    t_setup = time.perf_counter()
    ensure_local_ray(num_cpus=workers + args.rollout_actors + 4)
    progress = Progress(enabled=not args.no_progress and sys.stderr.isatty())

    dp_cfg = DataPlaneConfig(name="dataplane-demo", num_storage_units=args.num_storage_units)
    handle = start(dp_cfg)
    print(f"data plane up: admin endpoint {handle.admin_address}  metrics {handle.metrics_address}")
    print(f"  try: dataplane status --address {handle.admin_address}")
    client = handle.client()

    max_len = args.prompt_len + args.max_new_tokens
    model_cfg = ModelConfig(model_path=args.model_path, max_position_embeddings=max(512, max_len))
    mb_tokens = max(args.mb_tokens, max_len)
    policy_cfg = PolicyConfig(
        dp=args.dp,
        tp=args.tp,
        model=model_cfg,
        data_plane=dp_cfg,
        train_global_batch_size=per_step,
        train_micro_batch_size=max(1, per_step // args.dp // 2),
        dynamic_batching=DynamicBatchingConfig(
            enabled=args.packing == "dynamic",
            train_mb_tokens=mb_tokens,
            logprob_mb_tokens=mb_tokens,
        ),
        sequence_packing=SequencePackingConfig(
            enabled=args.packing == "sequence",
            train_mb_tokens=mb_tokens,
            logprob_mb_tokens=mb_tokens,
        ),
    )
    print(
        f"policy: {workers} workers (DP={args.dp} x TP={args.tp}), packing={args.packing}; "
        f"rollouts: {args.rollout_actors} async actors, {args.prompts_per_step} prompts x {group} generations "
        f"per step, {args.steps} steps"
    )
    policy = TQPolicy(policy_cfg)
    reference_model = build_hf_model(model_cfg).eval()  # the driver's own check, off the data path
    print(f"set up in {time.perf_counter() - t_setup:.1f}s (Ray, service, policy workers)")

    partitions = [f"demo-step{k}" for k in range(args.steps)]
    for pid in partitions:
        client.register_partition(
            pid,
            fields=GRPO_FIELDS,
            num_samples=per_step,
            consumer_tasks=["train"],
            group_size=group,
        )
    rollout_cfg = RolloutConfig(
        generations=group,
        prompt_len=args.prompt_len,
        min_new_tokens=args.min_new_tokens,
        max_new_tokens=args.max_new_tokens,
    )
    actors = [
        RolloutActor.remote(i, model_cfg, rollout_cfg, dp_cfg.name, dp_cfg.namespace)
        for i in range(args.rollout_actors)
    ]
    # Every actor is handed all steps up front, so it keeps streaming into the next
    # step's partition while the driver trains on the current one.
    rollout_refs = []
    for pid in partitions:
        prompts = list(range(args.prompts_per_step))
        for a, actor in enumerate(actors):
            mine = prompts[a :: len(actors)]
            if mine:
                rollout_refs.append(actor.run.remote(pid, mine))

    reports: list[StepReport] = []
    checks: dict[str, bool] = {}
    seen: set[str] = set()
    duplicates = 0
    max_ref_diff = 0.0
    tensors_received = False  # must stay False: workers return metrics, tensors stay in the store
    try:
        for k, pid in enumerate(partitions):
            store_before = _store_bytes(handle)
            driver_bytes = 0
            times = {}
            t0 = time.perf_counter()
            bar = progress.bar(per_step, f"step {k} rollouts")
            meta = None
            while meta is None:  # claim whole groups; the bar follows the partition filling up
                try:
                    meta = client.claim_meta(pid, "train", GRPO_FIELDS, per_step, timeout_s=1.0)
                except ClaimTimeout:
                    produced = client.describe_partition(pid)["num_samples"]
                    bar.update(produced - bar.n)
                    ready, _ = ray.wait(rollout_refs, num_returns=len(rollout_refs), timeout=0)
                    for r in ready:
                        ray.get(r)  # surfaces a crashed rollout actor instead of waiting forever
            bar.update(per_step - bar.n)
            bar.close()
            times["rollout_wait"] = time.perf_counter() - t0
            driver_bytes += _nbytes(meta)
            duplicates += len(seen & set(meta.sample_ids))
            seen |= set(meta.sample_ids)

            passes = progress.bar(4, f"step {k} passes")
            t = time.perf_counter()
            meta = policy.get_reference_policy_logprobs_from_meta(meta)
            times["ref_logprobs"] = time.perf_counter() - t
            passes.update()
            t = time.perf_counter()
            meta = policy.get_logprobs_from_meta(meta)
            times["logprobs"] = time.perf_counter() - t
            passes.update()

            # Only the small fields come to the driver: a reward per sample and the group tags.
            t = time.perf_counter()
            rewards = client.get_data(meta, ["rewards"])["rewards"]
            driver_bytes += rewards.numel() * rewards.element_size()
            adv = group_advantages(rewards, [tag["group_id"] for tag in meta.tags])
            per_token = [
                torch.full((n,), float(a)) for a, n in zip(adv.tolist(), meta.sequence_lengths)
            ]
            meta = policy.write_to_dataplane(meta, {"advantages": per_token})
            driver_bytes += sum(x.numel() * 4 for x in per_token)
            times["advantages"] = time.perf_counter() - t
            passes.update()

            t = time.perf_counter()
            result = policy.train_from_meta(meta, gbs=per_step)
            times["train"] = time.perf_counter() - t
            passes.update()
            passes.close()
            tensors_received |= any(
                contains_tensor(r) for results in policy.received for r in results
            )
            driver_bytes += sum(_nbytes(m) for metas in policy.shipped for m in metas)
            driver_bytes += sum(_nbytes(r) for results in policy.received for r in results)
            policy.shipped.clear()
            policy.received.clear()

            # Check: the data plane's reference logprobs equal a direct computation on one sample.
            probe = meta.subset([k % meta.size])
            got = client.get_data(probe, ["input_ids", "reference_policy_logprobs"])
            probe_batch = materialize(got)
            with torch.no_grad():
                want = reference_logprobs(
                    reference_model, probe_batch["input_ids"], torch.tensor(probe.sequence_lengths)
                )
            diff = float((want - probe_batch["reference_policy_logprobs"]).abs().max())
            max_ref_diff = max(max_ref_diff, diff)
            if k == 0:  # before the first update the policy is the reference model
                first_lp = materialize(client.get_data(probe, ["prev_logprobs"]))["prev_logprobs"]
                checks["step-0 policy logprobs equal the direct computation (<= 1e-5)"] = bool(
                    (want - first_lp).abs().max() <= 1e-5
                )

            reports.append(
                StepReport(
                    step=k,
                    samples=meta.size,
                    tokens=sum(meta.sequence_lengths),
                    store_bytes=_store_bytes(handle) - store_before,
                    driver_bytes=driver_bytes,
                    times=times,
                    loss=float(result["loss"]),
                    grad_norm=float(result["grad_norm"]),
                    mean_reward=float(rewards.mean()),
                )
            )
            client.clear_samples(None, pid)
        rollout_summaries = ray.get(rollout_refs)
    finally:
        policy.shutdown()
        for a in actors:
            ray.kill(a)

    checks["reference logprobs equal the direct computation on a sample every step (<= 1e-5)"] = (
        max_ref_diff <= 1e-5
    )
    checks["no sample duplicated across steps"] = duplicates == 0
    checks["no sample lost: every step trained on all its samples"] = len(
        seen
    ) == args.steps * per_step and all(r.samples == per_step for r in reports)
    checks[
        "the driver received no tensor from workers (metas out, metrics back)"
    ] = not tensors_received
    checks["loss and grad norm are finite"] = all(
        torch.isfinite(torch.tensor([r.loss, r.grad_norm])).all() for r in reports
    )

    print_report(reports, checks, max_ref_diff, sum(s["backoffs"] for s in rollout_summaries))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(
                {
                    "steps": [r.__dict__ for r in reports],
                    "checks": checks,
                    "max_reference_logprob_diff": max_ref_diff,
                },
                f,
                indent=2,
            )
    handle.shutdown()
    return 0 if all(checks.values()) else 1


def _mb(n: int) -> str:
    return f"{n / 1e6:.3f}"


def print_report(
    reports: list[StepReport], checks: dict[str, bool], max_ref_diff: float, backoffs: int
) -> None:
    print()
    print(
        "| step | samples | tokens | store MB | driver MB | driver/store | rollout wait s | ref lp s "
        "| lp s | adv s | train s | loss | grad norm | mean reward |"
    )
    print("|---:" * 14 + "|")
    for r in reports:
        t = r.times
        print(
            f"| {r.step} | {r.samples} | {r.tokens} | {_mb(r.store_bytes)} | {_mb(r.driver_bytes)} | "
            f"{r.driver_bytes / max(r.store_bytes, 1):.1%} | {t['rollout_wait']:.2f} | {t['ref_logprobs']:.2f} | "
            f"{t['logprobs']:.2f} | {t['advantages']:.2f} | {t['train']:.2f} | {r.loss:.4f} | "
            f"{r.grad_norm:.4f} | {r.mean_reward:.3f} |"
        )
    print()
    print(
        f"max |reference logprob - direct| = {max_ref_diff:.2e}; rollout back-offs on a full store: {backoffs}"
    )
    for name, ok in checks.items():
        print(f"[{'PASS' if ok else 'FAIL'}] {name}")


if __name__ == "__main__":
    sys.exit(main())
