"""`dataplane demo`: train a tiny model with GRPO end to end through the data plane, on a local Ray.

Reads top to bottom, like a training recipe:

1. a local Ray on loopback, the data-plane service (its admin endpoint printed);
2. a TQPolicy: DP x TP workers running a tiny transformers model;
3. rollout actors that stream finished GRPO groups into one partition per step,
   each group tagged with the policy version of the weights that generated it;
4. per step, the driver claims complete groups (keys only), runs reference and
   policy logprob passes through the data plane, reads back only the rewards,
   writes one group-normalised advantage per sample, trains one step (clipped
   policy gradient plus the reference-policy KL penalty), deletes the partition,
   and refits the rollout actors with the new weights (``policy_workers.refit``):
   every step trains on samples of the policy it updates (on-policy);
5. a table per step (80 columns) beside what the classic driver path would
   have moved, pass/fail checks and a summary; exit code 1 if any check fails.
   ``--keep-serving`` then keeps the service up for ``dataplane status``.

``--checkpoint-dir DIR`` saves the store and the policy together after every
``--checkpoint-every`` steps (``policy_workers.demo_checkpoint``);
``--resume DIR`` restores both into a fresh service and policy and continues
from the next step, bit for bit as if the run had not stopped: rollouts are a
function of (partition, prompt), so the groups the store checkpoint lacks are
regenerated identically, and each step trains on its samples sorted by id.
With ``--async`` the same flags train every prompt of the run exactly once
across any number of kills and resumes (``policy_workers.async_resume``).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import pickle
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from policy_workers.demo_report import (
    WIDTH,
    StepReport,
    header_line,
    report_lines,
    row_line,
    versions,
)

if TYPE_CHECKING:
    import torch

# Torch, transformers and Ray are imported inside the functions that use them, after the
# arguments are parsed: `dataplane demo --help` imports none of them.

TOLERANCE = 1e-5  # logprobs through the data plane vs a direct computation (float32)
# Rollout actors generate this many tokens between looks for new weights (--async with
# --max-staleness >= 1: a weight update interrupts a group there; RolloutConfig.chunk_tokens).
CHUNK_TOKENS = 4
# --learn: its steps, and the mean reward its last LEARNED_OVER steps must reach. A random
# policy gets 0.5; measured runs reach ~0.85-0.9 (README), so 0.7 leaves a wide margin.
LEARN_STEPS, LEARNED_OVER, LEARNED_REWARD = 30, 10, 0.7


@dataclass
class Run:
    """What every training step uses: the run's flags, the service, the policy and the
    driver's own checks (a reference model and the DP leaders whose batches it measures)."""

    args: argparse.Namespace
    handle: Any  # dataplane_server.ServiceHandle
    client: Any  # its DataPlaneClient
    policy: Any  # TQPolicy
    recorder: Any  # DispatchRecorder: what the driver shipped to and received from workers
    leaders: list[int]
    reference_model: Any
    progress: Progress

    @property
    def per_step(self) -> int:
        return self.args.prompts_per_step * self.args.generations


@dataclass
class Tally:
    """What the steps add up: their reports, the checks and what those checks count."""

    reports: list[StepReport] = field(default_factory=list)
    checks: dict[str, bool] = field(default_factory=dict)
    seen: set[str] = field(default_factory=set)  # every sample id trained on so far
    duplicates: int = 0
    max_ref_diff: float = 0.0
    # Must stay False: workers return metrics, tensors stay in the store.
    tensors_received: bool = False
    checkpoints: list[str] = field(default_factory=list)


# The demo extra's modules (pyproject.toml: [project.optional-dependencies] demo).
DEMO_EXTRA_MODULES = ("transformers", "tqdm")


def missing_demo_extra() -> str | None:
    """One line naming the install command when the demo extra is missing, else None."""
    import importlib.util

    def absent(module: str) -> bool:
        try:
            return importlib.util.find_spec(module) is None
        except ImportError:  # an import hook that refuses it
            return True

    missing = [m for m in DEMO_EXTRA_MODULES if absent(m)]
    if not missing:
        return None
    return (
        f"dataplane: error: the demo needs {', '.join(missing)}, from the demo extra: "
        "pip install 'rl-dataplane[demo]'"
    )


def main(argv: list[str] | None = None) -> int:
    # Checked before anything starts: without it Ray and the service came up, then a
    # 40-line ModuleNotFoundError traceback never named the extra.
    missing = missing_demo_extra()
    if missing:
        print(missing, file=sys.stderr)
        return 2
    set_environment_before_ray()
    args = parse_args(argv)
    import ray

    from dataplane_server.launch.local_ray import init_local_ray

    t_setup = time.perf_counter()
    own_ray = not ray.is_initialized()
    init_local_ray(args.dp * args.tp + args.rollout_actors + 4, namespace="dataplane-demo")
    dp_cfg, handle = start_service(args)
    client = handle.client()
    first_step, restored_samples = restore_store(client, args.resume_manifest)
    model_cfg, policy, recorder = build_policy(args, dp_cfg)
    if args.resume_manifest:
        load_policy(policy, args, first_step, restored_samples)
    leaders = measure_classic_path(policy)
    reference_model = build_reference_model(model_cfg)
    progress = Progress(enabled=not args.no_progress and sys.stderr.isatty())
    run = Run(args, handle, client, policy, recorder, leaders, reference_model, progress)
    print(f"set up in {time.perf_counter() - t_setup:.1f}s (Ray, service, policy workers)")

    steps = range(first_step, args.steps)
    actors = start_rollout_actors(run, model_cfg, dp_cfg)
    tally = Tally()
    try:
        print(f"\n{header_line()}", flush=True)  # rows follow as each step finishes
        if args.async_mode:
            from policy_workers.demo_async import train_async

            train_async(run, tally, actors, steps, train_one_step, checkpoint_if_due)
        else:
            train_synchronously(run, tally, actors, steps)
        backoffs = sum(s["backoffs"] for s in ray.get([a.stats.remote() for a in actors]))
    finally:
        policy.shutdown()
        for a in actors:
            ray.kill(a)

    samples_lost = len(steps) * run.per_step - len(tally.seen)
    add_run_checks(tally, samples_lost, run.per_step, args.max_staleness)
    if args.learn:
        name, ok = learned_check(tally.reports)
        tally.checks[name] = ok
    print_report(tally, samples_lost, backoffs=backoffs, async_columns=args.async_mode)
    if args.json_out:
        write_json_report(args.json_out, tally, samples_lost, first_step, restored_samples)
    if args.keep_serving:
        keep_serving(handle)
    handle.shutdown()
    if own_ray:
        ray.shutdown()
    return 0 if all(tally.checks.values()) else 1


# ---- set-up --------------------------------------------------------------------------


def set_environment_before_ray() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Ray 2.60 turns token auth on for a new local cluster and logs a WARNING saying so.
    # Asking for that same mode keeps auth on and the demo's output clean. Ray reads the
    # mode when it is imported, so this must come before `import ray` (and before
    # parse_args: --resume reads the checkpoint with modules that import it).
    os.environ.setdefault("RAY_AUTH_MODE", "token")


DESCRIPTION = (
    "Train a tiny transformers policy with GRPO end to end through the data plane: it "
    "starts a local Ray on loopback, the data-plane service, DP x TP policy workers and "
    "rollout actors, prints a table per step beside what the classic driver path would have "
    "moved, then pass/fail checks and a summary, and exits with 1 if a check fails."
)


class _HelpWithDefaults(argparse.HelpFormatter):
    """Each option's help ends with its default, unless it has none (None, an off switch)
    or its help already says what it is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dataplane demo", description=DESCRIPTION, formatter_class=_HelpWithDefaults
    )
    p.add_argument("--steps", type=int, default=3, help="training steps")
    p.add_argument(
        "--prompts-per-step",
        type=int,
        default=4,
        help="prompts per step; each is completed --generations times",
    )
    p.add_argument(
        "--generations", type=int, default=4, help="completions per prompt (GRPO group size)"
    )
    p.add_argument("--prompt-len", type=int, default=8, help="tokens per prompt")
    p.add_argument(
        "--min-new-tokens", type=int, default=8, help="fewest tokens a completion generates"
    )
    p.add_argument(
        "--max-new-tokens", type=int, default=32, help="most tokens a completion generates"
    )
    p.add_argument("--dp", type=int, default=2, help="data-parallel policy replicas")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks per replica")
    p.add_argument(
        "--rollout-actors", type=int, default=2, help="actors generating the completions"
    )
    p.add_argument(
        "--packing",
        choices=["none", "dynamic", "sequence"],
        default="sequence",
        help="a rank's microbatches: padded to a fixed size (none), sized by --mb-tokens "
        "(dynamic), or sequences packed into rows of --mb-tokens (sequence)",
    )
    p.add_argument(
        "--mb-tokens", type=int, default=256, help="tokens per microbatch (dynamic/sequence)"
    )
    p.add_argument(
        "--kl-penalty",
        type=float,
        default=0.01,
        help="reference-policy KL coefficient of the loss (0 = off)",
    )
    p.add_argument("--lr", type=float, default=1e-3, help="the policy's learning rate (AdamW)")
    p.add_argument(
        "--minibatches",
        type=int,
        default=1,
        help="optimizer steps per training step (the step's batch split evenly)",
    )
    p.add_argument("--vocab-size", type=int, default=128, help="of the tiny model")
    p.add_argument(
        "--async",
        dest="async_mode",
        action="store_true",
        help="rollout actors generate continuously, admitted by the store; the trainer "
        "claims samples at most --max-staleness policy versions old",
    )
    p.add_argument(
        "--max-staleness",
        type=int,
        default=0,
        metavar="N",
        help="with --async: the most policy versions a trained sample may lag (0 = on-policy)",
    )
    p.add_argument(
        "--partial-rollouts",
        action="store_true",
        help="with --async: a weight update interrupts the groups being generated (at the "
        "next chunk of tokens); keep their tokens in the store and resume them with the new "
        "weights (append_tokens) instead of generating them again",
    )
    p.add_argument(
        "--model-path", default=None, help="local transformers checkpoint (default: tiny model)"
    )
    p.add_argument(
        "--num-storage-units", type=int, default=0, help="0 = one per alive node (the default)"
    )
    p.add_argument("--small", action="store_true", help="a quick configuration (CI)")
    p.add_argument(
        "--learn",
        action="store_true",
        help=f"a configuration that learns the parity task in {LEARN_STEPS} steps (a few "
        f"minutes on 2 cores) and checks that the reward rose to >= {LEARNED_REWARD}",
    )
    p.add_argument(
        "--keep-serving",
        action="store_true",
        help="after training, keep the service up (inspect it with `dataplane status`) "
        "until Ctrl-C or SIGTERM",
    )
    p.add_argument(
        "--json", dest="json_out", default=None, help="also write the report as JSON here"
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bars (they are drawn only when stderr is a terminal)",
    )
    p.add_argument(
        "--checkpoint-dir",
        default=None,
        metavar="DIR",
        help="save the store and the policy to DIR/step-<n> after every "
        "--checkpoint-every steps and after the last",
    )
    p.add_argument(
        "--checkpoint-every", type=int, default=1, metavar="N", help="steps between checkpoints"
    )
    p.add_argument(
        "--resume",
        default=None,
        metavar="DIR",
        help="continue a saved run: DIR is a DIR/step-<n> or a --checkpoint-dir (its "
        "latest); the run's flags come from the checkpoint",
    )
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.small and args.learn:
        p.error("--small and --learn are two configurations: choose one")
    if args.small:
        args.steps, args.prompts_per_step, args.generations = 2, 2, 2
        args.dp, args.tp, args.rollout_actors, args.max_new_tokens = 2, 1, 1, 16
    if args.learn:
        # Measured (README): the mean reward goes from ~0.5 to ~0.9 by step 12. A small
        # vocabulary and short completions make each token's parity a clear signal;
        # four optimizer steps per batch, PPO-clipped, learn from it quickly.
        args.steps, args.prompts_per_step, args.generations = LEARN_STEPS, 16, 8
        args.dp, args.tp, args.rollout_actors = 1, 1, 2
        args.min_new_tokens, args.max_new_tokens, args.vocab_size = 4, 4, 16
        args.minibatches, args.lr = 4, 1e-2
    args.resume_manifest = None
    if args.resume:
        _take_saved_flags(p, args)
    names = (
        "steps",
        "prompts_per_step",
        "generations",
        "dp",
        "tp",
        "rollout_actors",
        "minibatches",
    )
    for name in names:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.min_new_tokens > args.max_new_tokens:
        p.error("--min-new-tokens must be <= --max-new-tokens")
    if not args.kl_penalty >= 0:
        p.error("--kl-penalty must be >= 0")
    if not args.lr > 0:
        p.error("--lr must be > 0")
    per_step = args.prompts_per_step * args.generations
    if per_step % args.minibatches or per_step // args.minibatches < args.dp:
        p.error(
            f"--minibatches {args.minibatches}: a step's {per_step} samples must split into "
            f"equal minibatches of at least --dp {args.dp}"
        )
    if args.vocab_size < 5:
        p.error("--vocab-size must be >= 5 (prompts draw tokens 3.., both parities)")
    if args.max_staleness < 0:
        p.error("--max-staleness must be >= 0")
    if args.max_staleness and not args.async_mode:
        p.error("--max-staleness needs --async (the synchronous demo is on-policy: 0)")
    if args.partial_rollouts and not args.async_mode:
        p.error("--partial-rollouts needs --async (no weight update interrupts a sync rollout)")
    if args.checkpoint_every < 1:
        p.error("--checkpoint-every must be >= 1")
    return args


def _take_saved_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--resume: the run's flags are the checkpoint's; one given here that differs is an error
    (--steps may grow: the run goes on longer)."""
    from policy_workers.demo_checkpoint import RUN_FLAGS, find_run, read_run
    from policy_workers.errors import PolicyCheckpointError

    try:
        manifest = read_run(find_run(args.resume))
    except PolicyCheckpointError as e:
        p.error(f"--resume: {e}")
    saved = manifest["flags"]
    for name in RUN_FLAGS:
        # a flag newer than the checkpoint: it was run with the flag's default
        mine, theirs = getattr(args, name), saved.get(name, p.get_default(name))
        if mine == p.get_default(name) or mine == theirs:
            setattr(args, name, theirs)
        elif name != "steps":
            flag = "--async" if name == "async_mode" else f"--{name.replace('_', '-')}"
            p.error(f"--resume: {flag} {mine} here, the checkpoint was run with {theirs}")
    if manifest["next_step"] >= args.steps:
        p.error(f"--resume: the checkpoint already trained all {args.steps} steps")
    args.resume_manifest = manifest


def start_service(args: argparse.Namespace):
    """The data-plane service on the local Ray; prints its admin and metrics addresses."""
    from dataplane_client.wire.config import DataPlaneConfig
    from dataplane_server import start

    dp_cfg = DataPlaneConfig(name="dataplane-demo", num_storage_units=args.num_storage_units)
    handle = start(dp_cfg)
    print(f"data plane up: admin endpoint {handle.admin_address}  metrics {handle.metrics_address}")
    print(f"  try: dataplane status --address {handle.admin_address}")
    return dp_cfg, handle


def restore_store(client, resume: dict | None) -> tuple[int, int]:
    """--resume: the saved store into the fresh service. Returns (first step, samples restored)."""
    from policy_workers.demo_checkpoint import STORE

    if not resume:
        return 0, 0
    return resume["next_step"], client.restore(resume["parts"][STORE]["path"])


def build_policy(args: argparse.Namespace, dp_cfg):
    """The DP x TP policy workers; prints the policy's and the rollouts' shape.

    Returns (model config, policy, the recorder of what the driver ships and receives).
    """
    from policy_workers import config as cfg
    from policy_workers.recording import DispatchRecorder
    from policy_workers.tq_policy import TQPolicy

    per_step = args.prompts_per_step * args.generations
    max_len = args.prompt_len + args.max_new_tokens
    model_cfg = cfg.ModelConfig(
        model_path=args.model_path,
        vocab_size=args.vocab_size,
        max_position_embeddings=max(512, max_len),
    )
    mb_tokens = max(args.mb_tokens, max_len)
    policy_cfg = cfg.PolicyConfig(
        dp=args.dp,
        tp=args.tp,
        model=model_cfg,
        optimizer=cfg.OptimizerConfig(lr=args.lr),
        # The decoupled PPO objective: samples of an older policy (--async) are weighted
        # by pi_prox / pi_behav; on-policy that weight is 1 up to the engines' numerics.
        loss=cfg.LossConfig(
            reference_policy_kl_penalty=args.kl_penalty, use_importance_sampling_correction=True
        ),
        data_plane=dp_cfg,
        train_global_batch_size=per_step // args.minibatches,
        train_micro_batch_size=max(1, per_step // args.minibatches // args.dp // 2),
        dynamic_batching=cfg.DynamicBatchingConfig(
            enabled=args.packing == "dynamic",
            train_mb_tokens=mb_tokens,
            logprob_mb_tokens=mb_tokens,
        ),
        sequence_packing=cfg.SequencePackingConfig(
            enabled=args.packing == "sequence",
            train_mb_tokens=mb_tokens,
            logprob_mb_tokens=mb_tokens,
        ),
    )
    print(
        f"policy: {args.dp * args.tp} workers (DP={args.dp} x TP={args.tp}), "
        f"packing={args.packing}, KL penalty {args.kl_penalty:g}"
    )
    print(
        f"rollouts: {args.rollout_actors} actors, {args.prompts_per_step} prompts x "
        f"{args.generations} generations per step, {args.steps} steps"
    )
    if args.async_mode:
        print(f"  async: generating continuously, at most {versions(args.max_staleness)} stale")
    else:
        print("  synchronous: each step's rollouts after the previous step's refit")
    # The demo inspects what the driver shipped and received (at most one step's worth).
    recorder = DispatchRecorder(keep_last=8)
    return model_cfg, TQPolicy(policy_cfg, recorder=recorder), recorder


def load_policy(policy, args: argparse.Namespace, first_step: int, restored_samples: int) -> None:
    """--resume: the saved weights and optimizer state into the fresh policy."""
    from policy_workers.demo_checkpoint import OPTIMIZER, WEIGHTS

    parts = args.resume_manifest["parts"]
    policy.load_checkpoint(parts[WEIGHTS]["path"], parts[OPTIMIZER]["path"])
    print(f"resumed at step {first_step}: policy loaded, {restored_samples} rollout samples")
    print(fit(f"  restored from {args.resume}"))


def measure_classic_path(policy) -> list[int]:
    """Turns on the workers' batch recording for the classic-path column; returns the DP
    leaders (the ranks whose batches the classic driver would have shipped)."""
    from policy_workers.sharding import REPLICA_AXES

    # Workers measure their batches for the classic-path column (no digests: not needed).
    policy.run_on_all_workers("set_io_recording", True, keep_last=64, digests=False)
    sharding = policy.sharding
    return [
        r
        for r in range(sharding.size)
        if sharding.is_axis_zero(sharding.get_worker_coords(r), REPLICA_AXES)
    ]


def build_reference_model(model_cfg):
    """The driver's own copy of the initial model: its check, off the data path."""
    from policy_workers.model import build_hf_model

    return build_hf_model(model_cfg).eval()


def register_partitions(run: Run, steps: range) -> list[str]:
    """One partition per step (restored ones are kept); returns their ids."""
    from policy_workers.rollout import GRPO_FIELDS

    partitions = [f"demo-step{k}" for k in steps]
    for pid in partitions:
        if not partition_exists(run.client, pid):  # restored ones are kept
            run.client.register_partition(
                pid,
                fields=GRPO_FIELDS,
                num_samples=run.per_step,
                consumer_tasks=["train"],
                grpo_group_size=run.args.generations,
            )
    return partitions


def start_rollout_actors(run: Run, model_cfg, dp_cfg) -> list:
    """The rollout actors, each with the policy's initial weights (policy version 0)."""
    from policy_workers.rollout import RolloutActor, RolloutConfig

    args = run.args
    rollout_cfg = RolloutConfig(
        generations=args.generations,
        prompt_len=args.prompt_len,
        min_new_tokens=args.min_new_tokens,
        max_new_tokens=args.max_new_tokens,
        # In chunks only where a weight update can land mid-generation (--async with
        # --max-staleness >= 1): the sync demo and --async --max-staleness 0 (which
        # refits between batches) generate whole groups, the same bytes as each other,
        # and the --learn configuration learns as measured (README).
        chunk_tokens=CHUNK_TOKENS if args.async_mode and args.max_staleness > 0 else 0,
        partial_rollouts=args.partial_rollouts,
    )
    return [
        # @ray.remote made RolloutActor an ActorClass; mypy ignores class decorators
        RolloutActor.remote(  # type: ignore[attr-defined]
            i, model_cfg, rollout_cfg, dp_cfg.name, dp_cfg.namespace
        )
        for i in range(args.rollout_actors)
    ]


def generate_step_rollouts(run: Run, actors: list, k: int, pid: str) -> list:
    """Step ``k``'s groups into partition ``pid``, with the actors' current weights; returns
    the actors' runs. Prompt p goes to actor p mod n; it is the run's prompt number
    k * prompts_per_step + p. Groups a restored store already holds are not generated again."""
    args = run.args
    prompts = list(range(args.prompts_per_step))
    if args.resume_manifest:
        prompts = missing_prompts(run.client, pid, prompts, args.generations)
    first_index = k * args.prompts_per_step
    rollout_refs = []
    for a, actor in enumerate(actors):
        mine = [q for q in prompts if q % len(actors) == a]
        if mine:
            rollout_refs.append(actor.run.remote(pid, mine, first_index))
    return rollout_refs


# ---- the synchronous loop -------------------------------------------------------------


def train_synchronously(run: Run, tally: Tally, actors: list, steps: range) -> None:
    """Per step: its rollouts with the current weights, one training step on them, the
    new weights into the rollout actors (every sample trained is on-policy)."""
    from policy_workers.refit import refit_actors

    partitions = register_partitions(run, steps)
    if steps.start:  # resumed: the actors generate with the restored weights
        refit_actors(run.policy, actors, version=steps.start)
    for k, pid in zip(steps, partitions):
        rollouts = generate_step_rollouts(run, actors, k, pid)
        train_one_step(
            run,
            tally,
            k,
            claim=functools.partial(claim_step_batch, run, k, pid, rollouts),
            finish=functools.partial(delete_partition, run.client),
        )
        # the next step's rollouts come from the weights this step trained
        tally.reports[-1].times["refit"] = refit_actors(run.policy, actors, version=k + 1)
        checkpoint_if_due(run, tally, k)


# ---- one training step ---------------------------------------------------------------


def train_one_step(
    run: Run,
    tally: Tally,
    k: int,
    claim: Callable[[dict[str, float]], Any],
    finish: Callable[[Any], Any],
) -> None:
    """Step ``k`` (policy version k): ``claim`` the batch (timing its wait), logprob
    passes, advantages, train, check, report, ``finish`` with the batch's samples."""
    store_before = _store_bytes(run.handle)
    times: dict[str, float] = {}
    meta = claim(times)
    driver_bytes = _nbytes(meta)  # keys, lengths and tags (plus metrics, below)
    # The classic driver would have gathered the rollouts' fields: as stored, measured
    # (the partition's bytes per sample before the passes add theirs, times the batch's
    # samples: exactly the partition's bytes when it holds only the batch).
    described = run.client.describe_partition(meta.partition_id)
    classic_bytes = sum(described.bytes_per_unit) * meta.size // max(described.num_samples, 1)
    tally.duplicates += len(tally.seen & set(meta.sample_ids))
    tally.seen |= set(meta.sample_ids)

    meta, rewards, result, driver_tensor_bytes = run_passes(run, k, meta, times)
    driver_bytes += bytes_through_the_driver(run, tally)
    classic_bytes += classic_bytes_of_passes(run.policy, run.leaders)
    check_reference_logprobs(run, tally, k, meta)

    metrics = result["all_mb_metrics"]
    tally.reports.append(
        StepReport(
            step=k,
            samples=meta.size,
            tokens=sum(meta.sequence_lengths),
            classic_bytes=classic_bytes,
            driver_bytes=driver_bytes + driver_tensor_bytes,
            driver_tensor_bytes=driver_tensor_bytes,
            store_bytes=_store_bytes(run.handle) - store_before,
            times=times,
            loss=float(result["loss"]),
            grad_norm=float(result["grad_norm"]),
            kl=sum(metrics["kl_sum"]) / max(sum(metrics["num_valid_tokens"]), 1.0),
            mean_reward=float(rewards.mean()),
            **version_lag(meta, version=k),
        )
    )
    print(row_line(tally.reports[-1]), flush=True)  # each row as its step finishes
    finish(meta)


def claim_step_batch(run: Run, k: int, pid: str, rollouts: list, times: dict):
    """Waits for the step's rollouts, then claims all of them (keys only), in prompt order.
    Returns the batch's meta."""
    import ray

    from policy_workers.rollout import GRPO_FIELDS, in_prompt_order

    t0 = time.perf_counter()
    bar = run.progress.bar(run.per_step, f"step {k} rollouts")
    pending = wait_for_rollouts(run.client, pid, run.per_step, rollouts, bar)
    bar.close()
    ray.get(pending)  # every group is in the store: the runs are returning
    meta = run.client.claim_meta(pid, "train", GRPO_FIELDS, run.per_step, timeout_s=60.0)
    times["rollout_wait"] = time.perf_counter() - t0
    return in_prompt_order(meta)


def run_passes(run: Run, k: int, meta, times: dict):
    """Reference and policy logprobs, advantages, one training step: all through the data
    plane. Returns (meta, rewards, train result, tensor bytes the driver carried)."""
    passes = run.progress.bar(4, f"step {k} passes")
    t = time.perf_counter()
    meta = run.policy.get_reference_policy_logprobs_from_meta(meta)
    times["ref_logprobs"] = time.perf_counter() - t
    passes.update()
    t = time.perf_counter()
    meta = run.policy.get_logprobs_from_meta(meta)
    times["logprobs"] = time.perf_counter() - t
    passes.update()

    # Only the small fields come to the driver: a reward per sample and the group
    # tags in; one advantage per sample out (workers broadcast it over tokens).
    t = time.perf_counter()
    rewards = run.client.get_data(meta, ["rewards"])["rewards"]
    adv = group_advantages(rewards, [tag["group_id"] for tag in meta.tags])
    meta = run.policy.write_to_dataplane(meta, {"advantages": adv})
    driver_tensor_bytes = rewards.numel() * rewards.element_size()
    driver_tensor_bytes += adv.numel() * adv.element_size()
    times["advantages"] = time.perf_counter() - t
    passes.update()

    t = time.perf_counter()
    result = run.policy.train_from_meta(meta, gbs=run.per_step // run.args.minibatches)
    times["train"] = time.perf_counter() - t
    passes.update()
    passes.close()
    return meta, rewards, result, driver_tensor_bytes


def bytes_through_the_driver(run: Run, tally: Tally) -> int:
    """Bytes of the metas the driver shipped to workers and the results it got back this
    step (then forgotten); notes whether any result held a tensor."""
    from policy_workers.tq_policy import contains_tensor

    recorder = run.recorder
    tally.tensors_received |= any(
        contains_tensor(r) for results in recorder.received for r in results
    )
    shipped = sum(_nbytes(m) for metas in recorder.shipped for m in metas)
    received = sum(_nbytes(r) for results in recorder.received for r in results)
    recorder.clear()
    return shipped + received


def check_reference_logprobs(run: Run, tally: Tally, k: int, meta) -> None:
    """The data plane's reference logprobs equal a direct computation on one sample (not
    part of the data path, so not counted); at step 0 the policy's logprobs do too."""
    import torch

    from dataplane_client.batching.materialize import materialize
    from policy_workers.model import reference_logprobs

    probe = meta.subset([k % meta.size])
    got = run.client.get_data(probe, ["input_ids", "reference_policy_logprobs"])
    probe_batch = materialize(got)
    with torch.no_grad():
        want = reference_logprobs(
            run.reference_model, probe_batch["input_ids"], torch.tensor(probe.sequence_lengths)
        )
    diff = float((want - probe_batch["reference_policy_logprobs"]).abs().max())
    tally.max_ref_diff = max(tally.max_ref_diff, diff)
    if k == 0:  # before the first update the policy is the reference model
        first_lp = materialize(run.client.get_data(probe, ["prev_logprobs"]))["prev_logprobs"]
        tally.checks["step-0 policy logprobs equal a direct computation"] = bool(
            (want - first_lp).abs().max() <= TOLERANCE
        )


def checkpoint_if_due(run: Run, tally: Tally, k: int, **save: Any) -> bool:
    """--checkpoint-dir: the store and the policy after every --checkpoint-every steps and
    after the last (``save``: ``save_run``'s ``after_policy`` and ``extra``). Returns
    whether it saved one."""
    from policy_workers.demo_checkpoint import RUN_FLAGS, save_run

    args, done = run.args, k + 1
    if not args.checkpoint_dir or (done % args.checkpoint_every and done != args.steps):
        return False
    run_flags = {name: getattr(args, name) for name in RUN_FLAGS}
    tally.checkpoints.append(
        save_run(args.checkpoint_dir, done, run_flags, run.client, run.policy, **save)
    )
    print(fit(f"checkpoint after step {k}: {tally.checkpoints[-1]}"), flush=True)
    return True


# ---- the summary ---------------------------------------------------------------------


def add_run_checks(tally: Tally, samples_lost: int, per_step: int, max_staleness: int) -> None:
    """The pass/fail checks over the whole run (after the step-0 one)."""
    checks, reports = tally.checks, tally.reports
    checks[f"no trained sample was more than {versions(max_staleness)} stale"] = all(
        r.lag_max <= max_staleness for r in reports
    )
    checks["reference logprobs equal a direct computation, every step"] = (
        tally.max_ref_diff <= TOLERANCE
    )
    checks["no sample duplicated across steps"] = tally.duplicates == 0
    checks["no sample lost: every step trained on all its samples"] = samples_lost == 0 and all(
        r.samples == per_step for r in reports
    )
    checks["the driver received no tensor from the workers"] = not tally.tensors_received
    checks["loss, grad norm and KL are finite"] = all(
        math.isfinite(x) for r in reports for x in (r.loss, r.grad_norm, r.kl)
    )


def learned_check(reports: list[StepReport]) -> tuple[str, bool]:
    """--learn's check, naming the mean it measured: (its line, whether it passed)."""
    last = [r.mean_reward for r in reports[-LEARNED_OVER:]]
    mean = sum(last) / len(last) if last else float("nan")
    name = (
        f"it learned: the last {LEARNED_OVER} steps' mean reward {mean:.3f} >= "
        f"{LEARNED_REWARD} (random: 0.5)"
    )
    return name, mean >= LEARNED_REWARD


def print_report(
    tally: Tally, samples_lost: int, backoffs: int, async_columns: bool = False
) -> None:
    """The per-step table, the checks and the summary (80 columns); the async-only
    columns (lag, stale, admission) for an --async run."""
    lines = report_lines(
        tally.reports,
        tally.checks,
        async_columns,
        max_logprob_diff=tally.max_ref_diff,
        tolerance=TOLERANCE,
        samples_lost=samples_lost,
        backoffs=backoffs,
        with_table=False,  # its rows went out as each step finished
    )
    print("\n".join(lines))


def write_json_report(
    path: str, tally: Tally, samples_lost: int, first_step: int, restored_samples: int
) -> None:
    """--json: the report as JSON."""
    with open(path, "w") as f:
        json.dump(
            {
                "steps": [r.__dict__ for r in tally.reports],
                "checks": tally.checks,
                "max_reference_logprob_diff": tally.max_ref_diff,
                "samples_lost": samples_lost,
                "first_step": first_step,
                "restored_samples": restored_samples,
                "checkpoints": tally.checkpoints,
            },
            f,
            indent=2,
        )


def keep_serving(handle) -> None:
    """--keep-serving: the service stays up for `dataplane status` until Ctrl-C or SIGTERM."""
    print(
        f"\nThe service stays up: dataplane status --address {handle.admin_address}\n"
        "Press Ctrl-C (or send SIGTERM) to stop it.",
        flush=True,
    )
    from dataplane_server.launch.stop_signal import StopSignal

    StopSignal().install().wait()


# ---- helpers -------------------------------------------------------------------------


def delete_partition(client, meta) -> None:
    """After a synchronous step: its partition goes, samples and declaration."""
    client.clear_samples(None, meta.partition_id)


def version_lag(meta, version: int) -> dict[str, Any]:
    """How many policy versions behind ``version`` the batch's samples were generated:
    the StepReport's lag_max, lag_mean and lag_counts (samples per lag)."""
    from policy_workers.rollout import WEIGHT_VERSION

    lags = [version - int(tag[WEIGHT_VERSION]) for tag in meta.tags]
    counts = [0] * (max(lags) + 1)
    for lag in lags:
        counts[lag] += 1
    return {"lag_max": max(lags), "lag_mean": sum(lags) / len(lags), "lag_counts": counts}


def group_advantages(rewards: torch.Tensor, group_ids: list[str]) -> torch.Tensor:
    """GRPO: each reward minus its group's mean, over the group's std (0 when the group agrees)."""
    import torch

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


def wait_for_rollouts(client, pid: str, want: int, pending: list, bar) -> list:
    """Return once partition ``pid`` holds ``want`` samples; returns the rollout runs still going.

    Watches the partition's sample count (no claim is attempted, so no claim
    times out). ``ray.wait`` paces the loop and surfaces a crashed rollout actor
    at once instead of waiting forever.
    """
    import ray

    while True:
        produced = client.describe_partition(pid).num_samples
        bar.update(produced - bar.n)
        if produced >= want:
            return pending
        if not pending:
            raise RuntimeError(
                f"every rollout actor finished but partition {pid!r} holds {produced} of "
                f"{want} samples"
            )
        ready, pending = ray.wait(pending, num_returns=1, timeout=0.25)
        for ref in ready:
            ray.get(ref)


def classic_bytes_of_passes(policy, leaders: list[int]) -> int:
    """Bytes of the tensors the DP leaders fetched and wrote back since the last call.

    On the classic path the driver puts each DP rank's batch in the object store
    once (that rank's TP siblings read the same copy): exactly the padded batch
    its leader fetched here. It gathers one result per DP rank: exactly what the
    leader wrote back. The workers' recorders measured those tensors.
    """
    logs = policy.run_on_all_workers("get_io_log")
    policy.run_on_all_workers("clear_io_log")
    return sum(entry["nbytes"] for rank in leaders for entry in logs[rank])


def partition_exists(client, pid: str) -> bool:
    from dataplane_client.wire.errors import UnknownPartition

    try:
        client.describe_partition(pid)
    except UnknownPartition:
        return False
    return True


def missing_prompts(client, pid: str, prompts: list[int], group: int) -> list[int]:
    """The prompts whose group partition ``pid`` lacks (a group is written whole or not at all)."""
    from dataplane_client.wire.errors import SamplesNotFound
    from policy_workers.rollout import group_sample_ids

    missing = []
    for prompt in prompts:
        try:
            client.get_samples(group_sample_ids(pid, prompt, group), pid, ["rewards"])
        except SamplesNotFound:
            missing.append(prompt)
    return missing


def fit(line: str, width: int = WIDTH) -> str:
    """``line`` cut in the middle to ``width`` columns (long paths), marked with '...'."""
    if len(line) <= width:
        return line
    keep = width - 3
    return line[: keep // 2] + "..." + line[len(line) - (keep - keep // 2) :]


def _nbytes(obj) -> int:
    return len(pickle.dumps(obj, protocol=5))


def _store_bytes(handle) -> int:
    """Bytes the storage units received plus served so far (their own counters)."""
    import ray

    snaps = ray.get([u.metrics_snapshot.remote() for u in handle.units])
    counters = [s.stats.get("counters", {}) for s in snaps]
    return int(sum(c.get("put_bytes_total", 0) + c.get("get_bytes_total", 0) for c in counters))


if __name__ == "__main__":
    sys.exit(main())
