"""Sequence packing: put samples into token-capacity bins, then bins onto DP ranks.

A *bin* is one packed microbatch: a list of sample indices whose (padded)
lengths sum to at most ``capacity`` tokens. As NeMo-RL exposes it, a
:class:`PackingAlgorithm` and its constraints give a packer
(:func:`get_packer`) whose ``pack(lengths)`` returns the bins. Underneath,
every algorithm is a function with the same signature::

    fn(lengths, capacity, *, min_bin_count=0, bin_count_multiple=1, seed=0) -> list[list[int]]

and the same guarantees:

- every index ``0..len(lengths)-1`` appears in exactly one bin;
- no bin holds more than ``capacity`` tokens;
- an item longer than ``capacity`` raises :class:`InvalidBatch` naming it;
- the number of bins is at least ``min_bin_count`` and a multiple of
  ``bin_count_multiple`` (the DP world size, so every rank gets the same number
  of microbatches and no rank waits at a collective the others never reach).

When the packer produced too few bins, the largest bins are *split* (their
items are shared between the old bin and a new one, so both stay within
capacity) until the count is reached. Only when every bin already holds a
single item -- i.e. there are fewer items than required bins -- are empty bins
appended; a rank that receives one runs an empty microbatch.

:func:`assign_bins_to_ranks` then hands the bins to ranks, and is our default
wherever packing is planned: equal bin counts per rank, per-rank token totals
balanced (greedy LPT under the equal-count constraint, then a local-swap
pass). :func:`round_robin_assign` is the naive baseline it is measured against.
"""

from __future__ import annotations

import bisect
import functools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from dataplane_client.wire.errors import InvalidBatch

PackFn = Callable[..., list[list[int]]]


# ---- shared helpers ---------------------------------------------------------
def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_constraints(capacity: int, min_bin_count: int, bin_count_multiple: int) -> None:
    if not _is_int(capacity) or capacity <= 0:
        raise InvalidBatch(f"bin capacity must be a positive int, got {capacity!r}")
    if not _is_int(min_bin_count) or min_bin_count < 0:
        raise InvalidBatch(f"min_bin_count must be an int >= 0, got {min_bin_count!r}")
    if not _is_int(bin_count_multiple) or bin_count_multiple < 1:
        raise InvalidBatch(f"bin_count_multiple must be an int >= 1, got {bin_count_multiple!r}")


def _validate(lengths: Sequence[int], capacity: int, min_bin_count: int, bin_count_multiple: int):
    _check_constraints(capacity, min_bin_count, bin_count_multiple)
    out = [int(x) for x in lengths]
    for i, x in enumerate(out):
        if x < 0:
            raise InvalidBatch(f"item {i} has negative length {x}", ids=[i])
        if x > capacity:
            raise InvalidBatch(
                f"item {i} has length {x}, longer than the bin capacity of {capacity} tokens",
                ids=[i],
            )
    return out


class _FirstFit:
    """First-fit bins with an O(log n) "leftmost bin with room >= x" query.

    A max-segment-tree over the bins' free space; unopened bins hold -1 so
    they are never chosen by the query.
    """

    def __init__(self, capacity: int, max_bins: int):
        self.capacity = capacity
        size = 1
        while size < max(1, max_bins):
            size *= 2
        self.size = size
        self.tree = [-1] * (2 * size)
        self.bins: list[list[int]] = []

    def _set(self, pos: int, free: int) -> None:
        i = pos + self.size
        self.tree[i] = free
        i //= 2
        while i:
            self.tree[i] = max(self.tree[2 * i], self.tree[2 * i + 1])
            i //= 2

    def add(self, item: int, length: int) -> None:
        if self.tree[1] >= length:
            i = 1
            while i < self.size:
                i = 2 * i if self.tree[2 * i] >= length else 2 * i + 1
            pos = i - self.size
        else:
            pos = len(self.bins)
            self.bins.append([])
            self._set(pos, self.capacity)
        self.bins[pos].append(item)
        self._set(pos, self.tree[pos + self.size] - length)


def _first_fit(order: Sequence[int], lengths: Sequence[int], capacity: int) -> list[list[int]]:
    ff = _FirstFit(capacity, len(order))
    for i in order:
        ff.add(i, lengths[i])
    return ff.bins


def _split_in_two(items: list[int], lengths: Sequence[int]) -> tuple[list[int], list[int]]:
    """Share ``items`` between two groups of near-equal token totals (LPT)."""
    a: list[int] = []
    b: list[int] = []
    ta = tb = 0
    for i in sorted(items, key=lambda i: (-lengths[i], i)):
        if (ta, len(a)) <= (tb, len(b)):  # item count breaks ties (zero-length items)
            a.append(i)
            ta += lengths[i]
        else:
            b.append(i)
            tb += lengths[i]
    return a, b


def _fit_bin_count(
    bins: list[list[int]], lengths: Sequence[int], min_bin_count: int, bin_count_multiple: int
) -> list[list[int]]:
    """Grow ``bins`` to a count >= min_bin_count that is a multiple of bin_count_multiple.

    Splits the bin with the most tokens (among bins holding >= 2 items) until
    the count is reached; empty bins are appended only when no bin can be
    split any more (fewer items than required bins).
    """
    target = max(len(bins), min_bin_count)
    target = -(-target // bin_count_multiple) * bin_count_multiple
    bins = [list(b) for b in bins]
    while len(bins) < target:
        best = -1
        best_tokens = -1
        for j, b in enumerate(bins):
            if len(b) >= 2:
                t = sum(lengths[i] for i in b)
                if t > best_tokens:
                    best, best_tokens = j, t
        if best < 0:
            bins.extend([] for _ in range(target - len(bins)))
            break
        a, b = _split_in_two(bins[best], lengths)
        bins[best] = a
        bins.append(b)
    return bins


# ---- algorithms ---------------------------------------------------------------
def _algorithm(pack: Callable[[list[int], int, int], list[list[int]]]) -> PackFn:
    """An algorithm's public form (the module docstring's signature and guarantees) around
    its core ``pack(lens, capacity, seed)``, which bins checked lengths: the lengths and
    constraints are checked first, the bin count fitted after (``_fit_bin_count``)."""

    @functools.wraps(pack, assigned=("__module__", "__name__", "__qualname__", "__doc__"))
    def algorithm(
        lengths: Sequence[int],
        capacity: int,
        *,
        min_bin_count: int = 0,
        bin_count_multiple: int = 1,
        seed: int = 0,
    ) -> list[list[int]]:
        lens = _validate(lengths, capacity, min_bin_count, bin_count_multiple)
        bins = pack(lens, capacity, seed)
        return _fit_bin_count(bins, lens, min_bin_count, bin_count_multiple)

    del algorithm.__wrapped__  # its signature is the public one, not the core's
    return algorithm


@_algorithm
def first_fit_decreasing(lens: list[int], capacity: int, seed: int) -> list[list[int]]:
    """Longest item first, each into the first bin with room (FFD).

    >>> first_fit_decreasing([3, 7, 2, 5, 1], 8)
    [[1, 4], [3, 0], [2]]
    """
    del seed  # deterministic
    order = sorted(range(len(lens)), key=lambda i: (-lens[i], i))
    return _first_fit(order, lens, capacity)


@_algorithm
def first_fit_shuffle(lens: list[int], capacity: int, seed: int) -> list[list[int]]:
    """First fit over the items in a seeded random order (same seed, same bins)."""
    order = list(range(len(lens)))
    random.Random(seed).shuffle(order)
    return _first_fit(order, lens, capacity)


@_algorithm
def concatenative(lens: list[int], capacity: int, seed: int) -> list[list[int]]:
    """Fill bins in input order: close the current bin when the next item does not fit.

    >>> concatenative([3, 4, 2, 5, 1], 8)
    [[0, 1], [2, 3, 4]]
    """
    del seed  # deterministic
    bins: list[list[int]] = []
    free = -1
    for i, x in enumerate(lens):
        if not bins or x > free:
            bins.append([])
            free = capacity
        bins[-1].append(i)
        free -= x
    return bins


def _pop_largest_fitting(pool: list[tuple[int, int]], room: int) -> tuple[int, int]:
    """Remove and return the largest (length, index) in ascending ``pool`` with length <= room.

    Callers check that the smallest item fits first, so one always does.
    """
    k = bisect.bisect_right(pool, (room, float("inf"))) - 1
    assert k >= 0, "caller checked that pool[0] fits"
    # among equal lengths take the lowest index, so results read naturally
    k = bisect.bisect_left(pool, (pool[k][0], -1))
    return pool.pop(k)


@_algorithm
def modified_first_fit_decreasing(lens: list[int], capacity: int, seed: int) -> list[list[int]]:
    """Johnson & Garey's MFFD (worst case 71/60 OPT + 1).

    Items are classed by size s against capacity C: large (s > C/2), medium
    (C/3 < s <= C/2), small (C/6 < s <= C/3), tiny (s <= C/6).

    1. Every large item opens its own bin, largest first.
    2. Forward through the large bins: if the smallest remaining medium item
       fits, place the largest medium item that fits.
    3. Backward through the large bins holding no medium item: if the two
       smallest remaining small items fit together, place the smallest small
       item, then the largest remaining small item that fits.
    4. Forward through the large bins: while the smallest remaining item of any
       class fits, place the largest remaining item that fits.
    5. First-fit-decreasing for everything left, into new bins.

    >>> modified_first_fit_decreasing([6, 3, 3, 1, 5, 2], 10)
    [[0, 1, 3], [4, 2, 5]]
    """
    del seed  # deterministic
    c = capacity
    large, medium, small, tiny = [], [], [], []
    for i, x in enumerate(lens):
        if 2 * x > c:
            large.append(i)
        elif 3 * x > c:
            medium.append(i)
        elif 6 * x > c:
            small.append(i)
        else:
            tiny.append(i)

    # 1. one bin per large item, largest first
    large.sort(key=lambda i: (-lens[i], i))
    bins = [[i] for i in large]
    room = [c - lens[i] for i in large]
    has_medium = [False] * len(bins)

    # pools are ascending lists of (length, index) so bisect finds "largest that fits"
    med_pool = sorted((lens[i], i) for i in medium)
    small_pool = sorted((lens[i], i) for i in small)

    # 2. forward: one medium item per large bin
    for b in range(len(bins)):
        if not med_pool or med_pool[0][0] > room[b]:
            continue
        x, i = _pop_largest_fitting(med_pool, room[b])
        bins[b].append(i)
        room[b] -= x
        has_medium[b] = True

    # 3. backward over large bins without a medium item: pairs of small items
    for b in reversed(range(len(bins))):
        if has_medium[b]:
            continue
        if len(small_pool) < 2 or small_pool[0][0] + small_pool[1][0] > room[b]:
            continue
        x, i = small_pool.pop(0)
        bins[b].append(i)
        room[b] -= x
        x, i = _pop_largest_fitting(small_pool, room[b])  # the old 2nd smallest fits
        bins[b].append(i)
        room[b] -= x

    # 4. forward: top up every large bin with the largest remaining item that fits
    pool = sorted(med_pool + small_pool + [(lens[i], i) for i in tiny])
    for b in range(len(bins)):
        while pool and pool[0][0] <= room[b]:
            x, i = _pop_largest_fitting(pool, room[b])
            bins[b].append(i)
            room[b] -= x

    # 5. FFD for the rest, into new bins (nothing left fits the large bins)
    rest = [i for _, i in sorted(pool, key=lambda p: (-p[0], p[1]))]
    bins.extend(_first_fit(rest, lens, c))
    return bins


class PackingAlgorithm(str, Enum):
    """The packing algorithms, by the names NeMo-RL's config uses."""

    CONCATENATIVE = "concatenative"
    FIRST_FIT_DECREASING = "first_fit_decreasing"
    FIRST_FIT_SHUFFLE = "first_fit_shuffle"
    MODIFIED_FIRST_FIT_DECREASING = "modified_first_fit_decreasing"


PACKING_ALGORITHMS: dict[PackingAlgorithm, PackFn] = {
    PackingAlgorithm.CONCATENATIVE: concatenative,
    PackingAlgorithm.FIRST_FIT_DECREASING: first_fit_decreasing,
    PackingAlgorithm.FIRST_FIT_SHUFFLE: first_fit_shuffle,
    PackingAlgorithm.MODIFIED_FIRST_FIT_DECREASING: modified_first_fit_decreasing,
}


@dataclass(frozen=True)
class SequencePacker:
    """One algorithm with its constraints fixed; :meth:`pack` maps lengths to bins.

    Build it with :func:`get_packer`, which checks the constraints once. An unset
    constraint stays ``None``, as NeMo-RL's packers keep it (it means none).
    """

    algorithm: PackingAlgorithm
    bin_capacity: int
    min_bin_count: int | None = None
    bin_count_multiple: int | None = None
    seed: int = 0

    def pack(self, lengths: Sequence[int]) -> list[list[int]]:
        """Bins of indices into ``lengths`` (see the module docstring for the guarantees)."""
        return PACKING_ALGORITHMS[self.algorithm](
            lengths,
            self.bin_capacity,
            min_bin_count=0 if self.min_bin_count is None else self.min_bin_count,
            bin_count_multiple=1 if self.bin_count_multiple is None else self.bin_count_multiple,
            seed=self.seed,
        )


def get_packer(
    algorithm: PackingAlgorithm | str,
    bin_capacity: int,
    min_bin_count: int | None = None,
    bin_count_multiple: int | None = None,
    *,
    seed: int = 0,
) -> SequencePacker:
    """A packer for ``algorithm`` (a :class:`PackingAlgorithm` or its name).

    ``None`` constraints mean none (at least 0 bins, any multiple of 1). An
    unknown algorithm or an invalid constraint raises InvalidBatch (a
    ValueError) here, not at the first ``pack``. ``seed`` (ours) drives
    ``FIRST_FIT_SHUFFLE``.

    Packing only forms bins. Which DP rank gets which bin is decided by
    :func:`assign_bins_to_ranks` (token-balanced, equal bin counts per rank),
    the default everywhere packing is planned (``plan_dp_shards``,
    ``shard_meta_for_dp``, ``BatchedDataDict.shard_by_batch_size``).

    >>> get_packer("first_fit_decreasing", 8).pack([3, 7, 2, 5, 1])
    [[1, 4], [3, 0], [2]]
    """
    try:
        algo = PackingAlgorithm(algorithm)
    except ValueError:
        raise InvalidBatch(
            f"unknown sequence packing algorithm {algorithm!r}; "
            f"known: {[a.value for a in PackingAlgorithm]}"
        ) from None
    _check_constraints(
        bin_capacity,
        0 if min_bin_count is None else min_bin_count,
        1 if bin_count_multiple is None else bin_count_multiple,
    )
    if not _is_int(seed):
        raise InvalidBatch(f"seed must be an int, got {seed!r}")
    return SequencePacker(algo, bin_capacity, min_bin_count, bin_count_multiple, seed)


# ---- bins -> ranks ------------------------------------------------------------
def round_robin_assign(bin_token_totals: Sequence[int], num_ranks: int) -> list[list[int]]:
    """Bin ``i`` goes to rank ``i % num_ranks`` (the naive baseline).

    >>> round_robin_assign([5, 4, 3, 2, 1], 2)
    [[0, 2, 4], [1, 3]]
    """
    _check_ranks(num_ranks)
    return [list(range(r, len(bin_token_totals), num_ranks)) for r in range(num_ranks)]


def _check_ranks(num_ranks: int) -> None:
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise InvalidBatch(f"num_ranks must be an int >= 1, got {num_ranks!r}")


def _loads(assign: list[list[int]], totals: Sequence[int]) -> list[int]:
    return [sum(totals[b] for b in bins) for bins in assign]


def _improve_by_swaps(
    assign: list[list[int]], totals: Sequence[int], max_swaps: int
) -> list[list[int]]:
    """Swap one bin of the heaviest rank with one of a lighter rank while that lowers the pair's max.

    Each swap strictly lowers the heaviest rank's load and leaves the lighter
    one below the old maximum, so the overall maximum never grows.
    """
    assign = [list(b) for b in assign]
    loads = _loads(assign, totals)
    for _ in range(max_swaps):
        hi = max(range(len(assign)), key=lambda r: (loads[r], -r))
        best = None  # (new pair max, hi position, lo rank, lo position)
        for lo in range(len(assign)):
            gap = loads[hi] - loads[lo]
            if lo == hi or gap <= 0 or not assign[lo]:
                continue
            lo_sorted = sorted((totals[b], p) for p, b in enumerate(assign[lo]))
            lo_vals = [v for v, _ in lo_sorted]
            for ph, bh in enumerate(assign[hi]):
                # ideal partner: delta = totals[bh] - t_lo == gap / 2
                want = totals[bh] - gap / 2
                k = bisect.bisect_left(lo_vals, want)
                for kk in (k - 1, k):
                    if not 0 <= kk < len(lo_vals):
                        continue
                    delta = totals[bh] - lo_vals[kk]
                    if not 0 < delta < gap:
                        continue
                    pair_max = max(loads[hi] - delta, loads[lo] + delta)
                    if best is None or pair_max < best[0]:
                        best = (pair_max, ph, lo, lo_sorted[kk][1])
        if best is None:
            break
        _, ph, lo, pl = best
        bh, bl = assign[hi][ph], assign[lo][pl]
        assign[hi][ph], assign[lo][pl] = bl, bh
        delta = totals[bh] - totals[bl]
        loads[hi] -= delta
        loads[lo] += delta
    return assign


def assign_bins_to_ranks(
    bin_token_totals: Sequence[int], num_ranks: int, *, max_swaps: int | None = None
) -> list[list[int]]:
    """Give every rank the same number of bins, balancing per-rank token totals.

    Greedy LPT under the equal-count constraint (largest bin first, to the
    lightest rank that still has a free slot), then a local-swap pass. The same
    swap pass is also run from the round-robin assignment and the better result
    (smaller maximum rank load) is kept, so this is never worse than
    :func:`round_robin_assign`. Each rank's bins are listed largest first, so
    microbatch ``j`` is of similar size on every rank.

    Raises InvalidBatch when the bin count is not a multiple of ``num_ranks``.

    >>> assign_bins_to_ranks([10, 9, 6, 5, 2, 1], 2)
    [[0, 3, 4], [1, 2, 5]]
    """
    _check_ranks(num_ranks)
    totals = [int(t) for t in bin_token_totals]
    n = len(totals)
    if n % num_ranks:
        raise InvalidBatch(
            f"{n} bins cannot be shared equally by {num_ranks} ranks; "
            f"pack with bin_count_multiple={num_ranks}"
        )
    per_rank = n // num_ranks
    if max_swaps is None:
        max_swaps = 4 * n + 16

    lpt: list[list[int]] = [[] for _ in range(num_ranks)]
    loads = [0] * num_ranks
    for b in sorted(range(n), key=lambda b: (-totals[b], b)):
        r = min(
            (r for r in range(num_ranks) if len(lpt[r]) < per_rank),
            key=lambda r: (loads[r], r),
        )
        lpt[r].append(b)
        loads[r] += totals[b]

    candidates = [
        _improve_by_swaps(lpt, totals, max_swaps),
        _improve_by_swaps(round_robin_assign(totals, num_ranks), totals, max_swaps),
    ]
    best = min(candidates, key=lambda a: max(_loads(a, totals), default=0))
    return [sorted(bins, key=lambda b: (-totals[b], b)) for bins in best]
