"""TQPolicy: the driver side of a policy; it plans and dispatches, data stays off its path.

Data-plane path (``*_from_meta``): the driver holds only a :class:`KVBatchMeta`.
It splits the keys over DP ranks with ``shard_meta_for_dp`` (balanced packing /
dynamic batching metadata rides in each rank's ``extra_info``), stamps the
global forward pad length into every per-rank meta, and dispatches the metas to
the workers' ``*_presharded`` methods. Workers fetch their own rows from the
store and write results back as fields; the driver gets ``None`` (logprobs) or
a small dict of floats (train) back, never a tensor. With a
:class:`~policy_workers.recording.DispatchRecorder` passed in (tests, the demo),
the last dispatches' shipped metas and received results are kept for
inspection; by default nothing is kept.

Classic path (``get_logprobs`` / ``get_reference_policy_logprobs`` /
``train``): the driver holds the BatchedDataDict, shards it with
``shard_by_batch_size`` and ships tensors through the Ray object store, as
NeMo-RL's ``lm_policy.Policy`` does. Same workers, same per-rank code; kept for
equivalence tests and side-by-side benchmarks.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import ray
import torch

from dataplane_client.batching.batched_data_dict import BatchedDataDict
from dataplane_client.batching.preshard import (
    GLOBAL_FORWARD_PAD_SEQLEN,
    global_forward_pad_seqlen,
    shard_meta_for_dp,
)
from dataplane_client.wire.meta import KVBatchMeta
from policy_workers import checkpoint as ckpt
from policy_workers.config import DynamicBatchingConfig, PolicyConfig, SequencePackingConfig
from policy_workers.errors import CheckpointMismatch
from policy_workers.rank_stream import StreamStep
from policy_workers.recording import DispatchRecorder
from policy_workers.sharding import DATA_PARALLEL, REPLICA_AXES, NamedSharding
from policy_workers.tq_mixin import PREV_LOGPROBS, REFERENCE_POLICY_LOGPROBS
from policy_workers.worker import PolicyWorker
from policy_workers.worker_group import RayWorkerGroup, WorkerFutures

if TYPE_CHECKING:
    from dataplane_client.client import RayDataPlaneClient


def contains_tensor(obj: Any) -> bool:
    """True if ``obj`` is, or (recursively) holds, a torch tensor."""
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, Mapping):
        return any(contains_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple, set)):
        return any(contains_tensor(v) for v in obj)
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return any(contains_tensor(v) for v in vars(obj).values())
    return False


class TQPolicy:
    """A policy of ``cfg.pp * cfg.dp * cfg.cp * cfg.tp`` Ray workers."""

    def __init__(
        self,
        cfg: PolicyConfig,
        *,
        worker_cls: type = PolicyWorker,
        name_prefix: str | None = None,
        recorder: DispatchRecorder | None = None,
    ):
        self.cfg = cfg
        self.recorder = recorder
        self.sharding = NamedSharding.for_policy(pp=cfg.pp, dp=cfg.dp, cp=cfg.cp, tp=cfg.tp)
        self.worker_group = RayWorkerGroup(
            worker_cls,
            self.sharding,
            worker_kwargs={"cfg": cfg},
            num_cpus_per_worker=cfg.num_cpus_per_worker,
            num_gpus_per_worker=cfg.num_gpus_per_worker,
            collective_timeout_s=cfg.collective_timeout_s,
            name_prefix=name_prefix,
        )
        try:
            ray.get(self.worker_group.run_all_workers_single_data("setup"))
            if cfg.data_plane is not None:
                ray.get(
                    self.worker_group.run_all_workers_single_data(
                        "setup_data_plane", cfg.data_plane
                    )
                )
        except Exception:
            self.worker_group.shutdown()
            raise
        self._client: RayDataPlaneClient | None = None

    @property
    def dp_size(self) -> int:
        return self.sharding.get_axis_size(DATA_PARALLEL)

    # ---- data-plane path --------------------------------------------------------------
    def _client_or_connect(self) -> RayDataPlaneClient:
        if self._client is None:
            if self.cfg.data_plane is None:
                raise RuntimeError(
                    "this policy has no data plane configured (cfg.data_plane is None)"
                )
            from dataplane_client.client import connect

            self._client = connect(self.cfg.data_plane.name, self.cfg.data_plane.namespace)
        return self._client

    def _shard_meta(
        self, meta: KVBatchMeta, *, kind: Literal["train", "logprob"], batch_size: int | None
    ) -> list[KVBatchMeta]:
        metas, _ = shard_meta_for_dp(
            meta,
            dp_world=self.dp_size,
            batch_size=batch_size,
            sequence_packing_args=self.cfg.sequence_packing_args(kind),
            dynamic_batching_args=self.cfg.dynamic_batching_args(kind),
        )
        return self._stamp_pad_seqlen(metas)

    def _stamp_pad_seqlen(self, metas: list[KVBatchMeta]) -> list[KVBatchMeta]:
        """Every rank pads its forward batch to the same length (the longest over all ranks)."""
        if any(m.sequence_lengths is None for m in metas):
            return metas
        pad = global_forward_pad_seqlen(metas, multiple=self.cfg.forward_pad_multiple)
        for m in metas:
            m.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] = pad
        return metas

    def _dispatch_metas(
        self, method: str, metas: list[KVBatchMeta], **common_kwargs: Any
    ) -> list[Any]:
        for m in metas:
            if contains_tensor(m):
                raise AssertionError("a per-rank meta holds a tensor; metas must be keys only")
        futures: WorkerFutures = self.worker_group.run_all_workers_sharded_data(
            method,
            data=metas,
            in_sharded_axes=[DATA_PARALLEL],
            replicate_on_axes=REPLICA_AXES,
            output_is_replicated=REPLICA_AXES,
            common_kwargs=common_kwargs,
            data_arg="meta",
        )
        results = self.worker_group.get_all_worker_results(futures)
        if self.recorder is not None:
            self.recorder.dispatched(metas, results)
        return results

    def get_logprobs_from_meta(
        self, meta: KVBatchMeta, micro_batch_size: int | None = None, overwrite: bool = False
    ) -> KVBatchMeta:
        """Policy logprobs of ``meta``'s samples, written to the store as ``prev_logprobs``.

        Returns ``meta`` with ``prev_logprobs`` added to its fields.
        """
        metas = self._shard_meta(meta, kind="logprob", batch_size=None)
        self._dispatch_metas(
            "get_logprobs_presharded", metas, micro_batch_size=micro_batch_size, overwrite=overwrite
        )
        return meta.with_fields([PREV_LOGPROBS])

    def get_reference_policy_logprobs_from_meta(
        self, meta: KVBatchMeta, micro_batch_size: int | None = None, overwrite: bool = False
    ) -> KVBatchMeta:
        """Reference-policy logprobs, written to the store as ``reference_policy_logprobs``."""
        metas = self._shard_meta(meta, kind="logprob", batch_size=None)
        self._dispatch_metas(
            "get_reference_policy_logprobs_presharded",
            metas,
            micro_batch_size=micro_batch_size,
            overwrite=overwrite,
        )
        return meta.with_fields([REFERENCE_POLICY_LOGPROBS])

    def train_from_meta(
        self,
        meta: KVBatchMeta,
        loss_fn: Any = None,
        eval_mode: bool = False,
        gbs: int | None = None,
        mbs: int | None = None,
    ) -> dict[str, Any]:
        """Train on ``meta``'s samples (fields read by the workers). Returns loss, grad_norm, ..."""
        gbs = gbs or self.cfg.train_global_batch_size
        mbs = mbs or self.cfg.train_micro_batch_size
        metas = self._shard_meta(meta, kind="train", batch_size=gbs)
        results = self._dispatch_metas(
            "train_presharded", metas, loss_fn=loss_fn, eval_mode=eval_mode, gbs=gbs, mbs=mbs
        )
        return _aggregate_train_results(results)

    def read_from_dataplane(
        self, meta: KVBatchMeta, fields: list[str], *, layout: str = "padded"
    ) -> BatchedDataDict:
        """Read ``fields`` of ``meta``'s samples (in ``meta.sample_ids`` order) from the store.

        A user-level read (inspection, metrics), not part of the worker data path.
        """
        from dataplane_client.batching.materialize import materialize

        raw = self._client_or_connect().get_data(meta, list(fields))
        return materialize(raw, layout=layout)

    def write_to_dataplane(
        self, meta: KVBatchMeta, fields: Mapping[str, Any], *, overwrite: bool = False
    ) -> KVBatchMeta:
        """Write ``fields`` for ``meta``'s samples; returns the meta with those fields added."""
        self._client_or_connect().put_samples(
            meta.sample_ids, meta.partition_id, dict(fields), overwrite=overwrite
        )
        return meta.with_fields(list(fields))

    # ---- per-rank streaming pull: no driver plan (policy_workers/rank_stream.py) ------------------
    @staticmethod
    def stream_step(
        partition_id: str,
        task_name: str,
        fields: list[str],
        step_samples: int,
        token_budget: int,
        **options: Any,
    ) -> StreamStep:
        """The one small message a streamed pass ships to every worker (``StreamStep``:
        ``max_micro_batch``, ``timeout_s``, ``report_ids`` among ``options``)."""
        wanted = tuple(dict.fromkeys(f for f in fields if f != "input_lengths"))
        return StreamStep(partition_id, task_name, wanted, step_samples, token_budget, **options)

    def _stream(self, method: str, step: StreamStep, **kwargs: Any) -> list[Any]:
        """Every worker runs ``method(step, **kwargs)``; the DP leaders' results, DP order."""
        results = self.run_on_all_workers(method, step, **kwargs)
        leaders = [
            results[self.sharding.get_rank(**{DATA_PARALLEL: dp, **dict.fromkeys(REPLICA_AXES, 0)})]
            for dp in range(self.dp_size)
        ]
        if self.recorder is not None:
            self.recorder.dispatched([step] * len(results), results)
        return leaders

    def get_logprobs_streamed(
        self, step: StreamStep, micro_batch_size: int | None = None, overwrite: bool = False
    ) -> list[dict[str, Any]]:
        """Each DP leader pulls micro-batches of ``step`` under its token budget and its
        replica writes ``prev_logprobs`` back; returns each DP rank's ``StreamReport``."""
        return self._stream(
            "get_logprobs_streamed", step, micro_batch_size=micro_batch_size, overwrite=overwrite
        )

    def get_reference_policy_logprobs_streamed(
        self, step: StreamStep, micro_batch_size: int | None = None, overwrite: bool = False
    ) -> list[dict[str, Any]]:
        """:meth:`get_logprobs_streamed` for ``reference_policy_logprobs``."""
        return self._stream(
            "get_logprobs_streamed",
            step,
            micro_batch_size=micro_batch_size,
            overwrite=overwrite,
            reference=True,
        )

    def train_streamed(
        self, step: StreamStep, loss_fn: Any = None, eval_mode: bool = False, mbs: int | None = None
    ) -> dict[str, Any]:
        """One train step on ``step``'s samples, each DP leader pulling its own; returns
        ``train_from_meta``'s metrics plus ``streams``: each DP rank's ``StreamReport``."""
        mbs = mbs or self.cfg.train_micro_batch_size
        results = self._stream(
            "train_streamed", step, loss_fn=loss_fn, eval_mode=eval_mode, mbs=mbs
        )
        return {**_aggregate_train_results(results), "streams": [r["stream"] for r in results]}

    # ---- classic path (tensors through the driver) -------------------------------------------
    def _shard_data(
        self, data: BatchedDataDict, *, kind: Literal["train", "logprob"], batch_size: int | None
    ) -> tuple[list[BatchedDataDict], list[int] | None]:
        dyn = self.cfg.dynamic_batching_args(kind)
        pack = self.cfg.sequence_packing_args(kind)
        if dyn is None and pack is None:
            shards = data.shard_by_batch_size(self.dp_size, batch_size=batch_size)
            # Without dynamic batching or packing the result is the list of shards alone.
            assert isinstance(shards, list)
            return list(shards), None
        planned = data.shard_by_batch_size(
            self.dp_size,
            batch_size=batch_size,
            dynamic_batching_args=dyn,
            sequence_packing_args=pack,
        )
        # With dynamic batching or packing it is (shards, unsorted_indices).
        assert isinstance(planned, tuple)
        return list(planned[0]), planned[1]

    def _dispatch_data(
        self, method: str, shards: list[BatchedDataDict], **common_kwargs: Any
    ) -> list[Any]:
        futures = self.worker_group.run_all_workers_sharded_data(
            method,
            data=shards,
            in_sharded_axes=[DATA_PARALLEL],
            replicate_on_axes=REPLICA_AXES,
            output_is_replicated=REPLICA_AXES,
            common_kwargs=common_kwargs,
        )
        return self.worker_group.get_all_worker_results(futures)

    def _classic_logprobs(
        self, method: str, data: BatchedDataDict, micro_batch_size: int | None
    ) -> BatchedDataDict:
        shards, unsorted = self._shard_data(data, kind="logprob", batch_size=None)
        results = self._dispatch_data(method, shards, micro_batch_size=micro_batch_size)
        out = BatchedDataDict.from_batches(results)
        if unsorted is not None:
            out.reorder_data(unsorted)
        return out

    def get_logprobs(
        self, data: BatchedDataDict, micro_batch_size: int | None = None
    ) -> BatchedDataDict:
        """``{"logprobs": [B, S]}`` in ``data``'s row order (classic path)."""
        return self._classic_logprobs("get_logprobs", data, micro_batch_size)

    def get_reference_policy_logprobs(
        self, data: BatchedDataDict, micro_batch_size: int | None = None
    ) -> BatchedDataDict:
        """``{"logprobs": [B, S]}`` of the reference policy (classic path)."""
        return self._classic_logprobs("get_reference_policy_logprobs", data, micro_batch_size)

    def train(
        self,
        data: BatchedDataDict,
        loss_fn: Any = None,
        eval_mode: bool = False,
        gbs: int | None = None,
        mbs: int | None = None,
    ) -> dict[str, Any]:
        """Train on a driver-held batch (classic path)."""
        gbs = gbs or self.cfg.train_global_batch_size
        mbs = mbs or self.cfg.train_micro_batch_size
        shards, _ = self._shard_data(data, kind="train", batch_size=gbs)
        results = self._dispatch_data(
            "train", shards, loss_fn=loss_fn, eval_mode=eval_mode, gbs=gbs, mbs=mbs
        )
        return _aggregate_train_results(results)

    # ---- checkpoints (NeMo-RL's save_checkpoint(weights_path, optimizer_path)) ---------------------
    def save_checkpoint(
        self, weights_path: str, optimizer_path: str | None = None, *, step: int | None = None
    ) -> None:
        """Save every rank's weights to ``weights_path`` and, when given, its optimizer
        and RNG states to ``optimizer_path`` (new directories; ``policy_workers.checkpoint``
        has the layout). ``step``, the caller's training step, is recorded in both."""
        save_id = uuid.uuid4().hex  # ties the optimizer part to these weights
        self._save_part(weights_path, ckpt.WEIGHTS, save_id, step)
        if optimizer_path is not None:
            self._save_part(optimizer_path, ckpt.OPTIMIZER, save_id, step)

    def _save_part(self, path: str, part: str, save_id: str, step: int | None) -> None:
        tmp = ckpt.start(path)
        try:
            files = self.run_on_all_workers("save_checkpoint_shard", tmp, part)
            manifest = {"part": part, "save_id": save_id, "step": step, **self._identity()}
            ckpt.finish(tmp, path, {**manifest, "files": files})
        except BaseException:
            ckpt.abandon(tmp)
            raise

    def _identity(self) -> dict[str, Any]:
        """What a checkpoint must have been saved by to load here."""
        c = self.cfg
        return {
            "layout": {"pp": c.pp, "dp": c.dp, "cp": c.cp, "tp": c.tp},
            "model": ckpt.model_fingerprint(c.model),
            "optimizer": c.optimizer.name,
        }

    def load_checkpoint(self, weights_path: str, optimizer_path: str | None = None) -> int | None:
        """Load a :meth:`save_checkpoint` into every rank; returns the step saved with it.

        All or nothing: manifests are checked against this policy (model config,
        layout, optimizer; an optimizer part must come from the same save as the
        weights), then every rank reads and checks its files, and only when all
        did does any rank change its state. Raises ``CheckpointNotFound``,
        ``CheckpointCorrupt`` or ``CheckpointMismatch`` naming what is wrong.
        """
        paths = {ckpt.WEIGHTS: weights_path}
        if optimizer_path is not None:
            paths[ckpt.OPTIMIZER] = optimizer_path
        manifests = {part: ckpt.read_manifest(path, part) for part, path in paths.items()}
        for part, m in manifests.items():
            ckpt.check_matches(m, paths[part], **self._identity())
            ranks = sorted(f["rank"] for f in m["files"])
            if ranks != list(range(self.worker_group.world_size)):
                raise CheckpointMismatch(
                    f"{paths[part]}: files of ranks {ranks}, this policy has "
                    f"{self.worker_group.world_size} workers"
                )
        weights = manifests[ckpt.WEIGHTS]
        if (
            optimizer_path is not None
            and manifests[ckpt.OPTIMIZER]["save_id"] != weights["save_id"]
        ):
            raise CheckpointMismatch(
                f"the optimizer state at {optimizer_path} was not saved with the weights at "
                f"{weights_path}"
            )
        try:
            for part, m in manifests.items():
                self.run_on_all_workers("stage_checkpoint_shard", paths[part], m["files"], part)
        except BaseException:
            if self.worker_group.lost is None:
                self.run_on_all_workers("drop_staged_checkpoint")
            raise
        self.run_on_all_workers("apply_staged_checkpoint")
        return weights["step"]

    # ---- reconfiguration -------------------------------------------------------------------------
    def configure_batching(
        self,
        dynamic_batching: DynamicBatchingConfig | None = None,
        sequence_packing: SequencePackingConfig | None = None,
    ) -> None:
        """Switch the microbatching mode on the driver and every worker (None = disabled)."""
        dynamic_batching = dynamic_batching or DynamicBatchingConfig(enabled=False)
        sequence_packing = sequence_packing or SequencePackingConfig(enabled=False)
        self.cfg = dataclasses.replace(
            self.cfg, dynamic_batching=dynamic_batching, sequence_packing=sequence_packing
        )
        self.run_on_all_workers("update_batching_config", dynamic_batching, sequence_packing)

    # ---- lifecycle / inspection ----------------------------------------------------------------
    def run_on_all_workers(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """The results of ``method`` called on every worker (rank order)."""
        return self.worker_group.call_all_workers(method, *args, **kwargs)

    def shutdown(self) -> bool:
        if self._client is not None:
            self._client.close()
            self._client = None
        return self.worker_group.shutdown()


def _aggregate_train_results(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Every DP leader reports the same global loss and grad norm; metrics are concatenated."""
    first = results[0]
    merged: dict[str, list[float]] = {}
    for r in results:
        for k, v in r["all_mb_metrics"].items():
            merged.setdefault(k, []).extend(v)
    return {
        "loss": first["loss"],
        "grad_norm": first["grad_norm"],
        "losses": first["losses"],
        "grad_norms": first["grad_norms"],
        "num_steps": first["num_steps"],
        "all_mb_metrics": merged,
    }
