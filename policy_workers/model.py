"""A transformers causal LM whose output projection is split over the TP group by vocabulary.

The body (embeddings + decoder layers) is replicated on every TP rank; each rank
holds rows ``[vocab_start, vocab_end)`` of the output projection and computes
only those logits. Log-softmax over the whole vocabulary is assembled with three
small all-reduces over ``[batch, seq]`` tensors (MAX for stability, SUM of exp,
SUM of the masked target logit), so the full ``[batch, seq, vocab]`` logits never
exist anywhere. Both collectives have hand-written backward passes:

- ``_CopyToTensorParallel``: identity forward, all-reduce SUM backward. The
  hidden states entering the head are replicated, but each rank only sees the
  gradient through its own vocabulary rows; summing restores the full gradient,
  so the replicated body gets identical gradients on every TP rank.
- ``_VocabParallelTargetLogprob``: forward as above; backward is the closed form
  ``d logp(t) / d logit_v = 1[v == t] - softmax_v`` on the local rows. (The loss is
  replicated on every TP rank, so the all-reduces inside need no backward
  collective of their own.)

Logprob convention: the logprob of token ``i`` sits at position ``i``; position 0
is 0; positions at or beyond a sequence's length are 0.

Sequence packing runs each bin as ONE row: the bin's sequences are concatenated,
``position_ids`` restart at 0 for every sequence, and an additive block-diagonal
causal 4-D mask keeps sequences from seeing each other (both the "sdpa" and
"eager" attention of transformers take such a mask as-is). This is real packing
(no pad tokens are computed) and matches the padded reference to float32
round-off.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from policy_workers.config import ModelConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(_DTYPES)}") from None


def default_device() -> torch.device:
    """CUDA when this process sees a GPU, else CPU."""
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


# ModelConfig fields a transformers LlamaConfig / Qwen2Config takes under the same name.
_HF_CONFIG_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "tie_word_embeddings",
)


def build_hf_model(cfg: ModelConfig) -> PreTrainedModel:
    """A transformers ``AutoModelForCausalLM``: from ``cfg.model_path`` or tiny from a config."""
    from transformers import AutoModelForCausalLM

    dtype = torch_dtype(cfg.dtype)
    if cfg.model_path:
        return AutoModelForCausalLM.from_pretrained(
            cfg.model_path, dtype=dtype, attn_implementation=cfg.attn_implementation
        )
    config_cls: type[PretrainedConfig]
    if cfg.model_type == "llama":
        from transformers import LlamaConfig

        config_cls = LlamaConfig
    elif cfg.model_type == "qwen2":
        from transformers import Qwen2Config

        config_cls = Qwen2Config
    else:
        raise ValueError(f"unknown tiny model_type {cfg.model_type!r}; use 'llama' or 'qwen2'")
    shape = {name: getattr(cfg, name) for name in _HF_CONFIG_FIELDS}
    hf_cfg = config_cls(**shape, attention_dropout=0.0)
    hf_cfg._attn_implementation = cfg.attn_implementation
    # Seed a private generator state: identical weights in every process, and the
    # caller's global RNG stream is left as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    return model.to(dtype)


def vocab_shard_range(vocab_size: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """``[start, end)`` of the vocabulary rows owned by ``tp_rank`` (contiguous, sizes differ by <= 1)."""
    base, rem = divmod(vocab_size, tp_size)
    start = tp_rank * base + min(tp_rank, rem)
    return start, start + base + (1 if tp_rank < rem else 0)


# ---- autograd-correct collectives ---------------------------------------------------------


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; all-reduce SUM of the gradient over the TP group backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


class _VocabParallelTargetLogprob(torch.autograd.Function):
    """``log_softmax(full_logits)[target]`` from this rank's vocabulary slice of the logits."""

    @staticmethod
    def forward(ctx, logits_local: torch.Tensor, target: torch.Tensor, vocab_start: int, group):
        logits = logits_local if logits_local.dtype == torch.float64 else logits_local.float()
        n_local = logits.shape[-1]
        row_max = logits.max(dim=-1).values
        if group is not None:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - row_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        if group is not None:
            dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=group)
        local_target = target - vocab_start
        owned = (local_target >= 0) & (local_target < n_local)
        idx = local_target.clamp(0, n_local - 1)
        target_logit = shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1)
        target_logit = torch.where(owned, target_logit, torch.zeros_like(target_logit))
        if group is not None:
            dist.all_reduce(target_logit, op=dist.ReduceOp.SUM, group=group)
        ctx.save_for_backward(exp, sum_exp, idx, owned)
        ctx.in_dtype = logits_local.dtype
        return target_logit - sum_exp.log()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        exp, sum_exp, idx, owned = ctx.saved_tensors
        grad = grad.to(exp.dtype)
        grad_logits = exp / sum_exp.unsqueeze(-1) * (-grad.unsqueeze(-1))
        grad_logits.scatter_add_(-1, idx.unsqueeze(-1), (grad * owned).unsqueeze(-1))
        return grad_logits.to(ctx.in_dtype), None, None, None


def vocab_parallel_target_logprobs(
    logits_local: torch.Tensor, target: torch.Tensor, *, vocab_start: int, group=None
) -> torch.Tensor:
    """Logprob of ``target`` under the softmax over the vocabulary split across ``group``.

    ``logits_local``: ``[..., V_local]`` (this rank's columns ``[vocab_start, vocab_start+V_local)``);
    ``target``: ``[...]`` int64 token ids in the full vocabulary. ``group=None``: unsharded.
    """
    return _VocabParallelTargetLogprob.apply(logits_local, target, vocab_start, group)


# ---- the model ----------------------------------------------------------------------------


def _mask_beyond_lengths(logprobs: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(logprobs.shape[1], device=logprobs.device)
    keep = positions.unsqueeze(0) < lengths.to(logprobs.device).unsqueeze(1)
    return torch.where(keep, logprobs, torch.zeros_like(logprobs))


class VocabParallelCausalLM(nn.Module):
    """Replicated transformer body + this TP rank's vocabulary rows of the output projection."""

    def __init__(
        self, hf_model: PreTrainedModel, *, tp_group=None, tp_rank: int = 0, tp_size: int = 1
    ):
        super().__init__()
        out_emb = hf_model.get_output_embeddings()
        if out_emb is None or getattr(out_emb, "bias", None) is not None:
            raise ValueError("expected an output projection without bias (lm_head)")
        from transformers import PreTrainedModel

        body = hf_model.base_model
        if not isinstance(body, PreTrainedModel):
            raise ValueError(f"expected a transformers model body, got {type(body).__name__}")
        self.body: PreTrainedModel = body
        self.vocab_size = int(out_emb.weight.shape[0])
        self.vocab_start, self.vocab_end = vocab_shard_range(self.vocab_size, tp_size, tp_rank)
        self.tp_group = tp_group if tp_size > 1 else None
        in_emb = hf_model.get_input_embeddings()
        self.tied = out_emb.weight is in_emb.weight
        if self.tied:
            # The head reads rows of the (replicated) input embedding; see _head_weight.
            self.head_weight = None
        else:
            self.head_weight = nn.Parameter(
                out_emb.weight.detach()[self.vocab_start : self.vocab_end].clone()
            )

    def _head_weight(self) -> torch.Tensor:
        if self.head_weight is not None:  # untied: this rank's own rows
            return self.head_weight
        weight = self.body.get_input_embeddings().weight
        assert isinstance(weight, torch.Tensor)  # an embedding's weight is a Parameter
        if self.tp_group is not None:
            # Each rank's head touches only its rows; summing the gradient over TP gives
            # the full tied gradient (input path, identical on all ranks, + every head slice).
            weight = _CopyToTensorParallel.apply(weight, self.tp_group)
        return weight[self.vocab_start : self.vocab_end]

    def _target_logprobs(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.tp_group is not None:
            hidden = _CopyToTensorParallel.apply(hidden, self.tp_group)
        logits_local = F.linear(hidden.float(), self._head_weight().float())
        return vocab_parallel_target_logprobs(
            logits_local, target, vocab_start=self.vocab_start, group=self.tp_group
        )

    def forward_padded(self, input_ids: torch.Tensor, input_lengths: torch.Tensor) -> torch.Tensor:
        """Right-padded ``[B, S]`` ids -> ``[B, S]`` float32 logprobs (convention above)."""
        input_ids = input_ids.long()
        batch, seqlen = input_ids.shape
        out = torch.zeros(batch, seqlen, dtype=torch.float32, device=input_ids.device)
        if seqlen < 2 or batch == 0:
            return out
        positions = torch.arange(seqlen, device=input_ids.device)
        attention_mask = (
            positions.unsqueeze(0) < input_lengths.to(input_ids.device).unsqueeze(1)
        ).long()
        hidden = self.body(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False
        ).last_hidden_state
        lp = self._target_logprobs(hidden[:, :-1], input_ids[:, 1:])
        out = torch.cat([out[:, :1], lp], dim=1)
        return _mask_beyond_lengths(out, input_lengths)

    def forward_packed(self, input_ids: torch.Tensor, input_lengths: torch.Tensor) -> torch.Tensor:
        """Same contract as :meth:`forward_padded`, computed as one packed row."""
        input_ids = input_ids.long()
        device = input_ids.device
        batch, seqlen = input_ids.shape
        lengths = input_lengths.to(device=device, dtype=torch.long).clamp(max=seqlen)
        total = int(lengths.sum())
        if total == 0 or batch == 0:
            return torch.zeros(batch, seqlen, dtype=torch.float32, device=device)
        seq_id = torch.repeat_interleave(torch.arange(batch, device=device), lengths)
        starts = torch.cumsum(lengths, 0) - lengths
        pos = torch.arange(total, device=device) - starts[seq_id]
        packed = input_ids[seq_id, pos].unsqueeze(0)  # [1, T]
        causal = pos.unsqueeze(1) >= pos.unsqueeze(0)
        allowed = (seq_id.unsqueeze(1) == seq_id.unsqueeze(0)) & causal
        dtype = next(self.body.parameters()).dtype
        mask = torch.zeros(total, total, dtype=dtype, device=device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        hidden = self.body(
            input_ids=packed,
            attention_mask=mask[None, None],
            position_ids=pos.unsqueeze(0),
            use_cache=False,
        ).last_hidden_state[0]
        lp = self._target_logprobs(hidden[:-1], packed[0, 1:])  # [T-1]
        lp = torch.cat([torch.zeros(1, dtype=lp.dtype, device=device), lp])
        lp = torch.where(pos == 0, torch.zeros_like(lp), lp)  # first token of every sequence
        out = torch.zeros(batch, seqlen, dtype=torch.float32, device=device)
        return out.index_put((seq_id, pos), lp)

    def full_head_weight(self) -> torch.Tensor:
        """The whole ``[V, H]`` output projection (all-gathered over TP); for tests and export."""
        local = self._head_weight().detach().float().contiguous()
        if self.tp_group is None:
            return local.clone()
        world = dist.get_world_size(self.tp_group)
        sizes = [torch.zeros(1, dtype=torch.long, device=local.device) for _ in range(world)]
        dist.all_gather(
            sizes, torch.tensor([local.shape[0]], device=local.device), group=self.tp_group
        )
        max_rows = int(max(s.item() for s in sizes))
        padded = torch.zeros(max_rows, local.shape[1], dtype=local.dtype, device=local.device)
        padded[: local.shape[0]] = local
        gathered = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(gathered, padded, group=self.tp_group)
        return torch.cat([g[: int(s.item())] for g, s in zip(gathered, sizes)])


def reference_logprobs(
    hf_model: nn.Module, input_ids: torch.Tensor, input_lengths: torch.Tensor
) -> torch.Tensor:
    """Unsharded float32 reference: plain ``log_softmax`` over the full logits (tests, checks)."""
    input_ids = input_ids.long()
    seqlen = input_ids.shape[1]
    positions = torch.arange(seqlen, device=input_ids.device)
    mask = (positions.unsqueeze(0) < input_lengths.unsqueeze(1)).long()
    logits = hf_model(input_ids=input_ids, attention_mask=mask, use_cache=False).logits.float()
    lp = (
        torch.log_softmax(logits[:, :-1], dim=-1)
        .gather(-1, input_ids[:, 1:].unsqueeze(-1))
        .squeeze(-1)
    )
    out = torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)
    return _mask_beyond_lengths(out, input_lengths)
