"""PolicyWorker: the body of one policy actor (one rank of PP x DP x CP x TP).

Per-rank methods take a BatchedDataDict (this DP rank's slice, padded) and are
shared by both paths: the classic one (the driver ships tensors) and the
data-plane one (``TQWorkerMixin.*_presharded`` fetch the slice, then call the
same methods).

- ``get_logprobs`` / ``get_reference_policy_logprobs``: no-grad forward of the
  policy / of a frozen copy of the initial weights, microbatched (plain,
  dynamic batching or sequence packing).
- ``train``: for each global batch: count valid tokens and samples over DP,
  forward + backward every microbatch (loss normalised by those global counts), average
  gradients over DP (the local loss is scaled by the DP size first, so the
  average is the gradient of the global loss), clip by the global grad norm,
  one optimizer step. Weights stay identical across DP ranks.

TP: the vocab-parallel head (``policy_workers.model``) uses the TP group.
CP and PP ranks are replicas of their TP rank (no sequence split, no pipeline
schedule); they compute the same thing and never write back.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import math
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from dataplane_client.batching.batched_data_dict import BatchedDataDict
from policy_workers import checkpoint as ckpt
from policy_workers.config import DynamicBatchingConfig, PolicyConfig, SequencePackingConfig
from policy_workers.errors import CheckpointMismatch
from policy_workers.loss import ClippedPGLoss, valid_sample_count, valid_token_mask
from policy_workers.model import VocabParallelCausalLM, build_hf_model, default_device
from policy_workers.sharding import (
    CONTEXT_PARALLEL,
    DATA_PARALLEL,
    PIPELINE_PARALLEL,
    TENSOR_PARALLEL,
    NamedSharding,
)
from policy_workers.tq_mixin import TQWorkerMixin
from policy_workers.worker_group import DistributedWorker


class PolicyWorker(TQWorkerMixin, DistributedWorker):
    def __init__(self, *, rank: int, sharding: NamedSharding, cfg: PolicyConfig):
        DistributedWorker.__init__(
            self, rank=rank, sharding=sharding, torch_threads=cfg.torch_threads
        )
        self.cfg = cfg
        self.device = torch.device("cpu")
        self.model: VocabParallelCausalLM | None = None
        self.reference_model: VocabParallelCausalLM | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        # Checkpoint parts read and checked, applied only once every rank has its own.
        self._staged_checkpoint: dict[str, Any] = {}

    # ---- setup -------------------------------------------------------------------
    def setup(self) -> None:
        """Build the model (after ``init_distributed``: the head needs the TP group)."""
        self.device = default_device()
        hf_model = build_hf_model(self.cfg.model)
        self.model = VocabParallelCausalLM(
            hf_model,
            tp_group=self.tp_group,
            tp_rank=self.coords[TENSOR_PARALLEL],
            tp_size=self.sharding.get_axis_size(TENSOR_PARALLEL),
        ).to(self.device)
        # Frozen copy of the initial weights; process groups are shared, not copied.
        memo = {id(self.tp_group): self.tp_group} if self.tp_group is not None else {}
        self.reference_model = copy.deepcopy(self.model, memo)
        self.reference_model.requires_grad_(False).eval()
        opt = self.cfg.optimizer
        params = [p for p in self.model.parameters() if p.requires_grad]
        if opt.name == "adamw":
            beta1, beta2 = opt.betas  # a list when the config came from YAML / JSON
            self.optimizer = torch.optim.AdamW(
                params,
                lr=opt.lr,
                betas=(beta1, beta2),
                eps=opt.eps,
                weight_decay=opt.weight_decay,
            )
        elif opt.name == "sgd":
            self.optimizer = torch.optim.SGD(
                params, lr=opt.lr, momentum=opt.momentum, weight_decay=opt.weight_decay
            )
        else:
            raise ValueError(f"unknown optimizer {opt.name!r}; use 'adamw' or 'sgd'")

    # ---- built state (setup() must have run) -------------------------------------------
    @property
    def _policy(self) -> VocabParallelCausalLM:
        if self.model is None:
            raise RuntimeError("PolicyWorker.setup() has not run: no model yet")
        return self.model

    @property
    def _reference(self) -> VocabParallelCausalLM:
        if self.reference_model is None:
            raise RuntimeError("PolicyWorker.setup() has not run: no reference model yet")
        return self.reference_model

    @property
    def _optim(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise RuntimeError("PolicyWorker.setup() has not run: no optimizer yet")
        return self.optimizer

    # ---- TQWorkerMixin topology ---------------------------------------------------------
    def _local_coords(self) -> dict[str, int]:
        return dict(self.coords)

    def _get_replica_group(self) -> Any:
        return self.replica_group

    def _fetch_device(self) -> torch.device | None:
        # A GPU worker reads its batch straight to its GPU; a CPU one keeps the zero-copy
        # host mapping (a copy "to" the CPU would only cost).
        return None if self.device.type == "cpu" else self.device

    def _replica_leader_rank(self) -> int:
        return self.sharding.get_rank(
            **{PIPELINE_PARALLEL: 0, CONTEXT_PARALLEL: 0, TENSOR_PARALLEL: 0},
            **{DATA_PARALLEL: self.coords[DATA_PARALLEL]},
        )

    def _dp_world_size(self) -> int:
        return self.sharding.get_axis_size(DATA_PARALLEL)

    # ---- microbatching --------------------------------------------------------------------
    def _global_batches(
        self, data: BatchedDataDict, local_gbs: int | None
    ) -> Iterator[BatchedDataDict]:
        """The global-batch parts of this rank's slice (one per optimizer step / planning chunk)."""
        if data.elem_counts_per_gb is not None:
            for i in range(len(data.elem_counts_per_gb)):
                yield data.get_batch(i)
        elif data.micro_batch_indices is not None:
            n = len(data.micro_batch_indices)
            for i in range(n):
                yield data.get_batch(i, data.size // n)
        elif local_gbs is None or local_gbs >= data.size:
            yield data
        else:
            for start in range(0, data.size, local_gbs):
                yield data.slice(start, min(data.size, start + local_gbs))

    def _microbatches(
        self, batch: BatchedDataDict, mbs: int
    ) -> Iterator[tuple[BatchedDataDict, bool]]:
        """``(microbatch, packed)`` pairs covering ``batch``'s rows in order."""
        if batch.micro_batch_indices is not None and self.cfg.sequence_packing.enabled:
            for mb in batch.make_microbatch_iterator_for_packable_sequences():
                yield mb, True
        elif batch.micro_batch_indices is not None and self.cfg.dynamic_batching.enabled:
            for mb in batch.make_microbatch_iterator_with_dynamic_shapes():
                yield mb, False
        else:
            mbs = max(1, int(mbs))
            for start in range(0, batch.size, mbs):
                yield batch.slice(start, min(batch.size, start + mbs)), False

    def _forward(
        self, model: VocabParallelCausalLM, mb: BatchedDataDict, packed: bool
    ) -> torch.Tensor:
        ids = mb["input_ids"].to(self.device)
        lengths = mb["input_lengths"].to(self.device)
        return model.forward_packed(ids, lengths) if packed else model.forward_padded(ids, lengths)

    # ---- logprobs ---------------------------------------------------------------------------
    def _logprobs(
        self, model: VocabParallelCausalLM, data: BatchedDataDict, micro_batch_size: int | None
    ) -> BatchedDataDict:
        mbs = micro_batch_size or self.cfg.logprob_batch_size
        width = data["input_ids"].shape[1]
        parts = []
        model.eval()
        with torch.no_grad():
            for gb in self._global_batches(data, None):
                for mb, packed in self._microbatches(gb, mbs):
                    lp = self._forward(model, mb, packed)
                    parts.append(torch.nn.functional.pad(lp, (0, width - lp.shape[1])))
        logprobs = torch.cat(parts) if parts else torch.zeros(0, width)
        return BatchedDataDict({"logprobs": logprobs.cpu()})

    def get_logprobs(
        self, data: BatchedDataDict, micro_batch_size: int | None = None
    ) -> BatchedDataDict:
        """``{"logprobs": [B, S]}``: logprob of token i at position i, 0 at 0 and past the length."""
        return self._logprobs(self._policy, data, micro_batch_size)

    def get_reference_policy_logprobs(
        self, data: BatchedDataDict, micro_batch_size: int | None = None
    ) -> BatchedDataDict:
        """Same as :meth:`get_logprobs` under the frozen initial weights (key ``"logprobs"``)."""
        return self._logprobs(self._reference, data, micro_batch_size)

    # ---- training -------------------------------------------------------------------------------
    def _all_reduce(self, value: torch.Tensor, group: Any, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if group is not None:
            dist.all_reduce(value, op=op, group=group)
        return value

    def _average_grads_over_dp(self) -> None:
        if self.dp_group is None:
            return
        params = [p for p in self._policy.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.dp_group)
        flat /= self._dp_world_size()
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n

    def _grad_norm(self) -> torch.Tensor:
        """L2 norm of the full model's gradient: replicated params once, head shards summed over TP."""
        head = self._policy.head_weight
        replicated = torch.zeros((), dtype=torch.float64, device=self.device)
        sharded = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self._policy.parameters():
            if p.grad is None:
                continue
            sq = p.grad.detach().double().pow(2).sum()
            if head is not None and p is head:
                sharded += sq
            else:
                replicated += sq
        self._all_reduce(sharded, self._policy.tp_group)
        return (replicated + sharded).sqrt()

    def train(
        self,
        data: BatchedDataDict,
        loss_fn: Any = None,
        eval_mode: bool = False,
        gbs: int | None = None,
        mbs: int | None = None,
    ) -> dict[str, Any]:
        """One optimizer step per global batch of ``gbs`` samples (summed over DP ranks)."""
        loss_fn = loss_fn if loss_fn is not None else ClippedPGLoss(self.cfg.loss)
        gbs = gbs or self.cfg.train_global_batch_size
        mbs = mbs or self.cfg.train_micro_batch_size
        dp = self._dp_world_size()
        local_gbs = max(1, gbs // dp)
        self._policy.train(not eval_mode)
        losses: list[float] = []
        grad_norms: list[float] = []
        mb_metrics: dict[str, list[float]] = defaultdict(list)
        for gb in self._global_batches(data, local_gbs):
            # The loss normalises by the whole global batch: valid tokens and samples over DP.
            counts = torch.stack([valid_token_mask(gb).sum(), valid_sample_count(gb)])
            counts = self._all_reduce(counts.to(self.device), self.dp_group).clamp(min=1.0)
            global_tokens, global_seqs = counts[0], counts[1]
            if not eval_mode:
                self._optim.zero_grad(set_to_none=True)
            gb_loss = torch.zeros((), dtype=torch.float32, device=self.device)
            with torch.set_grad_enabled(not eval_mode):
                for mb, packed in self._microbatches(gb, mbs):
                    logprobs = self._forward(self._policy, mb, packed)
                    loss, metrics = loss_fn(logprobs, mb, global_seqs, global_tokens)
                    if not eval_mode:
                        # x dp: the DP all-reduce below averages, the global loss is a sum
                        (loss * dp).backward()
                    gb_loss += loss.detach()
                    for k, v in metrics.items():
                        mb_metrics[k].append(float(v))
            losses.append(float(self._all_reduce(gb_loss, self.dp_group)))
            if eval_mode:
                continue
            self._average_grads_over_dp()
            norm = self._grad_norm()
            max_norm = self.cfg.optimizer.max_grad_norm
            if max_norm is not None:
                coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
                for p in self._policy.parameters():
                    if p.grad is not None:
                        p.grad.mul_(coef.to(p.grad.dtype))
            self._optim.step()
            grad_norms.append(float(norm))
        return {
            "loss": sum(losses) / max(1, len(losses)),
            "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else math.nan,
            "losses": losses,
            "grad_norms": grad_norms,
            "num_steps": len(grad_norms),
            "all_mb_metrics": dict(mb_metrics),
        }

    # ---- reconfiguration -------------------------------------------------------------------------
    def update_batching_config(
        self, dynamic_batching: DynamicBatchingConfig, sequence_packing: SequencePackingConfig
    ) -> None:
        """Switch microbatching mode (the driver does the same on its copy of the config)."""
        self.cfg = dataclasses.replace(
            self.cfg, dynamic_batching=dynamic_batching, sequence_packing=sequence_packing
        )

    def save_training_state(self) -> None:
        """Keep an in-process copy of the weights and optimizer state (see restore_training_state)."""
        self._saved_state = (
            {k: v.detach().clone() for k, v in self._policy.state_dict().items()},
            copy.deepcopy(self._optim.state_dict()),
        )

    def restore_training_state(self) -> None:
        """Return to the state of the last save_training_state (e.g. to replay a step)."""
        weights, opt_state = self._saved_state
        self._policy.load_state_dict(weights)
        self._optim.load_state_dict(copy.deepcopy(opt_state))

    # ---- checkpoints (driven by TQPolicy.save_checkpoint / load_checkpoint) -------------------------
    def save_checkpoint_shard(self, tmp: str, part: str) -> dict[str, Any]:
        """Write this rank's weights, or its optimizer and RNG states, into ``tmp``."""
        if part == ckpt.WEIGHTS:
            state: Any = {k: v.detach().cpu() for k, v in self._policy.state_dict().items()}
        else:
            state = {"optimizer": self._optim.state_dict(), "rng": ckpt.rng_state()}
        return ckpt.write_shard(tmp, self.rank, state)

    def stage_checkpoint_shard(
        self, directory: str, files: list[dict[str, Any]], part: str
    ) -> None:
        """Read this rank's file of ``part``, check it fits this rank; apply nothing yet.

        Staging first means a damaged or foreign file on any rank leaves every
        rank's state untouched (the driver applies only when all ranks staged).
        """
        entry = next((f for f in files if f["rank"] == self.rank), None)
        if entry is None:
            raise CheckpointMismatch(
                f"the {part} checkpoint at {directory} has no file of rank {self.rank}"
            )
        state = ckpt.read_shard(directory, entry)
        where = f"{directory}/{entry['name']}"
        if part == ckpt.WEIGHTS:
            self._check_weights_fit(state, where)
        else:
            self._check_optimizer_fits(state, where)
        self._staged_checkpoint[part] = state

    def _check_weights_fit(self, state: Any, where: str) -> None:
        mine = self._policy.state_dict()
        if not isinstance(state, dict) or set(state) != set(mine):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise CheckpointMismatch(f"{where}: tensors {got}, this rank has {sorted(mine)}")
        bad = [
            f"{k}: {tuple(v.shape)} {v.dtype} saved, {tuple(mine[k].shape)} {mine[k].dtype} here"
            for k, v in state.items()
            if not isinstance(v, torch.Tensor)
            or v.shape != mine[k].shape
            or v.dtype != mine[k].dtype
        ]
        if bad:
            raise CheckpointMismatch(f"{where}: " + "; ".join(bad))

    def _check_optimizer_fits(self, state: Any, where: str) -> None:
        saved = state.get("optimizer", {}) if isinstance(state, dict) else {}
        groups = [len(g["params"]) for g in saved.get("param_groups", [])]
        mine = [len(g["params"]) for g in self._optim.param_groups]
        if groups != mine or "rng" not in state:
            raise CheckpointMismatch(
                f"{where}: optimizer param groups of sizes {groups}, this rank has {mine}"
            )
        params = [p for g in self._optim.param_groups for p in g["params"]]
        for index, per_param in saved.get("state", {}).items():
            for name, value in per_param.items():
                shaped = isinstance(value, torch.Tensor) and value.dim() > 0
                if shaped and value.shape != params[index].shape:
                    raise CheckpointMismatch(
                        f"{where}: optimizer {name} of parameter {index} has shape "
                        f"{tuple(value.shape)}, the parameter {tuple(params[index].shape)}"
                    )

    def apply_staged_checkpoint(self) -> None:
        """Load what ``stage_checkpoint_shard`` checked (weights in place, then optimizer, RNG)."""
        staged, self._staged_checkpoint = self._staged_checkpoint, {}
        if ckpt.WEIGHTS in staged:
            with torch.no_grad():
                self._policy.load_state_dict(staged[ckpt.WEIGHTS])
        if ckpt.OPTIMIZER in staged:
            self._optim.load_state_dict(staged[ckpt.OPTIMIZER]["optimizer"])
            ckpt.set_rng_state(staged[ckpt.OPTIMIZER]["rng"])

    def drop_staged_checkpoint(self) -> None:
        self._staged_checkpoint = {}

    # ---- inspection helpers (tests, debugging) -------------------------------------------------------
    def get_parameters(self, full_head: bool = False) -> dict[str, torch.Tensor]:
        """CPU copies of this rank's parameters (``body.*`` and ``head_weight``).

        ``full_head=True`` returns the whole ``[V, H]`` head as ``head_weight``; it is
        a TP collective, so every rank of the group must call it.
        """
        out = {
            f"body.{k}": v.detach().cpu().clone() for k, v in self._policy.body.named_parameters()
        }
        if full_head:
            out["head_weight"] = self._policy.full_head_weight().cpu()
        elif self._policy.head_weight is not None:
            out["head_weight"] = self._policy.head_weight.detach().cpu().clone()
        return out

    def parameters_digest(self) -> str:
        """sha256 of this rank's parameters (names, dtypes, bytes)."""
        h = hashlib.sha256()
        for name, p in sorted(self._policy.named_parameters()):
            t = p.detach().cpu().contiguous()
            h.update(f"{name}{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()
