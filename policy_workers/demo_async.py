"""`dataplane demo --async --max-staleness N`: rollouts and training overlap; the store
bounds how stale a trained sample may be.

One versioned partition holds every group (``StalenessSpec``: the version tag
``weight_version``, the window ``max_staleness``, admission for one training
batch). Each rollout actor generates continuously (``RolloutActor.produce``):
it asks the store to admit one group, takes the next prompt number, generates
with the newest weights it was given and puts the group tagged with their
version. The store admits a group only while the samples started and not yet
trained stay within ``(N + 1)`` batches, and at most ``N + 1`` batches per
version, so no compute goes into rollouts that would arrive too stale.

Per step ``k`` the trainer (policy version ``k``) claims one batch within the
window (oldest first; groups that fell out of it are dropped by the store and
counted), trains on it with the decoupled PPO loss (``policy_workers.loss``),
hands the new weights to the actors and only then publishes version ``k + 1``:
a group admitted at ``k + 1`` is generated with them. With ``N = 0`` exactly
one batch is admitted per version, after the refit: the run trains exactly what
the synchronous demo trains (``tests/workers/test_demo.py``).

With ``--max-staleness`` >= 1 actors generate in chunks of tokens, so a refit
interrupts the groups in flight at their next chunk: their tokens are thrown away
and generated again with the new
weights, or, with ``--partial-rollouts``, stored as partial rollouts and resumed
from the store (``RolloutActor._generate_in_chunks``). The report counts both per update.

The run's prompts are its ``steps x prompts_per_step`` numbers from 0, handed out in
order; a prompt whose group the store dropped as stale is handed out again, so each
is trained once. ``--checkpoint-dir`` / ``--resume`` keep that across kills and
resumes (``async_resume``).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from typing import Any

import ray

ASYNC_PARTITION = "demo-async"
TASK = "train"


def train_async(
    run: Any,
    tally: Any,
    actors: list,
    steps: range,
    train_one_step: Callable[..., None],
    checkpoint_if_due: Callable[..., bool],
) -> None:
    """The async loop: producing actors, one training step per version (module docstring).
    ``train_one_step``: the demo's step (``demo.train_one_step``), which claims through
    the ``claim`` it is given; ``checkpoint_if_due``: the demo's save (with
    ``async_resume``'s commit and trained log)."""
    from policy_workers.async_resume import AsyncLedger, resume_partition
    from policy_workers.refit import refit_actors
    from policy_workers.rollout import PromptCounter

    pid, ledger = ASYNC_PARTITION, AsyncLedger.of_run(run.args)
    if steps.start:  # resumed: the restored store holds the partition
        prompts, handed_back = resume_partition(
            run.client, pid, TASK, steps.start, ledger, run.args.generations
        )
        print(
            f"  {handed_back} samples claimed after step {steps.start} handed back; "
            f"{len(prompts)} prompts left to generate"
        )
        refit_actors(run.policy, actors, version=steps.start)
    else:
        register_async_partition(run)
        prompts = list(range(ledger.dataset))
    # @ray.remote made PromptCounter an ActorClass; mypy ignores class decorators
    counter = PromptCounter.remote(prompts)  # type: ignore[attr-defined]
    producing = [a.produce.remote(pid, counter) for a in actors]
    seen = store_counts(run.client, pid)
    interrupted = interrupted_tokens(actors)
    dropped = [seen["dropped"]]  # the drops whose prompts went back to the counter
    try:
        for k in steps:
            train_one_step(
                run,
                tally,
                k,
                claim=functools.partial(
                    claim_async_batch, run, k, pid, producing, counter, dropped
                ),
                finish=functools.partial(ledger.finish_step, run.client, k),
            )
            report = tally.reports[-1]
            # the weights first, then the version: a group admitted at k + 1 uses them
            report.times["refit"] = refit_actors(run.policy, actors, version=k + 1)
            run.client.set_policy_version(pid, k + 1)
            now = store_counts(run.client, pid)
            report.stale_dropped = now["dropped"] - seen["dropped"]
            report.admission_waits = now["waits"] - seen["waits"]
            seen = now
            tokens = interrupted_tokens(actors)
            report.tokens_discarded = tokens["tokens_discarded"] - interrupted["tokens_discarded"]
            report.tokens_resumed = tokens["tokens_resumed"] - interrupted["tokens_resumed"]
            interrupted = tokens
            commit = functools.partial(run.client.commit_step, pid, TASK, k + 1)
            if checkpoint_if_due(run, tally, k, after_policy=commit, extra=ledger.manifest_entry()):
                ledger.saved(run.client, pid)
    finally:
        stop_producers(producing, counter)


def stop_producers(producing: list, counter: Any) -> None:
    """The run is over: each producer's loop is cancelled (it waits on the counter or the
    store) and its end read here, so Ray reports no unhandled error when the actors go."""
    for ref in producing:
        ray.cancel(ref)
    for ref in producing:
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(ref, timeout=30)
    ray.kill(counter)


def register_async_partition(run: Any) -> str:
    from dataplane_client.wire.messages import StalenessSpec
    from policy_workers.rollout import GRPO_FIELDS, WEIGHT_VERSION

    n = run.args.max_staleness
    run.client.register_partition(
        ASYNC_PARTITION,
        fields=GRPO_FIELDS,
        consumer_tasks=[TASK],
        grpo_group_size=run.args.generations,
        staleness=StalenessSpec(
            version_tag=WEIGHT_VERSION,
            max_staleness=n,
            stale_samples="drop",
            admission_batch=run.per_step,
            # Samples are "trained" for admission once claimed: without this cap the
            # claim of version k's batch would admit another batch at k before the
            # trainer moves to k + 1 (dropped at once when N = 0). N + 1 batches per
            # version is the window itself: it never holds back a group that could fit.
            oversample_ratio=n + 1,
        ),
    )
    return ASYNC_PARTITION


def claim_async_batch(
    run: Any, k: int, pid: str, producing: list, counter: Any, seen: list, times: dict
):
    """Waits until one batch is ready within the window, claims it (keys only), in
    prompt order. A producing actor that crashed is raised here at once. Groups the
    store dropped as stale meanwhile go back to ``counter``."""
    from policy_workers.rollout import GRPO_FIELDS, in_prompt_order

    t0 = time.perf_counter()
    bar = run.progress.bar(run.per_step, f"step {k} rollouts")
    while (ready := run.client.ready_depth(pid, [TASK], GRPO_FIELDS)[TASK]) < run.per_step:
        bar.update(min(ready, run.per_step) - bar.n)
        requeue_dropped(run.client, pid, counter, seen)
        # paces the poll; a producer's run only ever ends by raising
        done, _ = ray.wait(producing, num_returns=1, timeout=0.02)
        if done:
            ray.get(done[0])
    bar.close()
    meta = run.client.claim_meta(pid, TASK, GRPO_FIELDS, run.per_step, timeout_s=60.0)
    times["rollout_wait"] = time.perf_counter() - t0
    return in_prompt_order(meta)


def requeue_dropped(client: Any, pid: str, counter: Any, seen: list[int]) -> None:
    """Prompts whose groups the store dropped as stale since ``seen[0]`` drops (a
    group generated too long before the step that could claim it) go back to
    ``counter``: every prompt of the run is trained, drops or not."""
    from policy_workers.rollout import prompt_of

    info = client.describe_partition(pid).staleness
    total = sum(info.dropped_stale.values())
    if total > seen[0]:
        ids = info.recently_dropped[-(total - seen[0]) :]
        ray.get(counter.give_back.remote(sorted({prompt_of(i) for i in ids})))
        seen[0] = total


def interrupted_tokens(actors: list) -> dict[str, int]:
    """Generated tokens weight updates interrupted so far, over the actors: thrown away,
    or stored and resumed (``--partial-rollouts``)."""
    stats = ray.get([a.stats.remote() for a in actors])
    return {k: sum(s[k] for s in stats) for k in ("tokens_discarded", "tokens_resumed")}


def store_counts(client: Any, pid: str) -> dict[str, int]:
    """What the store counted so far: stale samples dropped, admissions that waited."""
    info = client.describe_partition(pid).staleness
    return {"dropped": sum(info.dropped_stale.values()), "waits": info.admission_waits}
