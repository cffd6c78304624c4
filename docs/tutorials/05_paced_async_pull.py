"""Tutorial 05: async RL on one page: paced admission, versions, partial rollouts, ``where``,
per-rank pulls.

Run it: ``.venv/bin/python docs/tutorials/05_paced_async_pull.py`` (seconds; no Ray: the
in-process client, whose verbs and answers are the Ray client's).

A producer thread generates GRPO groups while the trainer trains; every call below is
one you would make in a real loop:

- ``StalenessSpec`` (``from dataplane_client import StalenessSpec``; it lives in
  ``dataplane_client.wire.messages``) makes the partition versioned: ``max_staleness=1``
  bounds how old a trained sample may be, ``admission_batch`` is the trainer's samples
  per version, ``pace=True`` paces producers so that no sample goes stale.
- ``admit_rollouts(pid, n, wait=True)`` before generating, ``release_rollouts(grant)``
  once the samples are put; each put says the version that generated it
  (``put_samples(..., version=grant.version)``, read back as the ``weight_version`` tag).
- Partial rollouts: a generation a weight update interrupts is not thrown away.
  ``append_tokens(ids, pid, {"tokens": part}, version, tags=..., start=True)`` stores what
  the old weights generated (the sample is not claimable yet, and counts against
  admission); the rollout resumes from it with the new weights and appends the rest
  (``finish=True``). Each segment keeps its version (``token_segments`` in the tags);
  the sample's staleness is its oldest segment's.
- ``where="reward_std > 0"`` on a ``numeric_tags`` column: groups whose rewards are all
  equal (no advantage signal) are filtered in the store and no longer owed.
- Per-rank pull: each data-parallel rank claims its own micro-batches
  (``dp_rank=r``) with the ``token_budget`` claim policy, ``step_end`` sharing the step's
  quota among the ranks. In a multi-process policy,
  ``policy_workers.rank_stream.RankStream`` makes these claims for each DP leader in
  lockstep rounds (token totals balanced) and feeds its TP siblings.
- ``set_policy_version(pid, v + 1)`` after each step.
"""

import threading
import time

import torch

from dataplane_client import StalenessSpec
from dataplane_client.wire.errors import AdmissionTimeout
from dataplane_server import build_data_plane_client

PID, GROUP, BATCH, STEPS, RANKS, BUDGET = "rollouts", 2, 8, 4, 2, 12


def produce(client, stop: threading.Event) -> None:
    g = 0
    while not stop.is_set():
        try:
            grant = client.admit_rollouts(PID, GROUP, wait=True, timeout_s=0.2)
        except AdmissionTimeout:
            continue  # no room: the trainer is behind (or we are stopping)
        rewards = torch.tensor([1.0, 1.0] if g % 3 == 0 else [1.0, 0.0])  # every 3rd: no signal
        tags = [{"group_id": g, "reward_std": rewards.std().item()}] * GROUP
        tokens = [torch.arange(3 + (5 * g + i) % 9) for i in range(GROUP)]  # lengths vary
        ids = [f"g{g}-{i}" for i in range(GROUP)]
        if g % 2:  # a partial rollout: a weight update interrupted this group's generation
            half = [t[: len(t) // 2] for t in tokens]  # what the old weights generated: kept
            client.append_tokens(ids, PID, {"tokens": half}, grant.version, tags=tags, start=True)
            # ... load the new weights, resume from the stored tokens ...
            client.put_samples(ids, PID, {"rewards": rewards})  # other fields: a put
            rest = [t[len(t) // 2 :] for t in tokens]
            client.append_tokens(ids, PID, {"tokens": rest}, client.policy_version(PID),
                                 finish=True)  # fmt: skip
        else:
            client.put_samples(ids, PID, {"tokens": tokens, "rewards": rewards}, tags=tags,
                               version=grant.version)  # fmt: skip
        client.release_rollouts(grant)
        g += 1


def train_one_step(client, version: int) -> None:
    step_end = (version + 1) * BATCH  # the task's consumed count once this step is done
    tokens, lags, segments = [0] * RANKS, [], 0
    while client.consumption_detail(PID, ["train"])[0].consumed < step_end:
        for rank in range(RANKS):  # each rank's leader, in a real policy its own process
            meta = client.claim_meta(PID, "train", ["tokens"], BATCH, rank, blocking=False,
                                     claim_policy="token_budget", where="reward_std > 0",
                                     policy_options={"token_budget": BUDGET, "step_end": step_end})  # fmt: skip
            tokens[rank] += sum(meta.sequence_lengths or [])
            lags += [version - t["weight_version"] for t in meta.tags or []]
            segments += sum(len(t.get("token_segments", [[0]])) > 1 for t in meta.tags or [])
        time.sleep(0.01)  # nothing ready yet: the producer is generating
    # ... compute logprobs and advantages, train on the ranks' batches, refit ...
    client.set_policy_version(PID, version + 1)  # trained: publish the new policy
    print(
        f"step {version}: {len(lags)} samples ({segments} resumed partial rollouts), "
        f"tokens per rank {tokens}, lags {sorted(set(lags))}"
    )


def main() -> None:
    client = build_data_plane_client({"enabled": True, "impl": "in_process"})
    spec = StalenessSpec(max_staleness=1, admission_batch=BATCH, pace=True)
    client.register_partition(PID, fields=["tokens", "rewards"], consumer_tasks=["train"],
                              grpo_group_size=GROUP, numeric_tags={"reward_std": "float64"},
                              staleness=spec)  # fmt: skip
    stop = threading.Event()
    producer = threading.Thread(target=produce, args=(client, stop))
    producer.start()
    try:
        for version in range(STEPS):
            train_one_step(client, version)
    finally:
        stop.set()
        producer.join()
    st = client.describe_partition(PID).staleness
    print(
        f"dropped stale: {st.dropped_stale.get('train', 0)}, filtered: {st.filtered.get('train', 0)}"
    )
    client.close()


if __name__ == "__main__":
    main()
