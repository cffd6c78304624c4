"""Weight refit: the trainer's current weights into the rollout actors' generation models.

The policy's workers hold the model split for training (a replicated body, the
output projection split over TP by vocabulary rows); a rollout actor holds a
plain transformers model. ``publish_weights`` gathers the whole model once
(``get_parameters(full_head=True)``, a TP collective every worker joins) and
puts it in the Ray object store a single time; every actor then reads that one
object (``load_weights``). At the demo's model sizes this is milliseconds; a
real system would broadcast over NCCL instead, the seam is the same.
"""

from __future__ import annotations

import time
from typing import Any

import ray
import torch
from torch import nn


def publish_weights(policy: Any) -> ray.ObjectRef:
    """The policy's whole model (rank 0's copy: every rank holds the same after the
    gather) in the object store, as ``{"body.<name>": tensor, "head_weight": tensor}``."""
    params = policy.run_on_all_workers("get_parameters", full_head=True)[0]
    return ray.put(params)


def refit_actors(policy: Any, actors: list, version: int) -> float:
    """Every rollout actor loads the policy's current weights as ``version``; returns the
    seconds it took (gather, one object-store put, every actor's load)."""
    t0 = time.perf_counter()
    weights = publish_weights(policy)
    ray.get([a.load_weights.remote(version, weights) for a in actors])
    return time.perf_counter() - t0


def load_weights(model: nn.Module, params: dict[str, torch.Tensor]) -> None:
    """Copies ``params`` (``publish_weights``' layout) into a transformers causal LM in place.

    Every parameter of the model must be given and have the same shape: a mismatch
    raises ValueError naming it, before anything is copied (no half-loaded model).
    """
    body = dict(model.base_model.named_parameters())  # type: ignore[union-attr]
    head = model.get_output_embeddings().weight  # type: ignore[operator]
    want = {f"body.{k}": v for k, v in body.items()} | {"head_weight": head}
    missing = sorted(set(want) - set(params))
    unknown = sorted(set(params) - set(want))
    if missing or unknown:
        raise ValueError(
            f"refit weights do not fit the model: missing {missing}, unknown {unknown}"
        )
    for name, target in want.items():
        if params[name].shape != target.shape:
            raise ValueError(
                f"refit weight {name}: shape {tuple(params[name].shape)}, the model's is "
                f"{tuple(target.shape)}"
            )
    with torch.no_grad():  # all checked first: a refused refit leaves the model as it was
        for name, target in want.items():
            target.copy_(params[name].to(target.dtype))
