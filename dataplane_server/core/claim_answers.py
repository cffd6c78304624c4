"""Claim identities that outlive a controller: lease ids and the answers of recent claims.

A claim the controller journaled and applied, but whose answer died with it,
is retried by Ray on the restarted controller. Its samples are already
consumed (or leased) there, so answering it anew would hand out a second batch
and the first would reach nobody. Every claim therefore carries a request id
(made by the client); the controller keeps the answers of the most recent
claims per partition, in memory, in the journal and in its snapshots, and a
claim whose id it knows gets that answer again instead of a new batch.

Lease ids are random 62-bit numbers, not a counter: a counter rebuilt from the
leases that survived a restart starts again at numbers an old holder may still
quote in a late ack.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from dataclasses import dataclass

# Answers kept per partition: more than the claims a partition can have in flight when
# the controller dies (each claimer has at most one in flight per thread or coroutine).
KEPT_ANSWERS = 4096


def new_lease_id() -> int:
    """A lease id no other lease of any controller incarnation has (1 in 2^62 odds)."""
    return secrets.randbits(62) + 1  # never NO_LEASE (0)


@dataclass(frozen=True)
class ClaimAnswer:
    """What one claim handed out: enough to answer its retry with the same batch."""

    task: str
    sample_ids: list[str]
    fields: list[str]
    lease_id: int | None
    dp_rank: int | None

    def to_record(self) -> list:
        return [self.task, self.sample_ids, self.fields, self.lease_id, self.dp_rank]

    @classmethod
    def from_record(cls, record: list) -> ClaimAnswer:
        task, ids, fields, lease_id, dp_rank = record
        return cls(task, list(ids), list(fields), lease_id, dp_rank)


class ClaimAnswers:
    """The answers of a partition's most recent claims, by request id (oldest dropped first)."""

    def __init__(self, limit: int = KEPT_ANSWERS):
        self.limit = limit
        self._answers: OrderedDict[str, ClaimAnswer] = OrderedDict()

    def get(self, request_id: str | None) -> ClaimAnswer | None:
        return None if request_id is None else self._answers.get(request_id)

    def add(self, request_id: str | None, answer: ClaimAnswer) -> None:
        if request_id is None:
            return
        self._answers[request_id] = answer
        while len(self._answers) > self.limit:
            self._answers.popitem(last=False)

    def forget_task(self, task: str) -> None:
        """A reset task starts over: its old answers must not be replayed."""
        for rid in [r for r, a in self._answers.items() if a.task == task]:
            del self._answers[rid]

    def export(self) -> list[list]:
        return [[rid, *a.to_record()] for rid, a in self._answers.items()]

    def restore(self, records: list) -> None:
        for rid, *rest in records:
            self.add(rid, ClaimAnswer.from_record(rest))
