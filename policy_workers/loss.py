"""GRPO clipped policy-gradient loss, token level.

For every valid token ``t`` of sample ``i``::

    ratio    = exp(logprob - prev_logprob)
    pg       = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)
    pg      *= exp(prev_logprob - generation_logprob)      # only with importance correction
    loss     = sum(pg * mask) / global_valid_tokens

``mask = token_mask * sample_mask`` with position 0 (which has no logprob, by
the logprob convention) always excluded. ``A`` (advantages) is per token
``[B, S]`` or per sample ``[B]``. ``global_valid_tokens`` is the number of
valid tokens of the whole global batch summed over all DP ranks (the caller
all-reduces it), so the sum of the per-rank losses is the loss of the global
batch whatever the DP split is, and summing gradients over DP gives its exact
gradient.

Importance correction (``use_importance_sampling_correction``): the rollout
engine's logprobs (``generation_logprobs``) can differ from the trainer's
(``prev_logprobs``) for the same weights (kernels, precision). The detached
weight ``exp(prev - generation)`` reweights each token's loss from the
sampling distribution to the trainer's. Off by default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from policy_workers.config import LossConfig


def valid_token_mask(batch: Mapping[str, Any], seqlen: int | None = None) -> torch.Tensor:
    """``token_mask * sample_mask`` as float32 ``[B, S]``, position 0 and positions >= length zeroed."""
    token_mask = batch["token_mask"]
    seqlen = token_mask.shape[1] if seqlen is None else seqlen
    mask = token_mask[:, :seqlen].to(torch.float32)
    if "sample_mask" in batch:
        mask = mask * batch["sample_mask"].to(device=mask.device, dtype=torch.float32).unsqueeze(1)
    positions = torch.arange(mask.shape[1], device=mask.device).unsqueeze(0)
    keep = positions > 0
    if "input_lengths" in batch:
        keep = keep & (positions < batch["input_lengths"].to(mask.device).unsqueeze(1))
    return mask * keep


@dataclass
class ClippedPGLoss:
    """Callable ``(logprobs [B, S], microbatch, global_valid_tokens) -> (loss, metrics)``."""

    cfg: LossConfig = field(default_factory=LossConfig)

    # Fields a training batch must carry (generation_logprobs only with the correction).
    def required_fields(self) -> list[str]:
        fields = ["input_ids", "token_mask", "sample_mask", "advantages", "prev_logprobs"]
        if self.cfg.use_importance_sampling_correction:
            fields.append("generation_logprobs")
        return fields

    def __call__(
        self,
        logprobs: torch.Tensor,
        batch: Mapping[str, Any],
        global_valid_tokens: torch.Tensor | float,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        seqlen = logprobs.shape[1]
        device = logprobs.device
        mask = valid_token_mask(batch, seqlen).to(device)
        prev = batch["prev_logprobs"][:, :seqlen].to(device=device, dtype=torch.float32)
        adv = batch["advantages"].to(device=device, dtype=torch.float32)
        adv = adv.unsqueeze(1) if adv.dim() == 1 else adv[:, :seqlen]

        ratio = torch.exp(logprobs - prev)
        clipped = ratio.clamp(1.0 - self.cfg.ratio_clip_min, 1.0 + self.cfg.ratio_clip_max)
        per_token = torch.maximum(-ratio * adv, -clipped * adv)
        if self.cfg.use_importance_sampling_correction:
            gen = batch["generation_logprobs"][:, :seqlen].to(device=device, dtype=torch.float32)
            per_token = per_token * torch.exp(prev - gen).detach()

        loss = (per_token * mask).sum() / global_valid_tokens
        with torch.no_grad():
            n = mask.sum()
            was_clipped = ((ratio - clipped).abs() > 0).float()
            metrics = {
                "num_valid_tokens": float(n),
                "clip_fraction_sum": float((was_clipped * mask).sum()),
                "ratio_sum": float((ratio * mask).sum()),
            }
        return loss, metrics
