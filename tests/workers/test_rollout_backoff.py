"""A rollout actor whose put meets a full store backs off, retries, then reports it.

Its puts are awaited (``put_samples_async``). Before 84c1d9b the awaited put
never returned from a full store's ``CapacityExceeded`` (a ``TimeoutError``
taken for the client's own poll timing out), so the actor's back-off in
``policy_workers/rollout.py`` could not happen: the actor hung, spinning a core.
"""

import pytest
import ray

from dataplane_client.wire.errors import CapacityExceeded
from policy_workers.config import ModelConfig
from policy_workers.rollout import GRPO_FIELDS, RolloutActor, RolloutConfig

ATTEMPTS = 3


@pytest.mark.timeout(120)  # a bound on a hang, not a speed target
def test_a_rollout_actor_backs_off_from_a_full_store_and_then_reports_it(service_factory):
    # Too small for one group: every put of the actor is refused at once.
    handle = service_factory(
        "rollout-full", num_storage_units=1, unit_capacity_bytes=64, admin_enabled=False
    )
    handle.client().register_partition("step0", fields=GRPO_FIELDS, grpo_group_size=2)
    cfg = RolloutConfig(
        generations=2, min_new_tokens=2, max_new_tokens=4, backoff_s=0.01, max_put_attempts=ATTEMPTS
    )
    actor = RolloutActor.remote(0, ModelConfig(), cfg, handle.config.name, handle.config.namespace)
    with pytest.raises(CapacityExceeded):
        ray.get(actor.run.remote("step0", [0]))
    # Every attempt was refused and counted (the store's level never held the actor up:
    # it stays empty); after the last one the actor reports the full store.
    stats = ray.get(actor.stats.remote())
    assert (stats["backoffs"], stats["groups_written"]) == (ATTEMPTS, 0)
    ray.kill(actor)
