"""Concurrent claims of one client coalesced into one controller call.

Many claimers in one process share round trips (``CallBatcher``): one sender
thread keeps at most one ``claim_many`` call in flight, and every claim that
arrives meanwhile goes with the next call.

Each claim's answer is its own (a ``ClaimOutcome``): its batch, its typed
error, or ``must_wait`` (the caller then makes it a plain blocking claim with
the rest of its timeout). A failure of the whole call (the controller gone)
is every queued claim's error.
"""

from __future__ import annotations

from collections.abc import Callable

from dataplane_client.transport.call_batcher import CallBatcher
from dataplane_client.wire.messages import ClaimOutcome, ClaimRequest

MAX_BATCH = 1024  # claims per controller call; more wait for the next call


class ClaimBatcher(CallBatcher):
    """Queues claims and sends them, one ``send`` call at a time, from one thread.

    ``send`` takes the queued requests and returns one ``ClaimOutcome`` per
    request, in order (it blocks: the thread waits on the controller).
    """

    def __init__(self, send: Callable[[list[ClaimRequest]], list[ClaimOutcome]]):
        super().__init__(send, "dataplane-claims", MAX_BATCH)
