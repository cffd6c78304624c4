"""TQWorkerMixin: per-rank data-plane fetch and write-back for a policy worker.

The driver ships each DP rank a :class:`KVBatchMeta` (keys only). Inside a DP
rank, the replica leader (axis-zero of TP x CP x PP) fetches the rank's slice
from the store and broadcasts it to its siblings in two phases (descriptor,
then tensors); every rank then runs the unchanged per-rank method body
(``get_logprobs`` / ``get_reference_policy_logprobs`` / ``train`` of the host
class) and the leader alone writes the result back as a new field.

The host class provides:

- ``cfg``: a :class:`policy_workers.config.PolicyConfig`;
- ``_local_coords()`` (abstract here, no default) and, when the rank has TP/CP/PP
  siblings, ``_get_replica_group()`` (default None: a lone worker);
- ``get_logprobs(data, micro_batch_size=None)``,
  ``get_reference_policy_logprobs(data, micro_batch_size=None)``,
  ``train(data, loss_fn=None, eval_mode=False, gbs=None, mbs=None)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

from dataplane_client.batching.batched_data_dict import BatchedDataDict
from dataplane_client.batching.padded_rows import cut_rows
from dataplane_client.batching.preshard import (
    ELEM_COUNTS_PER_GB,
    GLOBAL_FORWARD_PAD_SEQLEN,
    MICRO_BATCH_INDICES,
    MICRO_BATCH_LENGTHS,
    DynamicBatchingArgs,
    SequencePackingArgs,
)
from dataplane_client.wire.config import DataPlaneConfig
from dataplane_client.wire.meta import KVBatchMeta
from policy_workers.broadcast import broadcast_batched_data_dict
from policy_workers.rank_stream import RankStream, StreamStep, replica_share
from policy_workers.recording import IORecorder
from policy_workers.sharding import DATA_PARALLEL, REPLICA_AXES, NamedSharding

if TYPE_CHECKING:
    from policy_workers.config import PolicyConfig

FetchPolicy = Literal["auto", "independent", "leader_broadcast"]
FETCH_POLICIES = ("auto", "independent", "leader_broadcast")
Layout = Literal["padded", "jagged"]

PREV_LOGPROBS = "prev_logprobs"
REFERENCE_POLICY_LOGPROBS = "reference_policy_logprobs"


class NotReplicaLeader(RuntimeError):
    """A write-back was attempted from a rank that is not its DP rank's replica leader."""


def _to_cpu(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value


def _cut_to_lengths(value: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Rows ``value[i, :lengths[i]]`` as one jagged nested tensor (one masked gather:
    ``padded_rows.cut_rows``; the codec stores the nested tensor's values as they are)."""
    kept = torch.tensor(lengths, dtype=torch.long).clamp(0, value.shape[1])
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.long)
    torch.cumsum(kept, 0, out=offsets[1:])
    values = cut_rows(value, kept)
    return torch.nested.nested_tensor_from_jagged(values, offsets.to(value.device))


def _no_rows(fields: list[str]) -> BatchedDataDict:
    """A batch of zero rows with ``fields`` (per-token ones ``[0, 1]``): what a rank that
    pulled nothing trains on."""
    per_sample = {"input_lengths": torch.long, "sample_mask": torch.float32}
    out: BatchedDataDict[Any] = BatchedDataDict()
    for name in dict.fromkeys(fields):
        if name in per_sample:
            out[name] = torch.zeros(0, dtype=per_sample[name])
        else:
            out[name] = torch.zeros(
                0, 1, dtype=torch.long if name == "input_ids" else torch.float32
            )
    return out


class TQWorkerMixin:
    """Adds data-plane per-rank entry points to a policy worker (see the module docstring)."""

    _dp_client: Any = None
    _dp_cfg: DataPlaneConfig | None = None
    # Opt-in bookkeeping (tests, the demo): None keeps the data path free of it.
    _io_recorder: IORecorder | None = None

    if TYPE_CHECKING:
        # Provided by the host class (see the module docstring).
        cfg: PolicyConfig

        def train(
            self,
            data: BatchedDataDict,
            loss_fn: Any = None,
            eval_mode: bool = False,
            gbs: int | None = None,
            mbs: int | None = None,
        ) -> dict[str, Any]: ...

    # ---- connection -------------------------------------------------------------
    def setup_data_plane(self, cfg: DataPlaneConfig) -> None:
        """Connect this worker process to the running service. Idempotent."""
        if self._dp_client is not None and self._dp_cfg is not None:
            if (self._dp_cfg.name, self._dp_cfg.namespace) == (cfg.name, cfg.namespace):
                return
            self._dp_client.close()
        from dataplane_client.client import connect

        self._dp_client = connect(cfg.name, cfg.namespace)
        self._dp_cfg = cfg

    def _require_dp_client(self) -> Any:
        if self._dp_client is None:
            raise RuntimeError(
                f"{type(self).__name__}: no data-plane client; call setup_data_plane(cfg) first"
            )
        return self._dp_client

    # ---- topology (the host class answers) -----------------------------------------
    def _get_replica_group(self) -> Any:
        """Process group of the TP x CP x PP siblings of this DP rank; None when there are none.

        The default, None, is a lone worker: its own leader, fetching for itself.
        Hosts with TP/CP/PP siblings override it (NeMo-RL's mixin does the same).
        """
        return None

    def _local_coords(self) -> dict[str, int]:
        """This worker's axis -> index mapping.

        No default on purpose: a guessed default would make every rank a leader,
        i.e. a writer, and every write-back would be duplicated.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement _local_coords()")

    def _is_replica_leader(self) -> bool:
        """True iff this rank does its DP rank's unique side effects (fetch, write-back)."""
        return NamedSharding.is_axis_zero(self._local_coords(), REPLICA_AXES)

    def _fetch_device(self) -> torch.device | None:
        """Where the leader's fetch puts the batch: the worker's GPU (read there straight
        from the store's pinned memory), or None: host memory, as stored. The default,
        None, suits a CPU worker: its fetch then maps the store's memory with no copy."""
        return None

    def _replica_leader_rank(self) -> int:
        """Global rank of the replica leader (the broadcast source)."""
        group = self._get_replica_group()
        if group is None:
            return dist.get_rank() if dist.is_initialized() else 0
        return min(dist.get_process_group_ranks(group))

    # ---- fetch -----------------------------------------------------------------------
    def _pad_value_dict(self) -> dict[str, Any]:
        """Pad value per field when jagged rows become a padded rectangle."""
        return {"input_ids": int(self.cfg.pad_token_id)}

    def _forward_pad_seqlen(self, meta: KVBatchMeta) -> int:
        """The driver's cross-DP pad length (0 = pad to the local longest row)."""
        return int(meta.extra_info.get(GLOBAL_FORWARD_PAD_SEQLEN, 0) or 0)

    def _fetch_local(
        self, meta: KVBatchMeta, layout: Layout, dp_aligned_seq_len: bool
    ) -> BatchedDataDict:
        from dataplane_client.batching.batched_data_dict import jagged_values_offsets
        from dataplane_client.batching.materialize import materialize
        from dataplane_client.codec.tensordict_io import as_field_mapping

        # get_data returns a TensorDict; as a plain dict, fields can be added
        # (and ``in`` tests keys: a TensorDict refuses membership tests).
        raw = as_field_mapping(
            self._require_dp_client().get_data(meta, device=self._fetch_device())
        )
        if "input_lengths" not in raw:
            ids = raw.get("input_ids")
            if isinstance(ids, torch.Tensor) and ids.is_nested:
                _, offsets = jagged_values_offsets(ids)
                raw["input_lengths"] = (offsets[1:] - offsets[:-1]).to(torch.long)
            elif meta.sequence_lengths is not None:
                raw["input_lengths"] = torch.tensor(meta.sequence_lengths, dtype=torch.long)
        pad_to = self._forward_pad_seqlen(meta) if dp_aligned_seq_len else 0
        return materialize(
            raw, layout=layout, pad_value_dict=self._pad_value_dict(), pad_to_seqlen=pad_to
        )

    def _fetch(
        self,
        meta: KVBatchMeta,
        *,
        layout: Layout = "padded",
        fetch_policy: FetchPolicy = "auto",
        preprocess: Callable[[Any, BatchedDataDict], BatchedDataDict] | None = None,
        dp_aligned_seq_len: bool = True,
    ) -> BatchedDataDict:
        """This rank's slice of ``meta`` as a BatchedDataDict.

        ``auto``: leader fetch + broadcast when a replica group exists, else every
        rank fetches. ``independent``: every sibling fetches itself.
        ``leader_broadcast``: forced broadcast path (a replica group must exist).
        ``dp_aligned_seq_len``: pad to the driver's global forward pad length.
        """
        if fetch_policy not in FETCH_POLICIES:
            raise ValueError(
                f"unknown fetch_policy {fetch_policy!r}; choose one of {list(FETCH_POLICIES)}"
            )
        group = self._get_replica_group()
        if fetch_policy == "auto":
            fetch_policy = "leader_broadcast" if group is not None else "independent"
        if fetch_policy == "leader_broadcast":
            if group is None:
                raise RuntimeError(
                    "fetch_policy='leader_broadcast' needs a replica group, but this rank has no "
                    "TP/CP/PP siblings (use 'auto' or 'independent')"
                )
            leader = self._is_replica_leader()
            mine = self._fetch_local(meta, layout, dp_aligned_seq_len) if leader else None
            data = broadcast_batched_data_dict(
                mine, is_leader=leader, src=self._replica_leader_rank(), group=group
            )
        else:
            data = self._fetch_local(meta, layout, dp_aligned_seq_len)
        if preprocess is not None:
            data = preprocess(self, data)
        if self._io_recorder is not None:
            self._io_recorder.fetched(meta, data, fetch_policy)
        return data

    # ---- packing metadata --------------------------------------------------------------
    def _pass_args(
        self, kind: Literal["train", "logprob"]
    ) -> tuple[DynamicBatchingArgs | None, SequencePackingArgs | None]:
        return self.cfg.dynamic_batching_args(kind), self.cfg.sequence_packing_args(kind)

    def _apply_packing_prep(
        self,
        data: BatchedDataDict,
        *,
        kind: Literal["train", "logprob"],
        batch_size: int | None = None,
    ) -> tuple[BatchedDataDict, list[int] | None]:
        """Re-derive microbatch metadata on the local slice: ``shard_by_batch_size(shards=1)``.

        Returns ``(data, order)``: dynamic batching sorts rows by length, so the
        repacked rows are the original rows ``order`` (None = unchanged order).
        """
        dyn, pack = self._pass_args(kind)
        if dyn is None and pack is None:
            return data, None
        planned = data.shard_by_batch_size(
            1, batch_size=batch_size, dynamic_batching_args=dyn, sequence_packing_args=pack
        )
        # With dynamic batching or packing the result is (shards, unsorted_indices).
        assert isinstance(planned, tuple)
        shards, order = planned
        if order == list(range(len(order))):
            return shards[0], None
        return shards[0], order

    def _attach_or_repack_pack_metadata(
        self,
        data: BatchedDataDict,
        meta: KVBatchMeta,
        *,
        kind: Literal["train", "logprob"] = "logprob",
        batch_size: int | None = None,
    ) -> tuple[BatchedDataDict, KVBatchMeta]:
        """Trust the driver's packing metadata in ``meta.extra_info``; else re-derive locally.

        The driver plans microbatches jointly over DP ranks (equal microbatch
        counts everywhere); a local re-pack would not. Returns the data and a meta
        whose ``sample_ids`` follow the data's row order (a local re-pack may sort).
        """
        dyn, pack = self._pass_args(kind)
        if dyn is None and pack is None:
            return data, meta
        info = meta.extra_info
        if MICRO_BATCH_INDICES in info and MICRO_BATCH_LENGTHS in info:
            data.micro_batch_indices = info[MICRO_BATCH_INDICES]
            data.micro_batch_lengths = info[MICRO_BATCH_LENGTHS]
            data.elem_counts_per_gb = info.get(ELEM_COUNTS_PER_GB)
            return data, meta
        data, order = self._apply_packing_prep(data, kind=kind, batch_size=batch_size)
        return data, (meta if order is None else meta.subset(order))

    # ---- write-back ------------------------------------------------------------------
    def _write_back(
        self,
        meta: KVBatchMeta,
        fields: Mapping[str, torch.Tensor],
        *,
        lengths: list[int] | None = None,
        overwrite: bool = False,
    ) -> KVBatchMeta:
        """Leader-only ``put_samples(meta.sample_ids, fields)``.

        Per-token fields (``[N, S, ...]``) are cut to each row's sequence length
        and written jagged, so they come back with the same row lengths as the
        jagged ``input_ids``. ``lengths`` defaults to ``meta.sequence_lengths``.
        """
        if not self._is_replica_leader():
            raise NotReplicaLeader(
                f"rank with coords {self._local_coords()} is not its replica leader; only leaders "
                f"write back (fields {sorted(fields)}, partition {meta.partition_id!r})"
            )
        if lengths is None:
            lengths = None if meta.sequence_lengths is None else list(meta.sequence_lengths)
        else:
            lengths = [int(x) for x in lengths]
        out: dict[str, Any] = {}
        for name, value in fields.items():
            value = _to_cpu(value)
            if isinstance(value, torch.Tensor) and not value.is_nested and value.dim() >= 2:
                if lengths is None:
                    raise ValueError(
                        f"per-token field {name!r} needs row lengths: pass lengths= or a meta "
                        "with sequence_lengths"
                    )
                if len(lengths) != value.shape[0]:
                    raise ValueError(
                        f"{len(lengths)} lengths for {value.shape[0]} rows of {name!r}"
                    )
                out[name] = _cut_to_lengths(value, lengths)
            else:
                out[name] = value
        result = self._require_dp_client().put_samples(
            meta.sample_ids, meta.partition_id, out, overwrite=overwrite
        )
        if self._io_recorder is not None:
            self._io_recorder.wrote(meta, fields)
        return result

    def _write_back_result_field(
        self,
        meta: KVBatchMeta,
        result: Any,
        *,
        result_key: str,
        tq_field: str,
        lengths: list[int] | None = None,
        overwrite: bool = False,
    ) -> None:
        """The one place ``*_presharded`` methods write back: leader writes, others skip."""
        if not isinstance(result, Mapping) or result_key not in result:
            raise KeyError(
                f"worker result has no {result_key!r} (keys: {list(getattr(result, 'keys', list)())})"
            )
        if self._is_replica_leader():
            self._write_back(
                meta, {tq_field: result[result_key]}, lengths=lengths, overwrite=overwrite
            )

    # ---- per-rank entry points ---------------------------------------------------------
    @staticmethod
    def _with_fields(meta: KVBatchMeta, wanted: list[str]) -> KVBatchMeta:
        """``meta`` reading exactly ``wanted``; ``input_lengths`` only when the meta says it
        is stored (otherwise it is derived from the jagged ``input_ids``).

        ``dataclasses.replace``, not ``meta.with_fields``: that one merges with the
        meta's fields, and a pass would fetch every field the driver listed.
        """
        fields = list(dict.fromkeys(f for f in wanted if f != "input_lengths"))
        if meta.fields is not None and "input_lengths" in meta.fields:
            fields.append("input_lengths")
        return dataclasses.replace(meta, fields=fields)

    def _dp_world_size(self) -> int:
        sharding = getattr(self, "sharding", None)
        return sharding.get_axis_size("data_parallel") if sharding is not None else 1

    def _logprob_pass(
        self,
        meta: KVBatchMeta,
        method: str,
        tq_field: str,
        micro_batch_size: int | None,
        overwrite: bool,
    ) -> None:
        data = self._fetch(self._with_fields(meta, ["input_ids"]))
        data, meta = self._attach_or_repack_pack_metadata(data, meta, kind="logprob")
        result = getattr(self, method)(data, micro_batch_size=micro_batch_size)
        self._wait_for_every_rank()
        self._write_back_result_field(
            meta,
            result,
            result_key="logprobs",
            tq_field=tq_field,
            lengths=[int(x) for x in data["input_lengths"].tolist()],
            overwrite=overwrite,
        )
        del result, data

    def _wait_for_every_rank(self) -> None:
        """Barrier over every rank of the pass before any leader writes back.

        Without it a leader whose DP rank finished would write its slice while a
        rank that died mid-pass leaves the rest unwritten: a batch half with the
        field. With it, a rank lost before its result leaves no sample written,
        and the whole pass can be run again. (A rank lost after the barrier,
        while writing, can still leave part of the batch written; each sample is
        whole or absent: a put is atomic.)
        """
        if dist.is_initialized():
            dist.barrier()

    def get_logprobs_presharded(
        self, meta: KVBatchMeta, micro_batch_size: int | None = None, overwrite: bool = False
    ) -> None:
        """Fetch -> packing prep -> ``get_logprobs`` -> leader writes field ``prev_logprobs``."""
        self._logprob_pass(meta, "get_logprobs", PREV_LOGPROBS, micro_batch_size, overwrite)

    def get_reference_policy_logprobs_presharded(
        self, meta: KVBatchMeta, micro_batch_size: int | None = None, overwrite: bool = False
    ) -> None:
        """Same as :meth:`get_logprobs_presharded` for the reference policy (``reference_policy_logprobs``)."""
        self._logprob_pass(
            meta,
            "get_reference_policy_logprobs",
            REFERENCE_POLICY_LOGPROBS,
            micro_batch_size,
            overwrite,
        )

    def train_presharded(
        self,
        meta: KVBatchMeta,
        loss_fn: Any = None,
        eval_mode: bool = False,
        gbs: int | None = None,
        mbs: int | None = None,
    ) -> dict[str, Any]:
        """Fetch -> packing prep -> ``train``. Returns the (small) metrics dict of ``train``."""
        gbs = gbs or self.cfg.train_global_batch_size
        if loss_fn is None:
            from policy_workers.loss import ClippedPGLoss

            loss_fn = ClippedPGLoss(self.cfg.loss)
        wanted = list(getattr(loss_fn, "required_fields", lambda: ["input_ids"])())
        data = self._fetch(self._with_fields(meta, ["input_ids", *wanted]))
        data, meta = self._attach_or_repack_pack_metadata(
            data, meta, kind="train", batch_size=max(1, gbs // self._dp_world_size())
        )
        return self.train(data, loss_fn=loss_fn, eval_mode=eval_mode, gbs=gbs, mbs=mbs)

    # ---- per-rank streaming pull (policy_workers/rank_stream.py) --------------------------
    def _rank_stream(self, step: StreamStep) -> RankStream:
        """This rank's side of a streamed step: the leader pulls, its siblings follow."""
        leader = self._is_replica_leader()
        return RankStream(
            self._require_dp_client() if leader else None,
            step,
            dp_rank=int(self._local_coords().get(DATA_PARALLEL, 0)),
            is_leader=leader,
            share=replica_share(self._get_replica_group(), self._replica_leader_rank()),
        )

    def get_logprobs_streamed(
        self,
        step: StreamStep,
        micro_batch_size: int | None = None,
        overwrite: bool = False,
        reference: bool = False,
    ) -> dict[str, Any]:
        """Pull micro-batches of ``step`` (no driver plan) -> ``get_logprobs`` (or, with
        ``reference``, the reference policy's) per micro-batch -> after every rank is done,
        the leader writes ``prev_logprobs`` (``reference_policy_logprobs``) back. Returns
        what this rank pulled (``StreamReport``, as a dict)."""
        method, tq_field = (
            ("get_reference_policy_logprobs", REFERENCE_POLICY_LOGPROBS)
            if reference
            else ("get_logprobs", PREV_LOGPROBS)
        )
        stream = self._rank_stream(step)
        results = []
        for meta in stream.metas():
            data = self._fetch(self._with_fields(meta, ["input_ids"]))
            data, meta = self._attach_or_repack_pack_metadata(data, meta, kind="logprob")
            result = getattr(self, method)(data, micro_batch_size=micro_batch_size)
            results.append((meta, result, [int(x) for x in data["input_lengths"].tolist()]))
        self._wait_for_every_rank()
        for meta, result, lengths in results:
            self._write_back_result_field(
                meta,
                result,
                result_key="logprobs",
                tq_field=tq_field,
                lengths=lengths,
                overwrite=overwrite,
            )
        return stream.report.as_dict()

    def train_streamed(
        self,
        step: StreamStep,
        loss_fn: Any = None,
        eval_mode: bool = False,
        mbs: int | None = None,
    ) -> dict[str, Any]:
        """Pull the micro-batches of ``step`` (no driver plan), then one ``train`` step on
        what this rank pulled (the loss normalises over every DP rank's counts, so the
        split does not change it). Returns ``train``'s metrics plus ``stream``: what this
        rank pulled."""
        if loss_fn is None:
            from policy_workers.loss import ClippedPGLoss

            loss_fn = ClippedPGLoss(self.cfg.loss)
        wanted = list(getattr(loss_fn, "required_fields", lambda: ["input_ids"])())
        stream = self._rank_stream(step)
        parts = [
            self._fetch(self._with_fields(meta, ["input_ids", *wanted]), dp_aligned_seq_len=False)
            for meta in stream.metas()
        ]
        if parts:
            data = BatchedDataDict.from_batches(parts, pad_value_dict=self._pad_value_dict())
            # dynamic batching / packing planned here, over what this rank pulled (one
            # global batch: the DP all-reduce is once per step, whatever each rank's count)
            data, _ = self._apply_packing_prep(data, kind="train", batch_size=data.size)
        else:  # every sample went to other ranks: train on none, still in every collective
            data = _no_rows(["input_ids", "input_lengths", *wanted])
        result = self.train(
            data,
            loss_fn=loss_fn,
            eval_mode=eval_mode,
            gbs=step.step_samples * self._dp_world_size(),  # one global batch per rank
            mbs=mbs,
        )
        return {**result, "stream": stream.report.as_dict()}

    # ---- bookkeeping (tests, the demo) ----------------------------------------------------
    def set_io_recording(
        self, enabled: bool = True, *, keep_last: int = 256, digests: bool = True
    ) -> None:
        """Record this rank's last ``keep_last`` fetches (with a digest of each fetched
        batch when ``digests``) and write-backs; ``enabled=False`` drops the recorder."""
        self._io_recorder = IORecorder(keep_last, digests=digests) if enabled else None

    def get_io_log(self) -> list[dict[str, Any]]:
        return [] if self._io_recorder is None else self._io_recorder.entries()

    def clear_io_log(self) -> None:
        if self._io_recorder is not None:
            self._io_recorder.clear()
