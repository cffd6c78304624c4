"""BatchedDataDict: a dict of per-sample columns that shards, reorders and microbatches.

Every value holds one entry per sample along its leading dimension: a tensor
``[N, ...]`` (a ``torch.nested`` jagged tensor is accepted where noted) or a
Python list of length ``N``. The DP split itself is planned on lengths only by
:func:`dataplane_client.batching.preshard.plan_dp_shards`, which is also what
``shard_meta_for_dp`` uses, so the driver's key-list split and this in-memory
split can never disagree.

Differences from the NeMo-RL reference, on purpose:

- bad input raises :class:`InvalidBatch` with a message, not ``AssertionError``;
- ``from_batches`` pads every trailing dimension of N-D tensors (the reference
  flattens rows to 1-D first; the two agree for 2-D tensors);
- the indices returned next to the shards always satisfy the reorder contract
  (the reference's differ once ``batch_size`` cuts the batch into several
  chunks under dynamic batching);
- ``chunk`` accepts every ``rank < chunks`` and ``size`` of an empty dict is 0;
- ``truncate_tensors`` never grows a tensor (a length past the end keeps it
  whole);
- under sequence packing, ``batch_size`` need not be a multiple of ``shards``
  (shard sizes follow the bins).
"""

from __future__ import annotations

import functools
from collections import UserDict
from collections.abc import Iterator, Mapping, Sequence
from copy import deepcopy
from typing import Any, Generic, TypeVar

import torch

from dataplane_client.batching.preshard import (
    DynamicBatchingArgs,
    SequencePackingArgs,
    plan_dp_shards,
)
from dataplane_client.wire.errors import FieldNotProduced, InvalidBatch

DictT = TypeVar("DictT", bound=Mapping[str, Any])

__all__ = [
    "BatchedDataDict",
    "DynamicBatchingArgs",
    "SequencePackingArgs",
    "SlicedDataDict",
]


# ---- row helpers (tensor, nested tensor or list) ----------------------------
def _rows(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            raise InvalidBatch("a 0-d tensor has no batch dimension")
        return value.size(0)
    return len(value)


def jagged_values_offsets(nt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, offsets)`` of a nested tensor: row ``i`` is ``values[offsets[i]:offsets[i+1]]``."""
    if nt.layout == torch.jagged and getattr(nt, "_lengths", None) is None:
        return nt.values(), nt.offsets()  # type: ignore[attr-defined]  # nested-tensor API
    rows = nt.unbind()
    lengths = torch.tensor([r.size(0) for r in rows], dtype=torch.long)
    offsets = torch.zeros(len(rows) + 1, dtype=torch.long)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return torch.cat(rows) if rows else nt.values()[:0], offsets


def _take_nested(nt: torch.Tensor, indices: Sequence[int]) -> torch.Tensor:
    """Rows ``indices`` of a nested tensor, as a jagged nested tensor (zero rows allowed)."""
    values, offsets = jagged_values_offsets(nt)
    offsets = offsets.to(values.device)
    sel = torch.as_tensor(list(indices), dtype=torch.long, device=values.device)
    sel = torch.where(sel < 0, sel + (offsets.numel() - 1), sel)
    starts = offsets[sel]
    lengths = offsets[sel + 1] - starts
    new_offsets = torch.zeros(sel.numel() + 1, dtype=torch.long, device=values.device)
    torch.cumsum(lengths, 0, out=new_offsets[1:])
    total = int(new_offsets[-1])
    gather = torch.arange(total, device=values.device) + torch.repeat_interleave(
        starts - new_offsets[:-1], lengths, output_size=total
    )
    return torch.nested.nested_tensor_from_jagged(values.index_select(0, gather), new_offsets)


def _take(value: Any, indices: Sequence[int], key: str) -> Any:
    """Rows ``indices`` of one column, as a copy."""
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            return _take_nested(value, indices)
        idx = torch.as_tensor(list(indices), dtype=torch.long, device=value.device)
        return value.index_select(0, idx)
    if isinstance(value, list):
        return [value[i] for i in indices]
    raise InvalidBatch(
        f"cannot select rows of a {type(value).__name__}; values must be tensors or lists",
        fields=[key],
    )


def _cut(value: Any, start: int, end: int) -> Any:
    """Rows ``[start, end)`` of one column (a view for dense tensors)."""
    if isinstance(value, torch.Tensor) and value.is_nested:
        return _take_nested(value, range(start, end))
    return value[start:end]


def _batch_size_of(data: Mapping[str, Any]) -> int:
    sizes = {k: _rows(v) for k, v in data.items()}
    if len(set(sizes.values())) > 1:
        raise InvalidBatch(f"batch sizes are not the same across the batch: {sizes}")
    return next(iter(sizes.values()), 0)


def _has_rows(batch: Mapping[str, Any]) -> bool:
    """Whether one of ``from_batches``' inputs has rows, counted as NeMo-RL counts them.

    The first tensor field (else list field) gives the rows; other values
    (metadata objects) are never asked their ``len()``. A batch with neither
    but with keys counts as having rows, so its values meet the stacking rules.
    """
    first: torch.Tensor | list | None = next(
        (v for v in batch.values() if isinstance(v, torch.Tensor)), None
    )
    if first is None:
        first = next((v for v in batch.values() if isinstance(v, list)), None)
    return bool(batch) if first is None else _rows(first) > 0


def _as_int_list(value: Any, key: str) -> list[int]:
    if isinstance(value, torch.Tensor):
        if value.dim() != 1:
            raise InvalidBatch(
                f"lengths field must be 1-D, got shape {tuple(value.shape)}", fields=[key]
            )
        return [int(x) for x in value.tolist()]
    if isinstance(value, list):
        return [int(x) for x in value]
    raise InvalidBatch(f"lengths field is a {type(value).__name__}", fields=[key])


def _pad_cat(tensors: list[torch.Tensor], pad_value: Any) -> torch.Tensor:
    """Concatenate along dim 0, right-padding every trailing dim to the largest."""
    ndim = tensors[0].dim()
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
    trailing = [max(t.size(d) for t in tensors) for d in range(1, ndim)]
    total = sum(t.size(0) for t in tensors)
    out = torch.full((total, *trailing), pad_value, dtype=dtype, device=tensors[0].device)
    row = 0
    for t in tensors:
        region = (slice(row, row + t.size(0)), *(slice(0, s) for s in t.shape[1:]))
        out[region] = t
        row += t.size(0)
    return out


class BatchedDataDict(UserDict, Generic[DictT]):
    """Columns of one batch; see the module docstring.

    After ``shard_by_batch_size`` with dynamic batching or sequence packing a
    shard also carries ``micro_batch_indices`` / ``micro_batch_lengths`` (one
    list per ``batch_size`` chunk) and, for packing, ``elem_counts_per_gb``
    (rows per chunk).

    >>> b = BatchedDataDict({"x": torch.tensor([1, 2, 3]), "y": ["a", "b", "c"]})
    >>> b.size
    3
    >>> b.repeat_interleave(2)["y"]
    ['a', 'a', 'b', 'b', 'c', 'c']
    >>> b.chunk(rank=1, chunks=3)
    {'x': tensor([2]), 'y': ['b']}
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.micro_batch_indices: list[list[list[int]]] | None = None
        self.micro_batch_lengths: list[list[int]] | None = None
        self.elem_counts_per_gb: list[int] | None = None

    # ---- building -----------------------------------------------------------
    @classmethod
    def from_batches(
        cls,
        batches: Sequence[Mapping[str, Any]],
        pad_value_dict: Mapping[str, Any] | None = None,
    ) -> BatchedDataDict:
        """Stack a list of batches into one: lists concatenate, tensors concatenate along dim 0.

        1-D tensors are concatenated as they are; tensors with trailing
        dimensions are right-padded to the largest size in each dimension with
        ``pad_value_dict.get(key, 0)``. Keys come out sorted.

        Batches with zero rows contribute nothing (no list of batches, or only
        empty ones, gives an empty BatchedDataDict); a key missing from a
        batch that has rows raises FieldNotProduced (a KeyError) saying so. A
        batch's rows are those of its first tensor field (else list field), as
        NeMo-RL counts them: metadata values are never asked their ``len()``.

        >>> out = BatchedDataDict.from_batches(
        ...     [{"ids": torch.tensor([[1, 2]]), "n": [2]},
        ...      {"ids": torch.tensor([[3, 4, 5]]), "n": [3]}],
        ...     pad_value_dict={"ids": -1})
        >>> out["ids"]
        tensor([[ 1,  2, -1],
                [ 3,  4,  5]])
        >>> out["n"]
        [2, 3]
        """
        pad_value_dict = dict(pad_value_dict or {})
        # A batch without rows (a rank that got no samples; even an empty mapping)
        # adds nothing, so its keys are not required of the others.
        positions = [i for i, b in enumerate(batches) if _has_rows(b)]
        out = cls()
        for k in sorted({k for i in positions for k in batches[i]}):
            missing = [i for i in positions if k not in batches[i]]
            if missing:
                raise FieldNotProduced(  # NeMo-RL's words (its tests match them)
                    f"Key {k!r} is missing from non-empty batches {missing}", fields=[k]
                )
            values = [batches[i][k] for i in positions]
            if all(isinstance(v, list) for v in values):
                out[k] = [x for v in values for x in v]
            elif all(isinstance(v, torch.Tensor) and not v.is_nested for v in values):
                ndims = {v.dim() for v in values}
                if len(ndims) != 1 or 0 in ndims:
                    raise InvalidBatch(
                        f"cannot stack tensors of dims {sorted(ndims)} (need the same dim >= 1)",
                        fields=[k],
                    )
                if ndims == {1}:
                    out[k] = torch.cat(values)
                else:
                    out[k] = _pad_cat(values, pad_value_dict.get(k, 0))
            else:
                kinds = sorted({type(v).__name__ for v in values})
                raise InvalidBatch(
                    f"cannot stack values of types {kinds}; give dense tensors or lists of "
                    "picklable objects",
                    fields=[k],
                )
        return out

    def all_gather(self, group: Any) -> BatchedDataDict:
        """Gather this batch from every rank of ``group``, concatenated in rank order.

        Tensors may differ in leading size and in trailing sizes across ranks:
        trailing dims are right-padded with 0 to the largest. Lists are
        gathered as Python objects. Keys, kinds, dtypes and ranks of tensors
        must agree over the group (checked; mismatches raise InvalidBatch on
        every rank). Works with gloo (CPU tensors) and NCCL (CUDA tensors).
        """
        import torch.distributed as dist

        world = dist.get_world_size(group)
        desc: dict[str, tuple] = {}
        for k, v in self.data.items():
            if isinstance(v, torch.Tensor) and not v.is_nested:
                desc[k] = ("tensor", str(v.dtype), tuple(v.shape))
            elif isinstance(v, list):
                desc[k] = ("list", len(v))
            else:
                desc[k] = ("unsupported", type(v).__name__)
        descs: list[Any] = [None] * world
        dist.all_gather_object(descs, desc, group=group)

        keys = list(descs[0])
        problems = []
        for r, d in enumerate(descs):
            if list(d) != keys:
                problems.append(f"rank {r} has keys {list(d)}, rank 0 has {keys}")
        for k in keys:
            kinds = {(d[k][0], d[k][1] if d[k][0] == "tensor" else None) for d in descs if k in d}
            if any(kind == "unsupported" for kind, _ in kinds):
                problems.append(f"{k!r} is not a dense tensor or a list on some rank")
            elif len(kinds) > 1:
                problems.append(
                    f"{k!r} differs in kind/dtype across ranks: {sorted(map(str, kinds))}"
                )
            elif kinds and next(iter(kinds))[0] == "tensor":
                if len({len(d[k][2]) for d in descs}) > 1:
                    problems.append(f"{k!r} has different tensor ranks across ranks")
                elif len(descs[0][k][2]) == 0:
                    problems.append(f"{k!r} is a 0-d tensor")
        if problems:
            raise InvalidBatch("all_gather: batches disagree across ranks: " + "; ".join(problems))

        out = type(self)()
        for k in keys:
            v = self.data[k]
            if desc[k][0] == "list":
                parts: list[Any] = [None] * world
                dist.all_gather_object(parts, v, group=group)
                out[k] = [x for p in parts for x in p]
                continue
            shapes = [d[k][2] for d in descs]
            full = [max(s[i] for s in shapes) for i in range(len(shapes[0]))]
            send = v
            if v.dtype == torch.bool:  # not every backend reduces/gathers bool
                send = v.to(torch.uint8)
            padded = send.new_zeros(full)
            padded[tuple(slice(0, s) for s in v.shape)] = send
            recv = [torch.empty_like(padded) for _ in range(world)]
            dist.all_gather(recv, padded.contiguous(), group=group)
            trailing = tuple(slice(None) for _ in full[1:])
            gathered = torch.cat(
                [t[(slice(0, s[0]),) + trailing] for t, s in zip(recv, shapes, strict=True)]
            )
            out[k] = gathered.to(v.dtype)
        return out

    # ---- splitting ----------------------------------------------------------
    def chunk(self, rank: int, chunks: int) -> SlicedDataDict:
        """The ``rank``-th of ``chunks`` contiguous equal splits.

        batch=[A A A B B B D D E], rank=2, chunks=3 -> [D D E]. The batch size
        must be a multiple of ``chunks``.
        """
        n = _batch_size_of(self.data)
        if chunks < 1 or n % chunks:
            raise InvalidBatch(f"batch size ({n}) is not a multiple of chunks ({chunks})")
        if not 0 <= rank < chunks:
            raise InvalidBatch(f"rank {rank} out of range for {chunks} chunks")
        per = n // chunks
        return self._select(range(rank * per, (rank + 1) * per), SlicedDataDict)

    def reorder_data(self, reorded_indices: Sequence[int] | torch.Tensor) -> None:
        """Reorder rows in place: row ``j`` moves to the position of key ``reorded_indices[j]``.

        Rows are sorted by their keys (stable), so with the ``unsorted_indices``
        returned by ``shard_by_batch_size`` / ``shard_meta_for_dp`` this restores
        the original order.

        >>> b = BatchedDataDict({"x": torch.tensor([30, 10, 20]), "y": ["c", "a", "b"]})
        >>> b.reorder_data([2, 0, 1])
        >>> b["x"], b["y"]
        (tensor([10, 20, 30]), ['a', 'b', 'c'])
        """
        keys = (
            reorded_indices.tolist()
            if isinstance(reorded_indices, torch.Tensor)
            else list(reorded_indices)
        )
        n = _batch_size_of(self.data)
        if len(keys) != n:
            raise InvalidBatch(f"reorder_data got {len(keys)} indices for a batch of {n}")
        order = sorted(range(n), key=lambda j: keys[j])
        for k, v in list(self.data.items()):
            self.data[k] = _take(v, order, k)

    def shard_by_batch_size(
        self,
        shards: int,
        batch_size: int | None = None,
        allow_uneven_shards: bool = False,
        dynamic_batching_args: DynamicBatchingArgs | None = None,
        sequence_packing_args: SequencePackingArgs | None = None,
        *,
        dynamic_batching_cfg: DynamicBatchingArgs | None = None,
    ) -> list[SlicedDataDict] | tuple[list[SlicedDataDict], list[int]]:
        """Shards a batch by first dividing it into chunks of size batch_size, then further dividing each chunk into shards equal parts. Finally aggregates the sub-shards by their position.

        If batch_size is None, there will be no chunking beforehand (will default to the total batch size).

        For example, with data [A A B B C C D D], batch_size=2, shards=2:
        - Element 0: [A B C D] (first elements from each chunk)
        - Element 1: [A B C D] (second elements from each chunk)

        Args:
            shards: the number of shards to divide each batch_size chunk into.
            batch_size: the size of each initial chunk (one optimizer step).
            allow_uneven_shards: let the last shards be smaller (without batch_size).
            dynamic_batching_args: sort each chunk by length, deal it out strided
                over shards and cut microbatches of at most max_tokens_per_microbatch
                padded tokens. Keys: max_tokens_per_microbatch, sequence_length_round,
                input_key, input_lengths_key (the sequence dim is 1).
                ``dynamic_batching_cfg`` is accepted as the older name.
            sequence_packing_args: pack each chunk into bins (microbatches) of at
                most max_tokens_per_microbatch tokens, an equal number per shard,
                balanced over shards. Keys: max_tokens_per_microbatch, input_key,
                input_lengths_key, algorithm, and optionally
                sequence_length_pad_multiple (1), min_bin_count, bin_count_multiple,
                seed, microbatch_order ("packer", the default: each shard's
                microbatches in the packer's bin order; "largest_first": by
                descending token count). Mutually exclusive with
                dynamic_batching_args.

        Returns:
            The list of ``shards`` SlicedDataDicts; with dynamic batching or
            packing, ``(shards, unsorted_indices)`` where ``unsorted_indices``
            restores the original order via ``reorder_data`` on the
            rank-ordered concatenation of the shards' rows.

        Examples:
        ```{doctest}
        >>> from dataplane_client.batching.batched_data_dict import BatchedDataDict
        >>> # Create a batch of two message logs with different lengths
        >>> batch = BatchedDataDict({
        ...     'problem_id': [0, 0, 1, 1, 2, 2, 3, 3],
        ...     'arbitrary_data': [1, 2, 3, 4, 5, 6, 7, 8]
        ... })
        >>> shards = batch.shard_by_batch_size(shards=2)
        >>> shards
        [{'problem_id': [0, 0, 1, 1], 'arbitrary_data': [1, 2, 3, 4]}, {'problem_id': [2, 2, 3, 3], 'arbitrary_data': [5, 6, 7, 8]}]
        >>> # Now say that I'm training with a GBS of 4 and I want to take gradients steps on problems 0 and 1 before 2 and 3 (problems are repeated because GRPO)
        >>> # In the current case, problems 0 and 2 will be trained on first since they're the first elements in each DP rank's batch.
        >>> # So, we'll use the batch_size argument to split the batch into chunks of size 4 first.
        >>> shards = batch.shard_by_batch_size(shards=2, batch_size=4)
        >>> shards
        [{'problem_id': [0, 0, 2, 2], 'arbitrary_data': [1, 2, 5, 6]}, {'problem_id': [1, 1, 3, 3], 'arbitrary_data': [3, 4, 7, 8]}]
        >>> # Now, the ranks have 0 and 1 first so when they split their batches into microbatches (of size 2 since GBS=4 and DP=2), they'll train on 0 and 1 first.
        >>> # Another way to use this function is with the 'allow_uneven_shards' flag, which allows the last shard to be smaller than the others when necessary.
        >>> # This is necessary in multi-turn rollouts when some sequences terminate early, leaving unclean batch sizes.
        >>> batch = BatchedDataDict({
        ...     'problem_id': [0, 1, 2, 3, 4],
        ...     'arbitrary_data': [10, 11, 12, 13, 14]
        ... })
        >>> shards = batch.shard_by_batch_size(shards=2, allow_uneven_shards=True)
        >>> shards
        [{'problem_id': [0, 1, 2], 'arbitrary_data': [10, 11, 12]}, {'problem_id': [3, 4], 'arbitrary_data': [13, 14]}]
        >>> # This is incompatible with the batch_size argument
        ```
        """
        if dynamic_batching_cfg is not None:
            if dynamic_batching_args is not None:
                raise InvalidBatch("pass dynamic_batching_args or dynamic_batching_cfg, not both")
            dynamic_batching_args = dynamic_batching_cfg
        if dynamic_batching_args is not None and sequence_packing_args is not None:
            raise InvalidBatch(
                "dynamic_batching_args and sequence_packing_args are mutually exclusive; pass one"
            )
        n = _batch_size_of(self.data)
        args = dynamic_batching_args if dynamic_batching_args is not None else sequence_packing_args
        what = (
            "dynamic_batching_args"
            if dynamic_batching_args is not None
            else "sequence_packing_args"
        )
        lengths = None
        cap = None
        if args is not None:
            for key_name in ("input_key", "input_lengths_key"):
                if key_name not in args:
                    raise InvalidBatch(f"{what} is missing required key {key_name!r}")
                if args[key_name] not in self.data:
                    raise InvalidBatch(
                        f"{what}[{key_name!r}] names {args[key_name]!r}, which is not in the batch "
                        f"(keys: {list(self.data)})",
                        fields=[args[key_name]],
                    )
            lengths = _as_int_list(self.data[args["input_lengths_key"]], args["input_lengths_key"])
            inputs = self.data[args["input_key"]]
            if isinstance(inputs, torch.Tensor) and not inputs.is_nested and inputs.dim() >= 2:
                cap = inputs.size(1)  # a microbatch can't be longer than the padded input
        plan = plan_dp_shards(
            n,
            lengths,
            shards=shards,
            batch_size=batch_size,
            allow_uneven_shards=allow_uneven_shards,
            dynamic_batching_args=dynamic_batching_args,
            sequence_packing_args=sequence_packing_args,
            seq_len_cap=cap,
        )
        out = []
        for r, rows in enumerate(plan.rank_rows):
            shard = self._select(rows, SlicedDataDict)
            if plan.micro_batch_indices is not None:
                assert plan.micro_batch_lengths is not None  # planned together with the indices
                shard.micro_batch_indices = plan.micro_batch_indices[r]
                shard.micro_batch_lengths = plan.micro_batch_lengths[r]
            if plan.elem_counts_per_gb is not None:
                shard.elem_counts_per_gb = plan.elem_counts_per_gb[r]
            out.append(shard)
        if args is None:
            return out
        return out, plan.unsorted_indices

    def get_batch(self, batch_idx: int, batch_size: int | None = None) -> SlicedDataDict:
        """The ``batch_idx``-th global-batch part of this shard.

        With ``elem_counts_per_gb`` (sequence packing) the parts have those row
        counts and ``batch_size`` is ignored; otherwise rows
        ``[batch_size * batch_idx, batch_size * (batch_idx + 1))``. The matching
        entry of the microbatch metadata comes along.
        """
        if self.elem_counts_per_gb is not None:
            if self.micro_batch_indices is None or self.micro_batch_lengths is None:
                raise InvalidBatch("elem_counts_per_gb is set without micro_batch_indices")
            if not 0 <= batch_idx < len(self.elem_counts_per_gb):
                raise InvalidBatch(
                    f"batch_idx {batch_idx} out of range for {len(self.elem_counts_per_gb)} batches"
                )
            start = sum(self.elem_counts_per_gb[:batch_idx])
            count = self.elem_counts_per_gb[batch_idx]
            batch = self.slice(start, start + count)
            batch.micro_batch_indices = [self.micro_batch_indices[batch_idx]]
            batch.micro_batch_lengths = [self.micro_batch_lengths[batch_idx]]
            batch.elem_counts_per_gb = [count]
            return batch
        if batch_size is None:
            raise InvalidBatch("get_batch needs batch_size unless elem_counts_per_gb is set")
        batch = self.slice(batch_size * batch_idx, batch_size * (batch_idx + 1))
        if self.micro_batch_indices is not None:
            batch.micro_batch_indices = [self.micro_batch_indices[batch_idx]]
            if self.micro_batch_lengths is not None:
                batch.micro_batch_lengths = [self.micro_batch_lengths[batch_idx]]
        return batch

    def slice(self, start: int, end: int) -> SlicedDataDict:
        """Rows ``[start, end)`` (dense tensors are views).

        >>> BatchedDataDict({"x": torch.arange(5), "y": list("abcde")}).slice(1, 3)
        {'x': tensor([1, 2]), 'y': ['b', 'c']}
        """
        n = _batch_size_of(self.data)
        if not 0 <= start <= end <= n:
            raise InvalidBatch(f"slice [{start}, {end}) is out of range for a batch of {n}")
        out = SlicedDataDict()
        for k, v in self.data.items():
            out[k] = _cut(v, start, end)
        return out

    def repeat_interleave(self, num_repeats: int) -> BatchedDataDict:
        """A new batch with every row repeated ``num_repeats`` times: [a, b] -> [a, a, b, b].

        {"key": torch.tensor([1, 2, 3]), "other_key": [1, 2, 3]} ->
        {"key": torch.tensor([1, 1, 2, 2, 3, 3]), "other_key": [1, 1, 2, 2, 3, 3]}
        (list items are deep-copied).
        """
        out = type(self)()
        for k, v in self.data.items():
            if isinstance(v, torch.Tensor):
                out[k] = v.repeat_interleave(num_repeats, dim=0)
            else:
                out[k] = [deepcopy(x) for x in v for _ in range(num_repeats)]
        return out

    def truncate_tensors(self, dim: int, truncated_len: int) -> None:
        """Keep the first ``truncated_len`` entries along ``dim`` of every tensor that has ``dim``."""
        for k, v in list(self.data.items()):
            if isinstance(v, torch.Tensor) and not v.is_nested and v.dim() >= dim + 1:
                self.data[k] = torch.narrow(v, dim, 0, min(truncated_len, v.size(dim)))

    # ---- microbatches ---------------------------------------------------------
    def _single_chunk_plan(self, what: str) -> tuple[list[list[int]], list[int]]:
        if (
            self.micro_batch_indices is None
            or self.micro_batch_lengths is None
            or len(self.micro_batch_indices) != 1
        ):
            raise InvalidBatch(
                f"{what} needs micro_batch_indices/lengths for exactly one global batch "
                "(shard with dynamic batching or sequence packing, then get_batch)"
            )
        indices, lengths = self.micro_batch_indices[0], self.micro_batch_lengths[0]
        if len(indices) != len(lengths):
            raise InvalidBatch(
                f"{len(indices)} micro_batch_indices but {len(lengths)} micro_batch_lengths"
            )
        return indices, lengths

    def make_microbatch_iterator_with_dynamic_shapes(
        self, sequence_dim: int = 1
    ) -> Iterator[SlicedDataDict]:
        """Yield the dynamic-batching microbatches, each truncated to its sequence length."""
        indices, lengths = self._single_chunk_plan("make_microbatch_iterator_with_dynamic_shapes")
        for seqlen, (start, end) in zip(lengths, indices, strict=True):
            mb = self.slice(start, end)
            mb.truncate_tensors(dim=sequence_dim, truncated_len=seqlen)
            yield mb

    def get_microbatch_iterator_dynamic_shapes_len(self) -> int:
        """How many microbatches make_microbatch_iterator_with_dynamic_shapes yields."""
        return len(self._single_chunk_plan("get_microbatch_iterator_dynamic_shapes_len")[0])

    def make_microbatch_iterator_for_packable_sequences(self) -> Iterator[SlicedDataDict]:
        """Yield one SlicedDataDict per packed bin (rows ``micro_batch_indices[0][j]``)."""
        indices, _ = self._single_chunk_plan("make_microbatch_iterator_for_packable_sequences")
        for start, end in indices:
            yield self.slice(start, end)

    def get_microbatch_iterator_for_packable_sequences_len(self) -> tuple[int, int]:
        """(number of bins, largest bin's token total)."""
        indices, lengths = self._single_chunk_plan(
            "get_microbatch_iterator_for_packable_sequences_len"
        )
        return len(indices), max(lengths, default=0)

    def make_microbatch_iterator(self, microbatch_size: int) -> Iterator[SlicedDataDict]:
        """Yield consecutive microbatches of ``microbatch_size`` rows (must divide the size)."""
        n = self.size
        if microbatch_size < 1 or n % microbatch_size:
            raise InvalidBatch(
                f"data dict size ({n}) is not a multiple of the microbatch size ({microbatch_size})"
            )
        for i in range(0, n, microbatch_size):
            yield self.slice(i, i + microbatch_size)

    # ---- misc -----------------------------------------------------------------
    @property
    def size(self) -> int:
        """Rows in the batch (the first column's length; 0 when empty)."""
        if not self.data:
            return 0
        return _rows(next(iter(self.data.values())))

    def to(self, device: str | torch.device) -> BatchedDataDict:
        """Move every tensor to ``device`` (in place); returns self."""
        for k, v in self.data.items():
            if isinstance(v, torch.Tensor):
                self.data[k] = v.to(device)
        return self

    def select_indices(self, indices: Sequence[int] | torch.Tensor) -> BatchedDataDict:
        """A new batch of the rows at ``indices``, in that order.

        >>> BatchedDataDict({"x": torch.tensor([5, 6, 7]), "y": [5, 6, 7]}).select_indices([2, 0])
        {'x': tensor([7, 5]), 'y': [7, 5]}
        """
        if isinstance(indices, torch.Tensor):
            indices = indices.tolist()
        return self._select(indices, type(self))

    def _select(self, indices: Sequence[int], cls: type) -> Any:
        idx = [int(i) for i in indices]
        n = _batch_size_of(self.data)
        bad = [i for i in idx if not -n <= i < n]
        if bad:
            raise InvalidBatch(f"row indices {bad[:10]} out of range for a batch of {n}")
        out = cls()
        for k, v in self.data.items():
            out[k] = _take(v, idx, k)
        return out

    def get_dict(self) -> dict[str, Any]:
        """The underlying dict (not a copy)."""
        return self.data


class SlicedDataDict(BatchedDataDict):
    """A slice or shard of a larger batch (a distinct type, same behaviour)."""
