"""Per-rank streaming pull: each data-parallel rank's leader claims its own micro-batches.

The driver-planned path claims a step's keys, cuts them into one slice per DP rank
(``shard_meta_for_dp``) and ships each rank its slice. Here the driver ships only a
:class:`StreamStep` (partition, task, fields, the step's sample count, a token budget),
the same to every rank, and each DP replica's leader pulls micro-batches itself with
non-blocking claims of the ``token_budget`` claim policy, round after round, until the
step's quota is taken. What the driver plan guaranteed, and how it still holds:

- **Each sample to one rank, once**: claims consume for the task, and the key space
  serves claims one at a time.
- **Groups whole**: the policy hands out whole complete GRPO groups only.
- **Exactly the step's samples**: every claim carries ``step_end = start +
  step_samples``, ``start`` being what the task had consumed or held when the step
  began (read by every leader before any claim of the step, then agreed as the
  maximum); the policy never lets the task's count pass it, so the ranks together take
  the step's samples, no more (fewer only at a partition's declared end).
- **Balance**: after every round, the token totals of any two DP ranks for the step
  differ by at most ``max(token_budget, L)``, ``L`` the tokens of the longest item (a
  sample, or a whole group) handed out. The pacing rule (``claim_options``), with
  ``b <= token_budget`` the round's budget (``round_budget``, the same on every rank)
  and ``m`` the smallest total: a rank at ``m`` claims up to ``b`` tokens (an item over
  it alone); a rank at ``t < m + b`` claims up to ``m + b - t`` (an item over that:
  refused); a rank at ``t >= m + b`` sits the round out. So a rank ends a round at
  most at ``m + max(b, L)``, the others stay where they were, and the smallest total
  never goes down. The bound is a worst case: the first round probes with
  ``token_budget / 8`` and the last rounds' budgets shrink to the rest of the step per
  rank (not under ``token_budget / 8``), so the ranks' totals end much closer
  (``benchmarks/rank_pull.py`` measures it).
- **Siblings fed by their leader**: only leaders claim and fetch; each round the
  leader shares its micro-batch's meta with its TP/CP/PP siblings
  (``broadcast_object_list``), and the data goes as the planned path's does
  (``TQWorkerMixin._fetch``: leader fetch, two-phase broadcast).

A round is one small all-gather over every rank of the policy (whether it is a leader,
its replica's tokens and samples so far, whether its leader found the step done, how
many samples it got last round, whether it waited past the timeout), so every rank
takes the same decisions: the step ends for
all in the same round, once a leader whose claim came back empty finds the task's
count at ``step_end`` (or at the partition's declared size). A round in which no rank
got anything, the step not done, waits (10 ms, doubling to 100 ms) and tries again:
samples still being produced; past ``timeout_s`` without a sample every rank raises
``ClaimTimeout``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dataplane_client.wire.errors import ClaimTimeout, InvalidBatch
from dataplane_client.wire.meta import KVBatchMeta

POLICY = "token_budget"
FIRST_WAIT_S = 0.01
LONGEST_WAIT_S = 0.1
TAPER = 8  # the last rounds' budget is at least token_budget / TAPER


@dataclass(frozen=True)
class StreamStep:
    """One streamed step, as the driver ships it to every rank (no keys, no plan).

    ``fields``: what the pass reads (claimed samples must have produced them);
    ``step_samples``: the samples of the step over all DP ranks (a multiple of the
    partition's group size); ``token_budget``: at most this many tokens per claim (one
    item over it comes alone); ``max_micro_batch``: at most this many samples per claim
    (None: the step's). ``report_ids``: each rank reports its micro-batches' sample ids
    (tests; off, a rank reports counts only).
    """

    partition_id: str
    task_name: str
    fields: tuple[str, ...]
    step_samples: int
    token_budget: int
    max_micro_batch: int | None = None
    timeout_s: float = 60.0
    report_ids: bool = False

    def __post_init__(self) -> None:
        for name in ("step_samples", "token_budget"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidBatch(f"StreamStep.{name} must be an int >= 1, got {value!r}")
        m = self.max_micro_batch
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise InvalidBatch(f"StreamStep.max_micro_batch must be an int >= 1, got {m!r}")
        if not self.fields:
            raise InvalidBatch("StreamStep.fields must name at least one field")
        if not self.timeout_s > 0:
            raise InvalidBatch(f"StreamStep.timeout_s must be > 0, got {self.timeout_s!r}")


def tokens_of(meta: KVBatchMeta) -> int:
    """The tokens a claimed batch carries, as the policy counts them (unknown lengths: 0)."""
    return sum(max(int(n), 0) for n in meta.sequence_lengths or ())


def round_budget(budget: int, step_samples: int, taken: int, tokens: int, ranks: int) -> int:
    """This round's budget, the same on every rank. The first round (nothing taken yet)
    probes with ``budget // TAPER``; then the whole ``budget`` until the rest of the
    step, at the mean length taken so far, is less than a budget per rank; then that
    rest per rank, never under ``budget // TAPER``. Fewer, fuller micro-batches in the
    middle of the step; smaller ones where the ranks' totals are evened out."""
    floor = -(-budget // TAPER)
    if not taken:
        return floor
    if taken >= step_samples:
        return budget
    rest = -(-(step_samples - taken) * tokens // (taken * ranks))
    return max(floor, min(budget, rest))


def claim_options(totals: Sequence[int], mine: int, budget: int) -> dict[str, Any] | None:
    """The pacing rule (module docstring): this round's ``token_budget`` policy options
    for a rank whose step total is ``mine``, every rank's being ``totals``; None: this
    rank sits the round out."""
    low = min(totals)
    if mine - low >= budget:
        return None
    if mine == low:
        return {"token_budget": budget, "oversize": "alone"}
    return {"token_budget": low + budget - mine, "oversize": "refuse"}


@dataclass
class StreamReport:
    """What one rank pulled in a streamed step (small: counts, ids only when asked)."""

    dp_rank: int
    samples: int = 0
    tokens: int = 0
    micro_batches: int = 0
    rounds: int = 0
    waits: int = 0
    sample_ids: list[list[str]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


# (total, done, got, expired) of every rank, from this rank's own
Gather = Callable[[list[int]], list[list[int]]]
# the leader's round header to its siblings (the leader passes it, the others None)
Share = Callable[[Any], Any]


def world_gather(values: list[int]) -> list[list[int]]:
    """All-gather a few ints over every rank of the default process group (alone: itself)."""
    if not dist.is_initialized():
        return [list(values)]
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [t.tolist() for t in out]


def replica_share(group: Any, src: int) -> Share:
    """Share a header from the replica leader (global rank ``src``) to its siblings."""

    def share(header: Any) -> Any:
        if group is None:
            return header
        holder = [header]
        dist.broadcast_object_list(holder, src=src, group=group)
        return holder[0]

    return share


class RankStream:
    """One rank's side of a streamed step; every rank of the policy iterates ``metas()``
    together (its rounds are collectives). ``client``: the leader's data-plane client
    (siblings: None)."""

    def __init__(
        self,
        client: Any,
        step: StreamStep,
        *,
        dp_rank: int,
        is_leader: bool,
        gather: Gather = world_gather,
        share: Share | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ):
        if is_leader and client is None:
            raise InvalidBatch("a replica leader needs a data-plane client to pull with")
        self.client = client
        self.step = step
        self.is_leader = is_leader
        self.gather = gather
        self.share = share or (lambda header: header)
        self.sleep = sleep
        self.clock = clock
        self.report = StreamReport(dp_rank=dp_rank)
        self.step_end: int | None = None

    # ---- the leader's calls to the store ----------------------------------------------------
    def _taken(self) -> tuple[int, int | None]:
        """The task's consumed + leased samples, and the partition's declared size."""
        (c,) = self.client.consumption_detail(self.step.partition_id, [self.step.task_name])
        return c.consumed + c.leased, c.expected

    def _claim(self, options: dict[str, Any]) -> KVBatchMeta:
        s = self.step
        assert self.step_end is not None
        return self.client.claim_meta(
            s.partition_id,
            s.task_name,
            list(s.fields),
            s.max_micro_batch or s.step_samples,
            self.report.dp_rank,
            blocking=False,
            claim_policy=POLICY,
            policy_options={**options, "step_end": self.step_end},
        )

    def _step_done(self) -> bool:
        taken, expected = self._taken()
        assert self.step_end is not None
        return taken >= self.step_end or (expected is not None and taken >= expected)

    # ---- the rounds ---------------------------------------------------------------------------
    def metas(self) -> Iterator[KVBatchMeta]:
        """This replica's micro-batches of the step, one per round in which its leader got
        one (every rank of the replica gets the same meta), until the step is done. A
        leader's failing store call ends the step on every rank at the next round: its
        replica raises the error, every other rank ``StreamAborted``."""
        step, report = self.step, self.report
        start, error = 0, None
        if self.is_leader:
            try:
                start = self._taken()[0]
            except Exception as e:  # noqa: BLE001 - raised below, on every rank
                error = e
        rows = self.gather([start, int(error is not None), report.dp_rank])
        self._raise_if_failed(error, [(row[1], row[2]) for row in rows])
        self.step_end = max(row[0] for row in rows) + step.step_samples
        done = expired = False
        got, wait = 1, FIRST_WAIT_S
        progress = self.clock()
        while True:
            rows = self.gather(
                [
                    int(self.is_leader),
                    report.tokens,
                    report.samples,
                    int(done),
                    got,
                    int(expired),
                    int(error is not None),
                    report.dp_rank,
                ]
            )
            self._raise_if_failed(error, [(row[6], row[7]) for row in rows])
            leaders = [row for row in rows if row[0]]  # one per DP rank
            if any(row[3] for row in rows):
                return
            if any(row[5] for row in rows):
                raise ClaimTimeout(
                    f"streamed step of task {step.task_name!r}: no rank got a sample for "
                    f"{step.timeout_s}s, {report.samples} taken by this rank",
                    fields=list(step.fields),
                    partition_id=step.partition_id,
                )
            if not any(row[4] for row in rows):
                report.waits += 1
                self.sleep(wait)
                wait = min(2 * wait, LONGEST_WAIT_S)
            else:
                wait, progress = FIRST_WAIT_S, self.clock()
            report.rounds += 1
            header = None
            if self.is_leader:
                budget = round_budget(
                    step.token_budget,
                    step.step_samples,
                    sum(row[2] for row in leaders),
                    sum(row[1] for row in leaders),
                    len(leaders),
                )
                options = claim_options([row[1] for row in leaders], report.tokens, budget)
                header = self._pull(options)
            meta, done, error = self.share(header)
            got = 0 if meta is None else len(meta)
            if meta is not None:
                report.samples += len(meta)
                report.tokens += tokens_of(meta)
                report.micro_batches += 1
                if step.report_ids:
                    report.sample_ids.append(list(meta.sample_ids))
                yield meta
            expired = not got and self.clock() - progress > step.timeout_s

    def _pull(
        self, options: dict[str, Any] | None
    ) -> tuple[KVBatchMeta | None, bool, BaseException | None]:
        """The leader's claim of a round: (its batch or None, the step found done, the
        error a store call raised: shared with the siblings, raised next round)."""
        if options is None:
            return None, False, None
        try:
            meta = self._claim(options) or None
            return meta, meta is None and self._step_done(), None
        except Exception as e:  # noqa: BLE001 - raised next round, on every rank
            return None, False, e

    @staticmethod
    def _raise_if_failed(error: BaseException | None, failed: list[tuple[int, int]]) -> None:
        """This replica's error, or StreamAborted naming the DP ranks whose leader failed."""
        if error is not None:
            raise error
        ranks = sorted({dp for flag, dp in failed if flag})
        if ranks:
            raise StreamAborted(f"streamed step ended: the leader of DP rank(s) {ranks} failed")


class StreamAborted(RuntimeError):
    """A streamed step ended because another DP rank's leader failed (its replica raised
    that leader's error)."""
