"""The GRPO loss (NeMo-RL's ClippedPG) against a direct, token-by-token computation.

The direct computation loops over samples and tokens in float64 Python
arithmetic, straight from the formula in ``policy_workers/loss.py``: clipped
policy gradient, optional importance correction, and the reference-policy KL
penalty (k3: ``exp(r) - r - 1`` with ``r = ref - logp``), normalised per token
or per sequence. Loss and gradient must agree to 1e-6.
"""

import math

import pytest
import torch

from dataplane_client.wire.errors import ConfigError
from policy_workers.config import LossConfig
from policy_workers.loss import ClippedPGLoss, k3_kl, valid_sample_count, valid_token_mask

B, S = 4, 7
LENGTHS = [7, 5, 3, 6]


def make_batch(per_token_advantages: bool) -> tuple[torch.Tensor, dict]:
    g = torch.Generator().manual_seed(3)
    logprobs = -torch.rand(B, S, generator=g, dtype=torch.float64) * 3
    batch = {
        "input_lengths": torch.tensor(LENGTHS),
        "token_mask": (torch.rand(B, S, generator=g) > 0.2).long(),
        "sample_mask": torch.tensor([1.0, 1.0, 0.0, 1.0]),
        "prev_logprobs": logprobs + 0.3 * torch.randn(B, S, generator=g, dtype=torch.float64),
        "generation_logprobs": logprobs + 0.1 * torch.randn(B, S, generator=g, dtype=torch.float64),
        "reference_policy_logprobs": logprobs
        + 0.5 * torch.randn(B, S, generator=g, dtype=torch.float64),
    }
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    batch["advantages"] = adv.unsqueeze(1).expand(B, S).clone() if per_token_advantages else adv
    return logprobs, batch


def direct(logprobs, batch, cfg: LossConfig, n_seqs: float, n_toks: float) -> float:
    """The loss, one token at a time (float64 Python arithmetic)."""
    lo, hi = 1 - cfg.ratio_clip_min, 1 + cfg.ratio_clip_max
    beta = cfg.reference_policy_kl_penalty
    total = 0.0
    for i in range(B):
        adv_row = batch["advantages"][i]
        sample_sum, sample_tokens = 0.0, 0
        for t in range(1, LENGTHS[i]):  # position 0 has no logprob
            if not batch["token_mask"][i, t]:
                continue
            lp = float(logprobs[i, t])
            prev = float(batch["prev_logprobs"][i, t])
            a = float(adv_row) if adv_row.dim() == 0 else float(adv_row[t])
            ratio = math.exp(lp - prev)
            value = max(-ratio * a, -min(max(ratio, lo), hi) * a)
            if cfg.use_importance_sampling_correction:
                value *= math.exp(prev - float(batch["generation_logprobs"][i, t]))
            r = float(batch["reference_policy_logprobs"][i, t]) - lp
            value += beta * (math.exp(r) - r - 1)
            sample_sum += value
            sample_tokens += 1
        weight = float(batch["sample_mask"][i])
        if cfg.token_level_loss:
            total += weight * sample_sum / n_toks
        elif sample_tokens:
            total += weight * (sample_sum / sample_tokens) / n_seqs
    return total


CONFIGS = {
    "token_kl": LossConfig(reference_policy_kl_penalty=0.05),
    "sequence_kl": LossConfig(reference_policy_kl_penalty=0.05, token_level_loss=False),
    "token_kl_is": LossConfig(
        reference_policy_kl_penalty=0.3,
        ratio_clip_min=0.1,
        ratio_clip_max=0.3,
        use_importance_sampling_correction=True,
    ),
    "sequence_no_kl": LossConfig(token_level_loss=False),
}


def assert_central_differences(grad, logprobs, loss_of, cells) -> None:
    """``grad`` at each (row, token) cell equals the central difference of ``loss_of``
    around ``logprobs`` (steps of 1e-6), to 1e-6."""
    for i, t in cells:
        plus, minus = logprobs.clone(), logprobs.clone()
        plus[i, t] += 1e-6
        minus[i, t] -= 1e-6
        numeric = (loss_of(plus) - loss_of(minus)) / 2e-6
        assert abs(float(grad[i, t]) - numeric) <= 1e-6, (i, t)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("per_token", [False, True], ids=["scalar_adv", "per_token_adv"])
def test_loss_equals_direct_computation(name, per_token):
    cfg = CONFIGS[name]
    logprobs, batch = make_batch(per_token)
    # normalisers as the worker passes them: counts of a larger global batch (other DP ranks)
    n_toks = float(valid_token_mask(batch).sum()) + 11
    n_seqs = float(valid_sample_count(batch)) + 2
    lp = logprobs.clone().requires_grad_(True)
    loss, metrics = ClippedPGLoss(cfg)(lp, batch, n_seqs, n_toks)
    assert abs(float(loss.detach()) - direct(logprobs, batch, cfg, n_seqs, n_toks)) <= 1e-6
    # gradient: central differences of the direct computation, a few tokens
    loss.backward()
    assert_central_differences(
        lp.grad,
        logprobs,
        lambda x: direct(x, batch, cfg, n_seqs, n_toks),
        [(0, 3), (1, 4), (3, 5), (2, 1)],
    )
    assert metrics["num_valid_tokens"] == float(valid_token_mask(batch).sum())


def test_scalar_advantages_broadcast_over_tokens():
    logprobs, scalar = make_batch(per_token_advantages=False)
    _, per_token = make_batch(per_token_advantages=True)
    loss_fn = ClippedPGLoss(CONFIGS["token_kl"])
    a, _ = loss_fn(logprobs, scalar, 3.0, 20.0)
    b, _ = loss_fn(logprobs, per_token, 3.0, 20.0)
    assert torch.equal(a, b)


def test_kl_term_k3_and_its_switch():
    lp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
    ref = torch.tensor([-1.0, -1.5, -3.0], dtype=torch.float64)
    want = [math.exp(r - p) - (r - p) - 1 for p, r in zip(lp.tolist(), ref.tolist())]
    assert torch.allclose(k3_kl(lp, ref), torch.tensor(want, dtype=torch.float64), atol=1e-12)
    assert float(k3_kl(lp, ref)[0]) == 0.0  # same logprob: no penalty
    assert (k3_kl(lp, ref) >= 0).all()

    on = ClippedPGLoss(LossConfig(reference_policy_kl_penalty=0.1))
    off = ClippedPGLoss(LossConfig())
    assert "reference_policy_logprobs" in on.required_fields()
    assert "reference_policy_logprobs" not in off.required_fields()
    logprobs, batch = make_batch(per_token_advantages=False)
    del batch["reference_policy_logprobs"]
    _, metrics = off(logprobs, batch, 3.0, 20.0)  # off: the field is never read
    assert metrics["kl_sum"] == 0.0
    with pytest.raises(KeyError, match="reference_policy_logprobs"):
        on(logprobs, batch, 3.0, 20.0)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("reference_policy_kl_penalty", -0.1),
        ("reference_policy_kl_penalty", float("nan")),
        ("reference_policy_kl_penalty", "0.1"),
        ("ratio_clip_min", -0.2),
        ("ratio_clip_max", True),
    ],
)
def test_bad_loss_config_names_the_key(field, value):
    with pytest.raises(ConfigError, match=f"loss.{field}"):
        LossConfig(**{field: value})


# ---- the decoupled PPO objective (AReaL, arXiv 2505.24298) for off-policy samples ----------


def decoupled_ppo_direct(logprobs, batch, eps: float, cap: float | None, n_toks: float) -> float:
    """AReaL's eq. 5 as written, token by token in probabilities (float64):
    -(pi_prox / pi_behav) * min(r A, clip(r, 1 - eps, 1 + eps) A), r = pi_theta / pi_prox,
    a token with pi_prox / pi_behav over ``cap`` left out; summed, over ``n_toks``."""
    total = 0.0
    for i in range(B):
        for t in range(1, LENGTHS[i]):
            if not batch["token_mask"][i, t] or not batch["sample_mask"][i]:
                continue
            pi_theta = math.exp(float(logprobs[i, t]))
            pi_prox = math.exp(float(batch["prev_logprobs"][i, t]))
            pi_behav = math.exp(float(batch["generation_logprobs"][i, t]))
            a = float(batch["advantages"][i])
            r = pi_theta / pi_prox
            weight = pi_prox / pi_behav
            if cap is not None and weight > cap:
                weight = 0.0
            total -= weight * min(r * a, min(max(r, 1 - eps), 1 + eps) * a)
    return total / n_toks


def stale_batch() -> tuple[torch.Tensor, dict]:
    """A batch whose behaviour policy is far from the proximal one (several versions old)."""
    logprobs, batch = make_batch(per_token_advantages=False)
    g = torch.Generator().manual_seed(11)
    batch["generation_logprobs"] = batch["prev_logprobs"] + 0.8 * torch.randn(
        B, S, generator=g, dtype=torch.float64
    )
    return logprobs, batch


@pytest.mark.parametrize("cap", [None, 1.5], ids=["no_cap", "cap"])
def test_decoupled_ppo_equals_areal_objective_for_stale_samples(cap):
    logprobs, batch = stale_batch()
    cfg = LossConfig(use_importance_sampling_correction=True, behaviour_weight_cap=cap)
    n_toks = float(valid_token_mask(batch).sum()) + 5
    weights = torch.exp(batch["prev_logprobs"] - batch["generation_logprobs"])
    valid = valid_token_mask(batch) > 0
    assert (weights[valid] > 1.5).any()  # really off-policy, both ways
    assert (weights[valid] < 0.5).any()
    lp = logprobs.clone().requires_grad_(True)
    loss, metrics = ClippedPGLoss(cfg)(lp, batch, 1.0, n_toks)
    want = decoupled_ppo_direct(logprobs, batch, 0.2, cap, n_toks)
    assert abs(float(loss.detach()) - want) <= 1e-6  # the loss computes in float32
    kept = weights if cap is None else weights.masked_fill(weights > cap, 0.0)
    assert metrics["behaviour_weight_sum"] == pytest.approx(float((kept * valid).sum()), rel=1e-6)
    loss.backward()
    assert_central_differences(
        lp.grad,
        logprobs,
        lambda x: decoupled_ppo_direct(x, batch, 0.2, cap, n_toks),
        [(0, 3), (1, 4), (3, 5), (0, 6)],
    )


def test_decoupled_ppo_is_standard_ppo_clip_when_behaviour_is_proximal():
    logprobs, batch = make_batch(per_token_advantages=False)
    batch["generation_logprobs"] = batch["prev_logprobs"].clone()
    n_toks = float(valid_token_mask(batch).sum())
    decoupled, _ = ClippedPGLoss(LossConfig(use_importance_sampling_correction=True))(
        logprobs, batch, 1.0, n_toks
    )
    ppo, _ = ClippedPGLoss(LossConfig())(logprobs, batch, 1.0, n_toks)
    # standard PPO-clip, written out: -min(r A, clip(r) A) with r = pi_theta / pi_old
    ppo_direct = 0.0
    for i in range(B):
        for t in range(1, LENGTHS[i]):
            if batch["token_mask"][i, t] and batch["sample_mask"][i]:
                r = math.exp(float(logprobs[i, t] - batch["prev_logprobs"][i, t]))
                a = float(batch["advantages"][i])
                ppo_direct -= min(r * a, min(max(r, 0.8), 1.2) * a)
    assert float(decoupled) == pytest.approx(ppo_direct / n_toks, abs=1e-6)
    assert torch.equal(decoupled, ppo)  # a weight of exactly 1


@pytest.mark.parametrize("cap", [0, -1.0, True, "2"])
def test_bad_behaviour_weight_cap_is_a_config_error(cap):
    with pytest.raises(ConfigError, match="loss.behaviour_weight_cap"):
        LossConfig(use_importance_sampling_correction=True, behaviour_weight_cap=cap)
