"""``seqlen_balanced``: a batch whose data-parallel shards carry near-equal token sums.

The batch is the oldest ``batch_size`` ready rows (so every row is handed out
in turn, as with ``sequential``), reordered so that cutting it into
``dp_size`` contiguous shards, as ``shard_meta_for_dp`` does, gives each rank
about the same number of tokens: no rank waits on one that drew the long
sequences. A full batch must divide into ``dp_size`` equal shards; a shorter
one (a partition's tail, or ``blocking=False``) is balanced over the shards
``shard_meta_for_dp(..., allow_uneven_shards=True)`` cuts it into. A row with
no recorded length counts as 0 tokens.

Option: ``dp_size`` (int >= 1), at registration or per claim.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from dataplane_client.wire.errors import InvalidBatch
from dataplane_server.core.claim_policies.base import (
    PartitionTraits,
    ReadyRows,
    only_options,
    positive_int,
    register,
)

NAME = "seqlen_balanced"


def shard_sizes(n: int, shards: int) -> list[int]:
    """Sizes of the contiguous shards ``shard_meta_for_dp`` cuts ``n`` rows into: equal when
    ``shards`` divides ``n``, else blocks of ceil(n / shards), the last shorter or empty."""
    if n % shards == 0:
        return [n // shards] * shards
    block = -(-n // shards)
    return [max(min(block, n - r * block), 0) for r in range(shards)]


def balanced_shards(lengths: np.ndarray, sizes: list[int]) -> list[list[int]]:
    """Split positions ``0..len(lengths)-1`` into shards of exactly ``sizes`` with near-equal
    length sums: longest first to the lightest shard with room, then swaps between the
    heaviest shard and another while a swap lowers the larger of the two."""
    order = np.argsort(-lengths, kind="stable").tolist()
    shards: list[list[int]] = [[] for _ in sizes]
    loads = [0] * len(sizes)
    for i in order:
        r = min((r for r in range(len(sizes)) if len(shards[r]) < sizes[r]), key=loads.__getitem__)
        shards[r].append(i)
        loads[r] += int(lengths[i])
    for _ in range(4 * len(lengths) + 16):  # each swap lowers the pair's max: bounded anyway
        hi = max(range(len(sizes)), key=loads.__getitem__)
        best = None  # (new max of the pair, index in hi, other shard, index in it)
        hi_lens = lengths[shards[hi]]
        for lo in range(len(sizes)):
            gap = loads[hi] - loads[lo]
            if lo == hi or gap <= 0 or not shards[lo] or not shards[hi]:
                continue
            delta = hi_lens[:, None] - lengths[shards[lo]][None, :]
            pair_max = np.where(
                (delta > 0) & (delta < gap),
                np.maximum(loads[hi] - delta, loads[lo] + delta),
                np.iinfo(np.int64).max,
            )
            a, b = (int(x) for x in np.unravel_index(int(np.argmin(pair_max)), pair_max.shape))
            new_max = int(pair_max[a, b])
            if new_max < loads[hi] and (best is None or new_max < best[0]):
                best = (new_max, a, lo, b)
        if best is None:
            break
        _, a, lo, b = best
        moved = int(lengths[shards[hi][a]] - lengths[shards[lo][b]])
        shards[hi][a], shards[lo][b] = shards[lo][b], shards[hi][a]
        loads[hi] -= moved
        loads[lo] += moved
    return [sorted(s) for s in shards]  # commit order within a shard


@register(NAME)
class SeqlenBalanced:
    def check_options(self, options: Mapping[str, Any], traits: PartitionTraits) -> dict:
        only_options(NAME, options, ("dp_size",))
        return {"dp_size": positive_int(NAME, options, "dp_size")}

    def choose(self, ready: ReadyRows, batch_size: int, options: Mapping[str, Any]) -> np.ndarray:
        dp_size = options["dp_size"]
        if batch_size % dp_size:
            raise InvalidBatch(
                f"claim policy {NAME!r}: batch_size {batch_size} is not a multiple of "
                f"dp_size {dp_size}, so its shards cannot be equal"
            )
        n = min(batch_size, len(ready))
        lengths = np.maximum(ready.sequence_lengths[:n], 0)
        shards = balanced_shards(lengths, shard_sizes(n, dp_size))
        return np.asarray([i for shard in shards for i in shard], dtype=np.int64)
