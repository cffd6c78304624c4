"""A put's deadline, set when it is admitted, which every later step runs against.

Without it each step kept its own clock: a stage lived ``stage_ttl_s`` from the
moment it was staged, so a commit that queued behind thousands of others could
reach its unit after the stage was reclaimed, and the work done for the put
(the copy, the controller's checks) was thrown away. Now one deadline,
``stage_ttl_s`` after admission, travels with the put as a wall-clock time
(``expires_at``):

- the client stages and commits only before it (else ``Overloaded``, nothing
  visible, its stages discarded);
- a unit refuses a stage that arrives after it, before allocating anything, and
  keeps a stage it took until ``STAGE_GRACE_S`` after it;
- the controller refuses a commit that reaches it after the deadline, before
  any check or publish (``Overloaded``, queue "commit").

So a stage a commit can still reach is never reclaimed, and a commit that comes
too late costs one comparison. Wall-clock times are compared across processes
(and nodes): the grace covers the clocks of a cluster's nodes disagreeing by
less than it (NTP keeps them within milliseconds).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from dataplane_client.wire.errors import Overloaded
from dataplane_client.wire.messages import CommitRequest

# A unit keeps a stage this long past its put's deadline: a commit the controller
# accepted just before the deadline still finds its bytes (the publish's own trip, and
# clocks of two nodes that disagree slightly).
STAGE_GRACE_S = 2.0


@dataclass(frozen=True)
class PutDeadline:
    expires_at: float  # time.time() after which no step of the put starts
    budget_s: float  # what it was given at admission (for messages)

    @classmethod
    def after(cls, seconds: float) -> PutDeadline:
        return cls(time.time() + seconds, seconds)

    def remaining_s(self) -> float:
        return self.expires_at - time.time()

    def check(self, step: str) -> None:
        """Overloaded (naming ``step``'s queue) once the deadline has passed."""
        if self.remaining_s() <= 0:
            raise Overloaded(
                f"the put's {self.budget_s:g}s deadline (stage_ttl_s from its admission) "
                f"passed before its {step}; nothing of it is visible, retry later",
                queue=step,
            )


def stage_deadline_s(expires_at: float | None, stage_ttl_s: float, unit: int) -> float:
    """Seconds a unit keeps a stage that arrives now: until its put's deadline plus
    ``STAGE_GRACE_S``, never more than ``stage_ttl_s`` plus the grace; ``stage_ttl_s``
    for a caller that sent no deadline. Overloaded (queue "stage") when the deadline
    has passed: the unit allocates nothing for a put that can no longer commit."""
    if expires_at is None:
        return stage_ttl_s
    remaining = expires_at - time.time()
    if remaining <= 0:
        raise Overloaded(
            f"unit {unit}: the put's deadline passed {-remaining:.1f}s before its stage "
            "reached the unit (it queued too long); nothing was staged, retry later",
            queue="stage",
        )
    return min(remaining, stage_ttl_s) + STAGE_GRACE_S


def late_commit(request: CommitRequest) -> None:
    """Overloaded (queue "commit") for a commit that reached the controller after its
    put's deadline: refused before any check or publish, as its stages may be gone."""
    if request.expires_at is not None and time.time() > request.expires_at:
        raise Overloaded(
            f"the put's deadline passed {time.time() - request.expires_at:.1f}s before its "
            "commit reached the controller (it queued too long); nothing of it is visible, "
            "retry later",
            queue="commit",
            ids=request.sample_ids,
            partition_id=request.partition_id,
        )
