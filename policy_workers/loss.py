"""GRPO clipped policy-gradient loss with the reference-policy KL penalty (NeMo-RL's ClippedPG).

For every token ``t`` of sample ``i``::

    ratio    = exp(logprob - prev_logprob)
    pg       = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)
    w        = exp(prev_logprob - generation_logprob)      # only with importance correction
    w        = 0 where w > behaviour_weight_cap             # only with a cap
    pg      *= w                                            # (w detached)
    r        = reference_logprob - logprob
    kl       = beta * (exp(r) - r - 1)                       # k3 estimator, >= 0; beta = 0: off
    per_tok  = pg + kl

Normalisation (``token_level_loss``):

- token level (default): ``loss = sum(per_tok * mask) / global_valid_toks``;
- sequence level: each sample's per-token values are averaged over its valid
  tokens, then ``loss = sum(sample_mean * sample_mask) / global_valid_seqs``.

``mask = token_mask * sample_mask`` with position 0 (which has no logprob, by
the logprob convention) and positions at or past the sample's length excluded.
``A`` (advantages) is per sample ``[B]`` (one value broadcast over the
sample's tokens, what the demo stores) or per token ``[B, S]``.
``global_valid_toks`` / ``global_valid_seqs`` count the whole global batch
summed over all DP ranks (the caller all-reduces them), so the sum of the
per-rank losses is the loss of the global batch whatever the DP split is, and
summing gradients over DP gives its exact gradient.

Importance correction (``use_importance_sampling_correction``) is the
decoupled PPO objective for off-policy samples (AReaL, arXiv 2505.24298, its
eq. 5): three policies, the behaviour policy ``pi_behav`` that generated the
sample (``generation_logprobs``, written by the rollout engine, possibly some
policy versions old), the proximal policy ``pi_prox`` (``prev_logprobs``: the
trainer's current weights before this update, computed by the logprob pass)
and the policy being trained ``pi_theta`` (``logprobs``)::

    J = E_{pi_behav}[ pi_prox / pi_behav * min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) ],
    r = pi_theta / pi_prox

PPO's trust region is centred on the recent ``pi_prox``, not on the stale
``pi_behav``; the detached weight ``w = pi_prox / pi_behav`` corrects for the
samples coming from ``pi_behav``. When behaviour and proximal are the same
policy (on-policy; up to the engines' numerics) ``w = 1`` and this is the
standard PPO-clip loss. ``behaviour_weight_cap`` (AReaL's
``behav_imp_weight_cap``) leaves out of the policy-gradient term the tokens
whose weight exceeds it (they still count in the normaliser), so a sample far
off-policy cannot dominate a step. Off by default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from policy_workers.config import LossConfig


def _token_mask(batch: Mapping[str, Any], seqlen: int | None) -> torch.Tensor:
    """``token_mask`` as float32 ``[B, S]`` with position 0 and positions >= length zeroed."""
    token_mask = batch["token_mask"]
    seqlen = token_mask.shape[1] if seqlen is None else seqlen
    mask = token_mask[:, :seqlen].to(torch.float32)
    positions = torch.arange(mask.shape[1], device=mask.device).unsqueeze(0)
    keep = positions > 0
    if "input_lengths" in batch:
        keep = keep & (positions < batch["input_lengths"].to(mask.device).unsqueeze(1))
    return mask * keep


def _sample_mask(batch: Mapping[str, Any], rows: int, device: torch.device) -> torch.Tensor:
    if "sample_mask" not in batch:
        return torch.ones(rows, dtype=torch.float32, device=device)
    return batch["sample_mask"].to(device=device, dtype=torch.float32)


def valid_token_mask(batch: Mapping[str, Any], seqlen: int | None = None) -> torch.Tensor:
    """``token_mask * sample_mask`` as float32 ``[B, S]``, position 0 and positions >= length zeroed."""
    mask = _token_mask(batch, seqlen)
    return mask * _sample_mask(batch, mask.shape[0], mask.device).unsqueeze(1)


def valid_sample_count(batch: Mapping[str, Any]) -> torch.Tensor:
    """Sum of ``sample_mask`` (the sequence-level normaliser before the DP all-reduce)."""
    rows = batch["token_mask"].shape[0]
    return _sample_mask(batch, rows, batch["token_mask"].device).sum()


def k3_kl(logprobs: torch.Tensor, reference_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(policy || reference), Schulman's k3 estimator: ``exp(r) - r - 1``, ``r = ref - logp``."""
    r = reference_logprobs - logprobs
    return torch.exp(r) - r - 1


@dataclass
class ClippedPGLoss:
    """Callable ``(logprobs [B, S], microbatch, global_valid_seqs, global_valid_toks) -> (loss, metrics)``."""

    cfg: LossConfig = field(default_factory=LossConfig)

    def required_fields(self) -> list[str]:
        """Fields a training batch must carry (the optional ones only when their term is on)."""
        fields = ["input_ids", "token_mask", "sample_mask", "advantages", "prev_logprobs"]
        if self.cfg.use_importance_sampling_correction:
            fields.append("generation_logprobs")
        if self.cfg.reference_policy_kl_penalty != 0:
            fields.append("reference_policy_logprobs")
        return fields

    def __call__(
        self,
        logprobs: torch.Tensor,
        batch: Mapping[str, Any],
        global_valid_seqs: torch.Tensor | float,
        global_valid_toks: torch.Tensor | float,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        seqlen = logprobs.shape[1]
        device = logprobs.device

        def per_token(name: str) -> torch.Tensor:
            return batch[name][:, :seqlen].to(device=device, dtype=torch.float32)

        token_mask = _token_mask(batch, seqlen).to(device)
        sample_mask = _sample_mask(batch, token_mask.shape[0], device)
        mask = token_mask * sample_mask.unsqueeze(1)
        prev = per_token("prev_logprobs")
        adv = batch["advantages"].to(device=device, dtype=torch.float32)
        adv = adv.unsqueeze(1) if adv.dim() == 1 else adv[:, :seqlen]

        ratio = torch.exp(logprobs - prev)
        clipped = ratio.clamp(1.0 - self.cfg.ratio_clip_min, 1.0 + self.cfg.ratio_clip_max)
        pg = torch.maximum(-ratio * adv, -clipped * adv)
        behaviour_weight = None
        if self.cfg.use_importance_sampling_correction:
            # pi_prox / pi_behav: the decoupled objective's importance weight
            behaviour_weight = torch.exp(prev - per_token("generation_logprobs")).detach()
            cap = self.cfg.behaviour_weight_cap
            if cap is not None:
                behaviour_weight = behaviour_weight.masked_fill(behaviour_weight > cap, 0.0)
            pg = pg * behaviour_weight
        beta = float(self.cfg.reference_policy_kl_penalty)
        kl = None
        if beta != 0:
            kl = k3_kl(logprobs, per_token("reference_policy_logprobs"))
            pg = pg + beta * kl

        if self.cfg.token_level_loss:
            loss = (pg * mask).sum() / global_valid_toks
        else:
            # an all-masked sample has mean 0 (clamp) and weight 0 (sample_mask or no tokens)
            per_sample = (pg * token_mask).sum(1) / token_mask.sum(1).clamp(min=1.0)
            loss = (per_sample * sample_mask).sum() / global_valid_seqs
        with torch.no_grad():
            was_clipped = ((ratio - clipped).abs() > 0).float()
            metrics = {
                "num_valid_tokens": float(mask.sum()),
                "num_valid_samples": float(sample_mask.sum()),
                "clip_fraction_sum": float((was_clipped * mask).sum()),
                "ratio_sum": float((ratio * mask).sum()),
                # unscaled KL summed over valid tokens; / num_valid_tokens = mean per token
                "kl_sum": float((kl * mask).sum()) if kl is not None else 0.0,
            }
            if behaviour_weight is not None:
                # / num_valid_tokens: the mean pi_prox / pi_behav (capped tokens count as 0)
                metrics["behaviour_weight_sum"] = float((behaviour_weight * mask).sum())
        return loss, metrics
