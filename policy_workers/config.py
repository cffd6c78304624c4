"""Typed configuration of a policy (model, parallelism, batching, optimizer, loss).

Every default is readable here; nothing else invents one. A config is a plain
picklable dataclass: the driver builds it once and every worker receives the
same object.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from dataplane_client.batching.preshard import DynamicBatchingArgs, SequencePackingArgs
from dataplane_client.wire.config import DataPlaneConfig
from dataplane_client.wire.errors import ConfigError


@dataclass
class ModelConfig:
    """Which causal LM to run.

    ``model_path`` (a local directory with a transformers checkpoint) wins; without
    it a tiny model of ``model_type`` is built from the sizes below with ``seed``,
    so every process that builds it gets bit-identical initial weights.
    """

    model_path: str | None = None
    model_type: Literal["llama", "qwen2"] = "llama"
    vocab_size: int = 128
    hidden_size: int = 32
    intermediate_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = False
    seed: int = 1234
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # "sdpa" or "eager"; both accept the additive 4-D mask used for sequence packing.
    attn_implementation: str = "sdpa"


@dataclass
class _MicrobatchTokens:
    """What dynamic batching and sequence packing share: a token budget per microbatch."""

    enabled: bool = False
    train_mb_tokens: int = 256
    logprob_mb_tokens: int = 256

    def mb_tokens(self, kind: Literal["train", "logprob"]) -> int:
        """The token budget of one microbatch of a train or logprob pass."""
        return self.train_mb_tokens if kind == "train" else self.logprob_mb_tokens


@dataclass
class DynamicBatchingConfig(_MicrobatchTokens):
    """Microbatches of variable size holding at most ``*_mb_tokens`` padded tokens."""

    sequence_length_round: int = 8


@dataclass
class SequencePackingConfig(_MicrobatchTokens):
    """Sequences packed into bins of at most ``*_mb_tokens`` tokens (one row per bin)."""

    algorithm: str = "modified_first_fit_decreasing"


@dataclass
class LossConfig:
    """GRPO clipped policy-gradient loss (see ``policy_workers.loss``)."""

    ratio_clip_min: float = 0.2  # eps_low: ratio is clipped to [1 - eps_low, 1 + eps_high]
    ratio_clip_max: float = 0.2  # eps_high
    # Multiply each token's loss by exp(prev_logprobs - generation_logprobs) (detached):
    # the decoupled PPO objective (AReaL) for samples from an older policy; on-policy it
    # corrects for the generation engine's numerics differing from the trainer's.
    use_importance_sampling_correction: bool = False
    # Tokens whose weight above exceeds this are left out of the policy-gradient term
    # (AReaL's behav_imp_weight_cap); None = no cap.
    behaviour_weight_cap: float | None = None
    # beta of the reference-policy KL term (k3 estimator); 0 = off, no reference logprobs read.
    reference_policy_kl_penalty: float = 0.0
    # True: every valid token weighs the same; False: each sample's tokens are averaged
    # first, then samples weigh the same (NeMo-RL's token_level_loss).
    token_level_loss: bool = True

    def __post_init__(self) -> None:
        beta = self.reference_policy_kl_penalty
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not beta >= 0:
            raise ConfigError(
                f"loss.reference_policy_kl_penalty must be a number >= 0, got {beta!r}"
            )
        cap = self.behaviour_weight_cap
        if cap is not None and (
            isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0
        ):
            raise ConfigError(
                f"loss.behaviour_weight_cap must be a number > 0 or None, got {cap!r}"
            )
        for name in ("ratio_clip_min", "ratio_clip_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ConfigError(f"loss.{name} must be a number >= 0, got {value!r}")


@dataclass
class OptimizerConfig:
    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    momentum: float = 0.0  # sgd only
    max_grad_norm: float | None = 1.0  # None = no clipping


@dataclass
class PolicyConfig:
    """A policy: ``pp * dp * cp * tp`` workers running one model."""

    dp: int = 1
    tp: int = 1
    pp: int = 1  # pipeline stages are replicas here (no pipeline schedule); see README
    cp: int = 1  # context-parallel ranks are replicas here (no sequence split); see README
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    dynamic_batching: DynamicBatchingConfig = field(default_factory=DynamicBatchingConfig)
    sequence_packing: SequencePackingConfig = field(default_factory=SequencePackingConfig)
    train_global_batch_size: int = 8
    train_micro_batch_size: int = 2
    logprob_batch_size: int = 4
    pad_token_id: int = 0
    # Round the global forward pad length up to this multiple (1 = exact max length).
    forward_pad_multiple: int = 1
    # Worker placement.
    num_cpus_per_worker: float = 1.0
    num_gpus_per_worker: float | None = None  # None = 1 when the Ray cluster has GPUs, else 0
    torch_threads: int = 1  # intra-op threads per worker process
    collective_timeout_s: float = 300.0
    # The data-plane service workers connect to; None = data-plane entry points unavailable.
    data_plane: DataPlaneConfig | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "cp"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dynamic_batching.enabled and self.sequence_packing.enabled:
            raise ValueError("dynamic batching and sequence packing are mutually exclusive")
        if self.forward_pad_multiple < 1:
            raise ValueError(f"forward_pad_multiple must be >= 1, got {self.forward_pad_multiple}")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    # ---- batching arguments, shared by driver (planning) and workers (local re-derivation) ----
    def dynamic_batching_args(
        self, kind: Literal["train", "logprob"]
    ) -> DynamicBatchingArgs | None:
        """``DynamicBatchingArgs`` for a train or logprob pass; None when disabled."""
        db = self.dynamic_batching
        if not db.enabled:
            return None
        return {
            "max_tokens_per_microbatch": db.mb_tokens(kind),
            "sequence_length_round": db.sequence_length_round,
            "input_key": "input_ids",
            "input_lengths_key": "input_lengths",
        }

    def sequence_packing_args(
        self, kind: Literal["train", "logprob"]
    ) -> SequencePackingArgs | None:
        """``SequencePackingArgs`` for a train or logprob pass; None when disabled.

        Pad multiple 1: the vocab-parallel head never splits the sequence dimension.
        """
        sp = self.sequence_packing
        if not sp.enabled:
            return None
        return {
            "max_tokens_per_microbatch": sp.mb_tokens(kind),
            "input_key": "input_ids",
            "input_lengths_key": "input_lengths",
            "algorithm": sp.algorithm,
            "sequence_length_pad_multiple": 1,
        }
