"""Tutorial 04: an async-RL loop: a rollout actor and a trainer sharing one store.

Run it: ``.venv/bin/python docs/tutorials/04_async_rl.py`` (about 30 s on 2 cores, most of
it starting Ray).

A rollout actor generates continuously while the trainer trains; the store keeps the
two honest. What each call does:

- ``StalenessSpec(max_staleness=1, admission_batch=8)`` at registration makes the
  partition versioned: every put says the policy version that generated it
  (``put_samples(..., version=v)``, kept and read back as the ``weight_version`` tag),
  and no claim hands out a sample (or a GRPO group: as old as its oldest member) more
  than ``max_staleness`` versions behind the current one.
  Older ones are dropped and counted (``stale_samples="drop"``, the default).
- ``admit_rollouts(pid, n, wait=True)`` is the actor asking "may I start ``n`` more
  trajectories?": granted only while samples started but not yet trained stay within
  ``(max_staleness + 1) * admission_batch`` (AReaL's bound), so the actor never runs
  further ahead than the trainer can use. ``release_rollouts(grant)`` once they are put.
- ``set_policy_version(pid, v)``: the trainer finished a step (and, in a real loop,
  refit the rollout actors' weights). Samples now outside the window are dropped.
- ``numeric_tags={"reward_std": "float64"}`` declares a typed tag column, and a claim's
  ``where="reward_std > 0"`` filters on it in the store: a GRPO group whose rewards
  are all equal has no advantage signal (DAPO's dynamic sampling). A filtered sample
  is no longer owed to the task, so admission has room again.
- ``claim_meta(..., max_staleness=1)`` may only tighten the partition's bound.

Every trained sample's lag (current version minus its ``weight_version``) is checked
against the bound below; ``describe_partition(pid).staleness`` counts what was dropped
and filtered. The same code runs on the in-process client
(``build_data_plane_client({"enabled": True, "impl": "in_process"})``) without Ray,
minus the actor.
"""

import threading
import time

import ray
import torch

from dataplane_client import DataPlaneConfig, StalenessSpec, connect
from dataplane_client.wire.errors import AdmissionTimeout
from dataplane_server import ensure_local_ray, start

NAME, NAMESPACE, PID = "tutorial-04", "tutorials", "rollouts"
GROUP = 4  # samples per prompt (a GRPO group)
BATCH = 8  # samples per train step: two groups
STEPS = 4
MAX_STALENESS = 1


@ray.remote(num_cpus=0)
class RolloutActor:
    def __init__(self) -> None:
        self.client = connect(NAME, NAMESPACE)  # any process of the cluster
        self.stopped = threading.Event()

    def run(self) -> int:
        """Generate groups until stopped; returns how many were put."""
        group = 0
        while not self.stopped.is_set():
            try:
                grant = self.client.admit_rollouts(PID, GROUP, wait=True, timeout_s=1.0)
            except AdmissionTimeout:
                continue  # the trainer is behind: ask again (or stop)
            assert grant is not None  # wait=True: a grant, or AdmissionTimeout
            # A real actor generates with the weights of its last refit; here: the store's.
            version = self.client.policy_version(PID)
            rewards = torch.tensor([1.0] * GROUP if group % 3 == 0 else [1.0, 0.0] * (GROUP // 2))
            reward_std = rewards.std().item()  # 0 for every third group: filtered out
            ids = [f"g{group}-{i}" for i in range(GROUP)]
            tags = [{"group_id": group, "reward_std": reward_std} for _ in ids]
            fields = {"tokens": torch.full((GROUP, 6), group), "rewards": rewards}
            self.client.put_samples(ids, PID, fields, tags=tags, version=version)
            self.client.release_rollouts(grant)
            group += 1
        return group

    def stop(self) -> None:
        self.stopped.set()


def main() -> None:
    ensure_local_ray(num_cpus=4)  # 127.0.0.1; no-op when this process has Ray already
    handle = start(DataPlaneConfig(name=NAME, namespace=NAMESPACE, admin_enabled=False))
    client = handle.client()
    try:
        client.register_partition(
            PID,
            fields=["tokens", "rewards"],
            consumer_tasks=["train"],
            grpo_group_size=GROUP,  # claims hand out whole groups
            numeric_tags={"reward_std": "float64"},
            staleness=StalenessSpec(max_staleness=MAX_STALENESS, admission_batch=BATCH),
        )
        # max_concurrency=2: stop() is answered while run() runs.
        actor = RolloutActor.options(max_concurrency=2).remote()  # type: ignore[attr-defined]
        produced = actor.run.remote()
        lags = []
        for step in range(STEPS):
            version = client.policy_version(PID)
            meta = client.claim_meta(
                PID,
                "train",
                ["tokens", "rewards"],
                BATCH,
                where="reward_std > 0",  # only groups with an advantage signal
                max_staleness=MAX_STALENESS,
                timeout_s=60.0,
            )
            batch = client.get_data(meta)
            # Each claimed sample's version comes back as its "weight_version" tag.
            step_lags = [version - t["weight_version"] for t in meta.tags]
            assert max(step_lags) <= MAX_STALENESS, step_lags  # the store's promise
            lags += step_lags
            # ... compute logprobs and advantages, train on `batch`, refit the actors ...
            time.sleep(0.2)  # stands for that work; meanwhile the actor generates ahead
            reward = batch["rewards"].mean().item()
            client.set_policy_version(PID, version + 1)
            lagged = sorted(set(step_lags))
            print(
                f"step {step}: version {version}, {meta.size} samples, lags {lagged}, reward {reward:.2f}"
            )
        ray.get(actor.stop.remote())
        groups = ray.get(produced)
        info = client.describe_partition(PID).staleness
        print(
            f"trained {len(lags)} samples in {STEPS} steps, max lag {max(lags)} <= {MAX_STALENESS}; "
            f"{groups} groups generated, {info.dropped_stale.get('train', 0)} samples dropped "
            f"stale, {info.filtered.get('train', 0)} filtered out"
        )
    finally:
        client.close()
        handle.shutdown()


if __name__ == "__main__":
    main()
