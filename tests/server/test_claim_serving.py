"""Blocking claims on the controller are served, not all woken: a commit tries each kind of
waiting claim once and hands batches in arrival order (``controller/claim_wait.py``).

The queue is driven on a real key space in one event loop (no Ray): the claims' tries
are counted, which is what a wake-everyone condition spent per commit (one try per
waiter: the claim p99 of 1,024 claimers racing 8,192 writers grew with the claimers).
The real service's end of it (blocking claimers racing writers, every sample once) is
``tests/client/test_claim_batching.py``.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest
from keyspace_commits import commit

from dataplane_client.wire.errors import ClaimTimeout, UnknownPartition
from dataplane_client.wire.messages import ClaimRequest
from dataplane_server.controller.claim_wait import ClaimWaits, kind_of
from dataplane_server.core.keyspace import KeySpace, declaration

X = {"x": ("dense", "float32", ())}
WAITERS = 64


def _space() -> KeySpace:
    ks = KeySpace()
    ks.unit_alive = [True]
    ks.register("p", declaration("p", ["x"], consumer_tasks=["t", "u"]))
    return ks


class Claimers:
    """Blocking claims of one key space waiting in one ``ClaimWaits``; each try counted."""

    def __init__(self, ks: KeySpace) -> None:
        self.ks, self.waits, self.tries = ks, ClaimWaits(), Counter()

    def start(self, name: str, task: str = "t", batch: int = 2, timeout_s: float = 30.0):
        request = ClaimRequest("p", task, ["x"], batch, None, True, name, timeout_s)
        part, task, policy = self.ks.claim_setup(request)

        def try_claim():
            self.tries[name] += 1
            return self.ks.claim(part, task, ["x"], batch, partial_ok=False, policy=policy)

        return asyncio.ensure_future(self.waits.wait(self.ks, part, request, policy, try_claim))

    async def waiting(self, n: int) -> None:
        """Until ``n`` claims wait in the partition (observable: ``waiting_claims``)."""
        deadline = time.monotonic() + 10
        while self.ks.partition("p").waiting_claims != n:
            assert time.monotonic() < deadline, "the claims never started waiting"
            await asyncio.sleep(0)


def test_a_commit_tries_each_kind_of_waiting_claim_once_and_serves_in_arrival_order():
    async def scenario():
        ks = _space()
        claimers = Claimers(ks)
        names = [f"c{i}" for i in range(WAITERS)]
        waits = [claimers.start(name) for name in names]
        other = claimers.start("other-task", task="u")  # another kind: tried on its own
        await claimers.waiting(WAITERS + 1)
        assert sum(claimers.tries.values()) == 0  # waiting, not polling

        commit(ks, "p", ["s0", "s1"], X)
        claimers.waits.serve("p")
        # One batch: the first claim of each kind gets it, the second of kind "t" finds
        # nothing and its kind is not tried again in this pass.
        assert claimers.tries == Counter({"c0": 1, "c1": 1, "other-task": 1})
        assert (await waits[0]).sample_ids == ["s0", "s1"]
        assert (await other).sample_ids == ["s0", "s1"]

        for i in range(1, 4):  # later commits: the next waiter in arrival order each time
            claimers.tries.clear()
            commit(ks, "p", [f"s{2 * i}", f"s{2 * i + 1}"], X, write_id=f"w{i}")
            claimers.waits.serve("p")
            assert (await waits[i]).sample_ids == [f"s{2 * i}", f"s{2 * i + 1}"]
            assert sum(claimers.tries.values()) == 2  # the served one and the next
        assert not any(w.done() for w in waits[4:])
        for w in waits[4:]:
            w.cancel()
        await asyncio.gather(*waits[4:], return_exceptions=True)
        assert ks.partition("p").waiting_claims == 0

    asyncio.run(scenario())


def test_any_other_change_wakes_every_claim_to_try_itself_and_see_its_partition_gone():
    async def scenario():
        ks = _space()
        claimers = Claimers(ks)
        waits = [claimers.start(f"c{i}") for i in range(4)]
        await claimers.waiting(4)
        ks.delete("p")
        await claimers.waits.wake("p")
        claimers.waits.drop("p")
        for w in waits:
            with pytest.raises(UnknownPartition, match="deleted while the claim waited"):
                await w

    asyncio.run(scenario())


def test_a_claim_times_out_in_the_queue_and_leaves_it():
    async def scenario():
        ks = _space()
        claimers = Claimers(ks)
        with pytest.raises(ClaimTimeout, match="only 0 of 2"):
            await claimers.start("c0", timeout_s=0.05)
        commit(ks, "p", ["s0", "s1"], X)
        claimers.waits.serve("p")  # nobody waits any more: nothing is claimed
        assert claimers.tries == Counter({"c0": 1})  # its own try when its time was up
        assert ks.claim(ks.partition("p"), "t", ["x"], 2, partial_ok=False) is not None

    asyncio.run(scenario())


def test_claims_differing_only_in_id_and_timeout_are_one_kind():
    a = ClaimRequest("p", "t", ["x"], 2, None, True, "a", 5.0)
    assert kind_of(a) == kind_of(ClaimRequest("p", "t", ["x"], 2, None, True, "b", 60.0))
    assert kind_of(a) != kind_of(ClaimRequest("p", "t", ["x"], 4, None, True, "a", 5.0))
    assert kind_of(a) != kind_of(ClaimRequest("p", "t", ["x"], 2, 1, True, "a", 5.0))
    assert kind_of(a) != kind_of(ClaimRequest("p", "t", ["x"], 2, None, True, "a", 5.0, "x"))
