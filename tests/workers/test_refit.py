"""Weight refit: a rollout actor generates with the weights it is given, tagged with their version.

A real rollout actor on the session's Ray is handed another model's weights in
``publish_weights``' layout (the trainer's ``get_parameters(full_head=True)``);
the group it then writes carries that version, and its stored generation
logprobs are the new model's, not the initial one's. Weights that do not fit
the model are refused with the name of what is wrong, before any is copied.
"""

import dataclasses

import pytest
import ray
import torch

from dataplane_client.batching.materialize import materialize
from policy_workers.config import ModelConfig
from policy_workers.model import VocabParallelCausalLM, build_hf_model, reference_logprobs
from policy_workers.refit import load_weights
from policy_workers.rollout import GRPO_FIELDS, WEIGHT_VERSION, RolloutActor, RolloutConfig

INITIAL = ModelConfig()
TRAINED = dataclasses.replace(INITIAL, seed=INITIAL.seed + 1)  # stands in for trained weights


def trainer_layout(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """What a TP=1 policy worker's get_parameters(full_head=True) returns for this model."""
    split = VocabParallelCausalLM(build_hf_model(cfg))
    params = {f"body.{k}": v.detach().clone() for k, v in split.body.named_parameters()}
    params["head_weight"] = split.full_head_weight()
    return params


@pytest.mark.timeout(180)  # a bound on a hang, not a speed target
def test_a_refitted_actor_generates_with_the_new_weights_and_their_version(service_factory):
    handle = service_factory("refit", admin_enabled=False)
    client = handle.client()
    client.register_partition(
        "step3", fields=GRPO_FIELDS, consumer_tasks=["check"], grpo_group_size=2
    )
    cfg = RolloutConfig(generations=2, min_new_tokens=4, max_new_tokens=6)
    actor = RolloutActor.remote(0, INITIAL, cfg, handle.config.name, handle.config.namespace)
    try:
        assert ray.get(actor.load_weights.remote(3, ray.put(trainer_layout(TRAINED)))) == 3
        ray.get(actor.run.remote("step3", [0], 12))
    finally:
        ray.kill(actor)
    meta = client.claim_meta("step3", "check", GRPO_FIELDS, 2, timeout_s=30)
    assert [t[WEIGHT_VERSION] for t in meta.tags] == [3, 3]
    assert [t["prompt"] for t in meta.tags] == [12, 12]
    batch = materialize(client.get_data(meta, ["input_ids", "generation_logprobs"]))
    lengths = torch.tensor(meta.sequence_lengths)
    with torch.no_grad():
        new = reference_logprobs(build_hf_model(TRAINED).eval(), batch["input_ids"], lengths)
        old = reference_logprobs(build_hf_model(INITIAL).eval(), batch["input_ids"], lengths)
    assert (batch["generation_logprobs"] - new).abs().max() <= 1e-5
    assert (batch["generation_logprobs"] - old).abs().max() > 1e-2


def test_weights_that_do_not_fit_are_refused_naming_what_is_wrong():
    model = build_hf_model(INITIAL)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = trainer_layout(TRAINED)
    head = params.pop("head_weight")
    with pytest.raises(ValueError, match=r"missing \['head_weight'\]"):
        load_weights(model, params)
    params["head_weight"] = head[:5]
    with pytest.raises(ValueError, match="head_weight: shape"):
        load_weights(model, params)
    params["head_weight"], params["body.extra"] = head, head
    with pytest.raises(ValueError, match=r"unknown \['body.extra'\]"):
        load_weights(model, params)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    del params["body.extra"]
    load_weights(model, params)
    assert torch.equal(model.get_output_embeddings().weight, head)
