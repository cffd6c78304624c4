"""Publishing a checked commit's staged bytes on its storage units.

A commit on one unit is one ``publish`` call carrying the samples' metadata. A
commit spanning several units is first ``prepare``d (pinned) on each, then
published: after that, publishing can fail only by a unit's death, and a
controller that dies half way rolls the write forward when it restarts.
Applied write ids are remembered, so a commit Ray retries after a restart is
recognised and not applied twice. The one-unit publishes of concurrent commits
(many writers' small puts) go to each unit together, one ``publish_many`` call
per round trip (:class:`UnitPublishes`).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import numpy as np

from dataplane_client.wire.errors import SamplesLost
from dataplane_client.wire.messages import CommitRequest
from dataplane_server.controller.coalesced_calls import CoalescedCalls
from dataplane_server.core import unit_calls
from dataplane_server.core.recovery_messages import SampleMeta


def sample_metas(request: CommitRequest, seq: int) -> dict[int, SampleMeta]:
    """What each unit keeps beside the bytes so a restarted controller can rebuild.

    Samples are split by unit with numpy; Python touches a sample only to put it in its
    unit's dict of lengths (the units' format) and only when lengths or tags were sent.
    """
    staged = request.staged_units
    lengths = request.sequence_lengths
    tags = request.tags or []
    tagged = [i for i, t in enumerate(tags) if t]
    if lengths is None and not tagged:  # nothing per sample to keep beyond commit order
        return {u: SampleMeta(seq) for u in staged}
    ids = np.asarray(request.sample_ids, dtype=object)
    copies = [np.asarray(request.units, dtype=np.int64)]
    if request.replicas is not None:
        copies.append(np.asarray(request.replicas, dtype=np.int64))
    length_of = None if lengths is None else np.asarray(lengths, dtype=np.int64)
    out = {}
    for u in staged:
        on_u = np.logical_or.reduce([c == u for c in copies])
        unit_lengths = {}
        if length_of is not None:
            unit_lengths = dict(zip(ids[on_u].tolist(), length_of[on_u].tolist()))
        unit_tags = {request.sample_ids[i]: tags[i] for i in tagged if on_u[i]}
        out[u] = SampleMeta(seq, unit_lengths, unit_tags)
    return out


def _copies(request: CommitRequest) -> list[tuple[int, tuple[str, int]]]:
    """(index, (sample, unit)) of every copy the commit writes: each sample's unit, and its
    second copy's unit under replication."""
    out = list(enumerate(zip(request.sample_ids, request.units)))
    if request.replicas is not None:
        second = enumerate(zip(request.sample_ids, request.replicas))
        out += [(i, (s, u)) for i, (s, u) in second if u >= 0]
    return out


async def publish(
    units: list,
    request: CommitRequest,
    metas: dict[int, SampleMeta],
    lose_unit: Callable[[int], Awaitable[object]],
    batches: UnitPublishes | None = None,
) -> None:
    """Make the staged bytes visible on every unit of the commit, or raise having freed
    what was published: a unit's typed refusal as itself, a dead unit as SamplesLost
    naming its samples (``lose_unit`` is told first). ``batches``: a one-unit publish
    goes with the other commits' publishes to that unit."""
    staged, wid = request.staged_units, request.write_id
    if len(staged) > 1:
        prepares = [units[u].prepare.remote(wid, metas[u], staged) for u in staged]
        try:
            await _on_units(units, request, prepares, [], lose_unit)
        except BaseException:
            # A pinned stage waits for the controller, not its writer (whose death no longer
            # frees it): this commit will not be published, so its stages go now.
            await asyncio.gather(
                *[units[u].discard.remote(wid) for u in staged], return_exceptions=True
            )
            raise
        calls = [units[u].publish.remote(wid) for u in staged]
    elif batches is not None:
        calls = [batches.publish(staged[0], wid, metas[staged[0]])]
    else:
        calls = [units[staged[0]].publish.remote(wid, metas[staged[0]])]
    await _on_units(units, request, calls, staged, lose_unit)


async def _on_units(
    units: list,
    request: CommitRequest,
    calls: list,
    published: list[int],
    lose_unit: Callable[[int], Awaitable[object]],
) -> None:
    """Await one call per staged unit. A typed refusal (e.g. a stage past its deadline)
    reaches the caller as itself; only a dead unit is a lost unit."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    failed = {u: r for u, r in zip(request.staged_units, results) if isinstance(r, BaseException)}
    if not failed:
        return
    died = [u for u, r in failed.items() if unit_calls.is_dead_actor(r)]
    for u in died:
        await lose_unit(u)
    # Bytes made visible on a unit for a commit that will not be applied are freed.
    await unpublish(units, request, [u for u in published if u not in failed])
    if not died:
        raise unit_calls.typed(next(iter(failed.values())))
    raise SamplesLost(
        f"storage units {died} failed while publishing",
        ids=list(dict.fromkeys(s for _, (s, u) in _copies(request) if u in died)),
        partition_id=request.partition_id,
    )


async def unpublish(units: list, request: CommitRequest, on: list[int]) -> None:
    """Undo the commit's publish on units ``on``: it will not become visible. By write id,
    not by sample id: a unit drops only the cells this write filled, so samples that
    existed before (a write-back's) keep their earlier fields. A unit that fails to
    answer undoes nothing (its bytes are lost with it)."""
    await asyncio.gather(
        *[units[u].unpublish.remote(request.partition_id, request.write_id) for u in on],
        return_exceptions=True,
    )


async def unpublish_samples(
    units: list, request: CommitRequest, by_unit: dict[int, list[str]]
) -> None:
    """Undo the applied commit's publish for some samples only (per unit: the samples a
    clear took while it was publishing), by write id as ``unpublish``: a newer write of
    the same ids keeps its bytes."""
    await asyncio.gather(
        *[
            units[u].unpublish.remote(request.partition_id, request.write_id, ids)
            for u, ids in by_unit.items()
        ],
        return_exceptions=True,
    )


MAX_PUBLISH_BATCH = 1024  # publishes per publish_many call


class UnitPublishes:
    """One-unit publishes of concurrent commits, coalesced per unit (``publish_many``).

    ``units`` is read when a unit's first publish is sent, so handles given to a
    controller after it was made are the ones used.
    """

    def __init__(self, units: Callable[[], list]):
        self._units = units
        self._by_unit: dict[int, CoalescedCalls] = {}

    def publish(self, unit: int, write_id: str, meta: SampleMeta | None) -> asyncio.Future:
        """A future of the publish's answer (True, False for a retried commit, or the
        error: the unit's typed refusal, or the whole call's failure)."""
        calls = self._by_unit.get(unit)
        if calls is None:
            handle = self._units()[unit]
            calls = self._by_unit[unit] = CoalescedCalls(
                lambda writes: handle.publish_many.remote(writes), MAX_PUBLISH_BATCH
            )
        return calls.call((write_id, meta))


class AppliedWrites:
    """Write ids of the newest applied commits (bounded): a retried commit is a no-op."""

    def __init__(self, limit: int = 65536):
        self.limit = limit
        self._ids: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, write_id: str) -> bool:
        return write_id in self._ids

    def add(self, *write_ids: str) -> None:
        for w in write_ids:
            self._ids[w] = None
        while len(self._ids) > self.limit:
            self._ids.popitem(last=False)
