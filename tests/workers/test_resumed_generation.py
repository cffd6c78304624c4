"""A generation interrupted by a weight update, stored as a partial rollout and resumed
from the store (``policy_workers.chunked_generation``, ``append_tokens``), on a real tiny
transformers model built from a config with a fixed seed: with unchanged weights it is
the uninterrupted generation bit for bit; with new weights its tokens carry each
version's behaviour logprobs, and those reach the decoupled loss token by token."""

from __future__ import annotations

import dataclasses
import random

import pytest
import ray
import torch
from polling import wait_until
from test_refit import trainer_layout

from dataplane_client.batching.materialize import materialize
from dataplane_client.wire.messages import StalenessSpec
from dataplane_server.core.inprocess import InProcessDataPlaneClient
from policy_workers.chunked_generation import ChunkedGroup, GroupPlan
from policy_workers.config import LossConfig, ModelConfig
from policy_workers.loss import ClippedPGLoss, valid_token_mask
from policy_workers.model import build_hf_model, reference_logprobs
from policy_workers.rollout import GRPO_FIELDS, WEIGHT_VERSION, RolloutActor, RolloutConfig

TOKEN_FIELDS = ["input_ids", "generation_logprobs", "token_mask"]
CHUNK = 3
G = 4


@pytest.fixture(scope="module")
def models():
    cfg = ModelConfig()
    return build_hf_model(cfg).eval(), build_hf_model(dataclasses.replace(cfg, seed=99)).eval()


def _plan(prompt_index: int = 0) -> GroupPlan:
    rng = random.Random(f"test/prompt{prompt_index}")
    prompt = torch.tensor([rng.randrange(3, 128) for _ in range(6)])
    return GroupPlan.draw(prompt, rng, G, 10, 14)


def _client_and_partition():
    c = InProcessDataPlaneClient()
    c.register_partition(
        "p", TOKEN_FIELDS, None, ["train"], staleness=StalenessSpec(max_staleness=1)
    )
    return c, [f"s{i}" for i in range(G)]


def _interrupted(c, ids, plan, models_per_segment) -> ChunkedGroup:
    """Generate, storing and resuming from the store at each chunk boundary where the next
    segment's model takes over (one segment per model, version = its index)."""
    group = ChunkedGroup(plan, CHUNK)
    chunks = -(-plan.new_tokens // CHUNK)
    stops = [chunks * (k + 1) // len(models_per_segment) for k in range(len(models_per_segment))]
    for version, (model, stop) in enumerate(zip(models_per_segment, stops)):
        while group.done // CHUNK < stop and not group.finished:
            group.step(model, 1.0)
        last = group.finished
        c.append_tokens(
            ids, "p", group.unsaved(), version, start=version == 0, finish=last,
            tags=[{"group_id": 0}] * G if version == 0 else None,
        )  # fmt: skip
        group.mark_saved()
        if not last:
            stored = c.get_samples(ids, "p", ["input_ids"])["input_ids"]
            group.resume_from(list(stored.unbind()))
    return group


def test_an_interrupted_and_resumed_generation_equals_the_uninterrupted_one_bit_for_bit(models):
    model = models[0]
    plan = _plan()
    straight = ChunkedGroup(plan, CHUNK)
    while not straight.finished:
        straight.step(model, 1.0)
    want = straight.whole()
    c, ids = _client_and_partition()
    _interrupted(c, ids, plan, [model, model, model])  # two interruptions, same weights
    got = c.get_samples(ids, "p", TOKEN_FIELDS)
    for name in TOKEN_FIELDS:
        rows = list(got[name].unbind())
        for a, b in zip(rows, want[name]):
            assert a.dtype == b.dtype, name
            assert torch.equal(a, b), name
    # some row was cut before the last interruption: its padding changed no other row
    assert min(plan.lengths) - len(plan.prompt) < plan.new_tokens * 2 // 3
    meta = c.claim_meta("p", "train", TOKEN_FIELDS, G, blocking=False)
    segments = [t["token_segments"] for t in meta.tags]
    assert all([v for v, _ in s] == [0, 1, 2] for s in segments)
    assert [sum(n for _, n in s) for s in segments] == plan.lengths


def test_behaviour_logprobs_of_two_versions_reach_the_decoupled_loss(models):
    old, new = models
    plan = _plan(1)
    c, ids = _client_and_partition()
    c.set_policy_version("p", 1)
    _interrupted(c, ids, plan, [old, new])
    meta = c.claim_meta("p", "train", TOKEN_FIELDS, G, blocking=False)
    split = [t["token_segments"][0][1] for t in meta.tags]  # tokens of version 0, per row
    batch = materialize(c.get_data(meta, TOKEN_FIELDS))
    lengths = torch.tensor(
        [t["token_segments"][0][1] + t["token_segments"][1][1] for t in meta.tags]
    )
    ids_t, behaviour = batch["input_ids"], batch["generation_logprobs"]
    with torch.no_grad():
        by_old = reference_logprobs(old, ids_t, lengths)
        by_new = reference_logprobs(new, ids_t, lengths)
    positions = torch.arange(ids_t.shape[1]).unsqueeze(0)
    first = positions < torch.tensor(split).unsqueeze(1)
    inside = positions < lengths.unsqueeze(1)
    # each token's behaviour logprob is its own segment's policy's
    torch.testing.assert_close(behaviour[first], by_old[first], atol=1e-5, rtol=0)
    torch.testing.assert_close(
        behaviour[~first & inside], by_new[~first & inside], atol=1e-5, rtol=0
    )
    assert (by_old[~first & inside] - by_new[~first & inside]).abs().max() > 0.1  # two policies
    # the trainer's proximal policy is the new one: the decoupled weight is 1 on the new
    # segment's tokens and pi_new / pi_old on the old one's
    loss_batch = {
        "input_ids": ids_t,
        "input_lengths": lengths,
        "token_mask": batch["token_mask"],
        "sample_mask": torch.ones(G),
        "advantages": torch.linspace(-1.0, 1.0, G),
        "prev_logprobs": by_new,
        "generation_logprobs": behaviour,
    }
    valid = valid_token_mask(loss_batch) > 0
    cfg = LossConfig(use_importance_sampling_correction=True)
    _, metrics = ClippedPGLoss(cfg)(by_new.clone(), loss_batch, 1.0, float(valid.sum()))
    want = torch.exp(by_new - behaviour)
    assert metrics["behaviour_weight_sum"] == pytest.approx(float(want[valid].sum()), rel=1e-5)
    old_tokens = valid & first
    assert old_tokens.any()
    assert (want[valid & ~first] - 1).abs().max() < 1e-4  # the new segment: on-policy
    assert (want[old_tokens] - 1).abs().max() > 0.1  # the old one: weighted off-policy


# ---- a rollout actor a refit interrupts mid-generation ----------------------------------
REFITS = 3


def _interruptions(actor) -> int:
    stats = ray.get(actor.stats.remote())
    return stats["tokens_discarded"] + stats["tokens_resumed"]


@pytest.mark.ray
@pytest.mark.timeout(600)  # a bound on a hang, not a speed target
@pytest.mark.parametrize("partial", [True, False], ids=["resumed", "discarded"])
def test_a_refit_mid_generation_is_resumed_from_the_store_or_thrown_away(module_services, partial):
    """Refits land while the actor generates (``REFITS`` of them, each after the previous
    one interrupted a group, or until the run ended): with ``partial_rollouts`` no token is thrown away, the
    groups are stored as partial rollouts of several versions and finish claimable, whole;
    without, the interrupted tokens are thrown away and the groups start over."""
    handle = module_services("partial-actor", admin_enabled=False)
    client, pid = handle.client(), f"rollouts-{'resumed' if partial else 'discarded'}"
    client.register_partition(pid, GRPO_FIELDS, consumer_tasks=["check"], grpo_group_size=2)
    cfg = RolloutConfig(
        generations=2,
        min_new_tokens=24,
        max_new_tokens=32,
        chunk_tokens=2,
        partial_rollouts=partial,
    )
    actor = RolloutActor.remote(0, ModelConfig(), cfg, handle.config.name, handle.config.namespace)
    weights = ray.put(trainer_layout(ModelConfig()))
    try:
        run = actor.run.remote(pid, [0, 1, 2])
        version = 0
        # A few refits, then none: without partial rollouts every refit starts the group
        # under way over, so refitting until the run ends made it end only by luck (27 to
        # 252 s here, the same code).
        while version < REFITS and not ray.wait([run], timeout=0)[0]:
            seen = _interruptions(actor)
            version += 1
            ray.get(actor.load_weights.remote(version, weights))
            wait_until(
                lambda seen=seen: _interruptions(actor) > seen or ray.wait([run], timeout=0)[0],
                300,
                "the refit to interrupt a group or the run to end",
            )
        ray.get(run)
        stats = ray.get(actor.stats.remote())
    finally:
        ray.kill(actor)
    meta = client.claim_meta(pid, "check", GRPO_FIELDS, 6, blocking=False)
    assert meta.size == 6  # every group finished and claimable
    segments = [t.get("token_segments") for t in meta.tags]
    lengths = materialize(client.get_data(meta, ["input_lengths"]))["input_lengths"].tolist()
    if partial:
        assert stats["tokens_discarded"] == 0
        assert stats["tokens_resumed"] > 0
        resumed = [s for s in segments if s is not None]
        assert resumed, segments
        assert any(len({v for v, _ in s}) > 1 for s in resumed)  # tokens of several versions
        for s, n, tag in zip(segments, lengths, meta.tags):
            if s is not None:
                assert sum(t for _, t in s) == n  # every token kept, none twice
                assert tag[WEIGHT_VERSION] == s[0][0]  # as stale as its oldest segment
    else:
        assert stats["tokens_resumed"] == 0
        assert stats["tokens_discarded"] > 0
        assert segments == [None] * 6  # generated again, whole, under the newest weights
