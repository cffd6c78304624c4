"""Data-parallel split planning, on sequence lengths only.

:func:`plan_dp_shards` decides which rows go to which DP rank, in which order,
and (for dynamic batching / sequence packing) how each rank's rows form
microbatches. It sees lengths, never tensors, so the same plan serves two
callers:

- ``BatchedDataDict.shard_by_batch_size`` applies it to real tensors;
- :func:`shard_meta_for_dp` applies it to a :class:`KVBatchMeta` (key lists
  only), so the driver can split a batch it never holds; each worker then
  fetches exactly its own rows from the store.

Both therefore give the same split by construction.

Order contract. ``ShardPlan.unsorted_indices`` is the concatenation of the
per-rank row lists in rank order: entry ``j`` is the *original* position of
the ``j``-th row of the rank-ordered concatenation. ``reorder_data`` sorts rows
by these keys, so applying it to the gathered per-rank results restores the
original order.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

from dataplane_client.batching.packing import assign_bins_to_ranks, get_packer
from dataplane_client.wire.errors import InvalidBatch
from dataplane_client.wire.meta import KVBatchMeta

# extra_info keys of a per-rank meta
MICRO_BATCH_INDICES = "micro_batch_indices"
MICRO_BATCH_LENGTHS = "micro_batch_lengths"
ELEM_COUNTS_PER_GB = "elem_counts_per_gb"
GLOBAL_FORWARD_PAD_SEQLEN = "global_forward_pad_seqlen"
PACKING_KEYS = (MICRO_BATCH_INDICES, MICRO_BATCH_LENGTHS, ELEM_COUNTS_PER_GB)


# How a rank's packed microbatches are ordered: as the packer made them (its bin
# order), or by descending token count (ties in packer order).
MICROBATCH_ORDERS = ("packer", "largest_first")


class DynamicBatchingArgs(TypedDict):
    """Dynamic batching: variable-size microbatches of at most max_tokens_per_microbatch (padded) tokens."""

    max_tokens_per_microbatch: int  # tokens in a microbatch, padding included
    sequence_length_round: int  # a microbatch's sequence length is rounded up to this multiple
    input_key: str  # the field holding input ids (its padded width caps microbatch lengths)
    input_lengths_key: str  # the field holding each sample's sequence length


class _SequencePackingRequired(TypedDict):
    max_tokens_per_microbatch: int  # capacity of one packed bin (tokens)
    input_key: str
    input_lengths_key: str
    algorithm: str  # a dataplane_client.batching.packing.PackingAlgorithm (or its name)


class SequencePackingArgs(_SequencePackingRequired, total=False):
    """Sequence packing: samples concatenated into bins of at most max_tokens_per_microbatch tokens."""

    sequence_length_pad_multiple: int  # each sample's length rounded up to this (default 1)
    min_bin_count: int  # at least this many bins per batch_size chunk (default: the shard count)
    bin_count_multiple: int  # bins per chunk are a multiple of lcm(this, shards) (default 1)
    seed: int  # for first_fit_shuffle (default 0)
    microbatch_order: str  # "packer" (default) or "largest_first": a rank's microbatch order


@dataclass
class ShardPlan:
    """Which original rows each rank holds, in order, plus its microbatch layout.

    ``micro_batch_indices[r][c]`` lists ``[start, end)`` row ranges for rank
    ``r``'s part of chunk ``c`` (positions count from the start of that part);
    ``micro_batch_lengths[r][c]`` the matching token lengths (dynamic
    batching: the padded sequence length of the microbatch; packing: the
    bin's padded token total); ``elem_counts_per_gb[r][c]`` (packing only) how
    many rows rank ``r`` holds for chunk ``c``.
    """

    rank_rows: list[list[int]]
    micro_batch_indices: list[list[list[list[int]]]] | None = None
    micro_batch_lengths: list[list[list[int]]] | None = None
    elem_counts_per_gb: list[list[int]] | None = None

    @property
    def unsorted_indices(self) -> list[int]:
        return [i for rows in self.rank_rows for i in rows]


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _positive_int(args: Mapping[str, Any], key: str, what: str, default: int | None = None) -> int:
    if key not in args or args[key] is None:
        if default is None:
            raise InvalidBatch(f"{what} is missing required key {key!r} (got keys {sorted(args)})")
        return default
    v = args[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise InvalidBatch(f"{what}[{key!r}] must be an int >= 1, got {v!r}")
    return v


def _check_lengths(lengths: Sequence[int] | None, num_rows: int, mode: str) -> list[int]:
    if lengths is None:
        raise InvalidBatch(f"{mode} needs per-sample sequence lengths, but none were given")
    out = [int(x) for x in lengths]
    if len(out) != num_rows:
        raise InvalidBatch(f"got {len(out)} sequence lengths for {num_rows} rows")
    bad = [i for i, x in enumerate(out) if x < 0]
    if bad:
        raise InvalidBatch("negative sequence lengths", ids=bad)
    return out


def plan_dp_shards(
    num_rows: int,
    lengths: Sequence[int] | None = None,
    *,
    shards: int,
    batch_size: int | None = None,
    allow_uneven_shards: bool = False,
    dynamic_batching_args: DynamicBatchingArgs | dict[str, Any] | None = None,
    sequence_packing_args: SequencePackingArgs | dict[str, Any] | None = None,
    seq_len_cap: int | None = None,
) -> ShardPlan:
    """Plan the DP split of ``num_rows`` rows (see the module docstring).

    The batch is cut into chunks of ``batch_size`` rows (one optimizer step
    each; ``None`` = one chunk); each chunk is split over ``shards`` ranks and
    rank ``r`` holds its part of chunk 0, then of chunk 1, ...

    - plain: rank ``r`` gets the ``r``-th contiguous block of every chunk
      (``allow_uneven_shards``: blocks of ``ceil(batch/shards)``, the last ones
      shorter or empty; only without ``batch_size``).
    - dynamic batching: each chunk is sorted by length and dealt out strided
      (rank ``r`` gets sorted positions ``r, r+shards, ...``); microbatches are
      cut jointly over ranks so every rank has the same microbatch layout.
      ``seq_len_cap`` caps a microbatch's rounded length (the padded width of
      the input tensor; ``None`` = the longest length).
    - sequence packing: each chunk is packed into bins (a multiple of
      ``shards`` bins), bins are spread over ranks with equal counts and
      balanced token totals, and a rank's rows are ordered bin by bin. Shard
      sizes follow the bins, so ``batch_size`` need not divide by ``shards``.
    """
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise InvalidBatch(f"shards must be an int >= 1, got {shards!r}")
    if dynamic_batching_args is not None and sequence_packing_args is not None:
        raise InvalidBatch(
            "dynamic_batching_args and sequence_packing_args are mutually exclusive; pass one"
        )
    if num_rows <= 0:
        raise InvalidBatch("cannot shard an empty batch")
    if allow_uneven_shards and batch_size is not None:
        raise InvalidBatch("batch_size must be None when allow_uneven_shards is True")
    if allow_uneven_shards and dynamic_batching_args is not None:
        raise InvalidBatch("allow_uneven_shards is not supported with dynamic_batching_args")
    if batch_size is None:
        batch_size = num_rows
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidBatch(f"batch_size must be an int >= 1 or None, got {batch_size!r}")
    if num_rows % batch_size:
        raise InvalidBatch(
            f"total batch size ({num_rows}) is not a multiple of batch_size ({batch_size})"
        )
    if not allow_uneven_shards and sequence_packing_args is None and batch_size % shards:
        raise InvalidBatch(
            f"batch size ({batch_size}) is not a multiple of shards ({shards}); "
            "pass allow_uneven_shards=True (without batch_size) to accept uneven shards"
        )
    num_chunks = num_rows // batch_size

    if dynamic_batching_args is not None:
        lens = _check_lengths(lengths, num_rows, "dynamic batching")
        return _plan_dynamic(
            lens, shards, batch_size, num_chunks, dynamic_batching_args, seq_len_cap
        )
    if sequence_packing_args is not None:
        lens = _check_lengths(lengths, num_rows, "sequence packing")
        return _plan_packing(lens, shards, batch_size, num_chunks, sequence_packing_args)

    shard_size = -(-batch_size // shards) if allow_uneven_shards else batch_size // shards
    rank_rows: list[list[int]] = [[] for _ in range(shards)]
    for r in range(shards):
        for c in range(num_chunks):
            start = c * batch_size + r * shard_size
            end = start + shard_size
            if allow_uneven_shards:
                start, end = min(start, num_rows), min(end, num_rows)
            rank_rows[r].extend(range(start, end))
    return ShardPlan(rank_rows)


def _plan_dynamic(
    lens: list[int],
    shards: int,
    batch_size: int,
    num_chunks: int,
    args: Mapping[str, Any],
    seq_len_cap: int | None,
) -> ShardPlan:
    what = "dynamic_batching_args"
    max_tokens = _positive_int(args, "max_tokens_per_microbatch", what)
    round_to = _positive_int(args, "sequence_length_round", what)
    cap = max(lens) if seq_len_cap is None else int(seq_len_cap)
    shard_size = batch_size // shards

    rank_rows: list[list[int]] = [[] for _ in range(shards)]
    for c in range(num_chunks):
        base = c * batch_size
        order = sorted(range(base, base + batch_size), key=lambda i: lens[i])  # stable
        for r in range(shards):
            rank_rows[r].extend(order[r::shards])

    mb_indices: list[list[list[int]]] = []
    mb_lengths: list[list[int]] = []
    for c in range(num_chunks):
        chunk_idx: list[list[int]] = [[0, 0]]
        chunk_len: list[int] = [0]
        mb_max = 0
        for p in range(shard_size):
            # the longest sample at this position over all ranks sets the shape,
            # so every rank cuts its microbatches at the same positions
            longest = max(lens[rank_rows[r][c * shard_size + p]] for r in range(shards))
            seqlen = min(_round_up(longest, round_to), cap)
            if seqlen > max_tokens:
                raise InvalidBatch(
                    f"a sample of padded (to {round_to}) sequence length {seqlen} exceeds "
                    f"max_tokens_per_microbatch={max_tokens}",
                    ids=[rank_rows[r][c * shard_size + p] for r in range(shards)],
                )
            cur = chunk_idx[-1]
            mb_max = max(mb_max, seqlen)
            if (cur[1] - cur[0] + 1) * mb_max <= max_tokens:
                cur[1] += 1
                chunk_len[-1] = mb_max
            else:
                chunk_idx.append([p, p + 1])
                mb_max = seqlen
                chunk_len.append(mb_max)
        mb_indices.append(chunk_idx)
        mb_lengths.append(chunk_len)

    return ShardPlan(
        rank_rows,
        micro_batch_indices=[copy.deepcopy(mb_indices) for _ in range(shards)],
        micro_batch_lengths=[copy.deepcopy(mb_lengths) for _ in range(shards)],
    )


def _plan_packing(
    lens: list[int],
    shards: int,
    batch_size: int,
    num_chunks: int,
    args: Mapping[str, Any],
) -> ShardPlan:
    what = "sequence_packing_args"
    capacity = _positive_int(args, "max_tokens_per_microbatch", what)
    pad_multiple = _positive_int(args, "sequence_length_pad_multiple", what, default=1)
    if "algorithm" not in args:
        raise InvalidBatch(f"{what} is missing required key 'algorithm' (got keys {sorted(args)})")
    min_bins = args.get("min_bin_count") or 0
    if isinstance(min_bins, bool) or not isinstance(min_bins, int) or min_bins < 0:
        raise InvalidBatch(f"{what}['min_bin_count'] must be an int >= 0, got {min_bins!r}")
    multiple = _positive_int(args, "bin_count_multiple", what, default=1)
    packer = get_packer(
        args["algorithm"],
        capacity,
        min_bin_count=max(min_bins, shards),
        bin_count_multiple=multiple * shards // math.gcd(multiple, shards),
        seed=int(args.get("seed") or 0),
    )
    order = args.get("microbatch_order", "packer")
    if order not in MICROBATCH_ORDERS:
        raise InvalidBatch(
            f"{what}['microbatch_order'] must be one of {list(MICROBATCH_ORDERS)}, got {order!r}"
        )

    padded = [_round_up(x, pad_multiple) for x in lens]
    too_long = [i for i, x in enumerate(padded) if x > capacity]
    if too_long:
        i = too_long[0]
        raise InvalidBatch(
            f"sample {i} has sequence length {lens[i]} (padded to {padded[i]}), longer than "
            f"max_tokens_per_microbatch={capacity}",
            ids=too_long,
        )

    rank_rows: list[list[int]] = [[] for _ in range(shards)]
    mb_indices: list[list[list[list[int]]]] = [[] for _ in range(shards)]
    mb_lengths: list[list[list[int]]] = [[] for _ in range(shards)]
    elem_counts: list[list[int]] = [[] for _ in range(shards)]
    for c in range(num_chunks):
        base = c * batch_size
        chunk = padded[base : base + batch_size]
        bins = packer.pack(chunk)
        totals = [sum(chunk[i] for i in b) for b in bins]
        for r, rank_bins in enumerate(assign_bins_to_ranks(totals, shards)):
            if order == "largest_first":
                rank_bins = sorted(rank_bins, key=lambda b: (-totals[b], b))
            else:
                rank_bins = sorted(rank_bins)
            ranges: list[list[int]] = []
            pos = 0
            for b in rank_bins:
                rank_rows[r].extend(base + i for i in bins[b])
                ranges.append([pos, pos + len(bins[b])])
                pos += len(bins[b])
            mb_indices[r].append(ranges)
            mb_lengths[r].append([totals[b] for b in rank_bins])
            elem_counts[r].append(pos)
    return ShardPlan(rank_rows, mb_indices, mb_lengths, elem_counts)


# ---- metas ------------------------------------------------------------------
def shard_meta_for_dp(
    meta: KVBatchMeta,
    *,
    dp_world: int,
    batch_size: int | None = None,
    sequence_packing_args: SequencePackingArgs | dict[str, Any] | None = None,
    dynamic_batching_args: DynamicBatchingArgs | dict[str, Any] | None = None,
    allow_uneven_shards: bool = False,
) -> tuple[list[KVBatchMeta], list[int] | None]:
    """Split ``meta``'s sample ids over ``dp_world`` ranks. Pure: no I/O, ``meta`` is not changed.

    The split is exactly the one ``BatchedDataDict.shard_by_batch_size`` gives
    on the real data (both use :func:`plan_dp_shards`; the dynamic-batching
    length cap is the longest sequence, i.e. a batch padded to its longest
    row). Packing / dynamic batching need ``meta.sequence_lengths``. Each
    rank's ``extra_info`` carries ``micro_batch_indices`` /
    ``micro_batch_lengths`` (and ``elem_counts_per_gb`` for packing); stale
    copies of those keys inherited from ``meta`` are dropped.

    Returns ``(per_rank_metas, unsorted_indices)``: concatenating the per-rank
    ``sample_ids`` in rank order and calling ``reorder_data(unsorted_indices)``
    on rows in that order restores ``meta.sample_ids`` order;
    ``unsorted_indices`` is ``None`` exactly when that order already is the
    original one.
    """
    if not isinstance(meta, KVBatchMeta):
        raise InvalidBatch(f"shard_meta_for_dp needs a KVBatchMeta, got {type(meta).__name__}")
    lengths = meta.sequence_lengths
    if (sequence_packing_args is not None or dynamic_batching_args is not None) and lengths is None:
        mode = "sequence packing" if sequence_packing_args is not None else "dynamic batching"
        raise InvalidBatch(
            f"{mode} needs meta.sequence_lengths, but this meta has none",
            partition_id=meta.partition_id,
        )
    plan = plan_dp_shards(
        meta.size,
        lengths,
        shards=dp_world,
        batch_size=batch_size,
        allow_uneven_shards=allow_uneven_shards,
        dynamic_batching_args=dynamic_batching_args,
        sequence_packing_args=sequence_packing_args,
    )
    metas: list[KVBatchMeta] = []
    for r, rows in enumerate(plan.rank_rows):
        m = meta.subset(rows)
        for k in PACKING_KEYS:
            m.extra_info.pop(k, None)
        if plan.micro_batch_indices is not None:
            assert plan.micro_batch_lengths is not None  # planned together with the indices
            m.extra_info[MICRO_BATCH_INDICES] = plan.micro_batch_indices[r]
            m.extra_info[MICRO_BATCH_LENGTHS] = plan.micro_batch_lengths[r]
        if plan.elem_counts_per_gb is not None:
            m.extra_info[ELEM_COUNTS_PER_GB] = plan.elem_counts_per_gb[r]
        metas.append(m)
    unsorted = plan.unsorted_indices
    if unsorted == list(range(meta.size)):
        return metas, None
    return metas, unsorted


def global_forward_pad_seqlen(metas: Sequence[KVBatchMeta], multiple: int = 1) -> int:
    """The longest sequence over all ``metas``, rounded up to ``multiple`` (0 when there are none).

    The driver stamps it into every per-rank meta's
    ``extra_info[GLOBAL_FORWARD_PAD_SEQLEN]`` so all ranks pad to one length.
    """
    if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
        raise InvalidBatch(f"multiple must be an int >= 1, got {multiple!r}")
    longest = 0
    for m in metas:
        if m.sequence_lengths is None:
            raise InvalidBatch(
                "global_forward_pad_seqlen needs sequence_lengths on every meta",
                partition_id=m.partition_id,
            )
        longest = max([longest, *m.sequence_lengths])
    return _round_up(longest, multiple)
