"""The controller's async-RL verbs: policy versions, rollout admission, stale drops.

A mixin of ``Controller`` (as ``Inspection`` is): the decisions are the core's
(``core.async_rl``, ``core.staleness``); this shell journals each change before
applying it, frees the bytes of dropped samples on their units, and makes
``admit_rollouts(wait=True)`` wait without blocking the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from dataplane_client.wire import arguments
from dataplane_client.wire.messages import Capabilities, ClaimRequest, ClearResult, RolloutGrant
from dataplane_client.wire.meta import KVBatchMeta
from dataplane_server.controller.verbs import served
from dataplane_server.core import async_rl
from dataplane_server.core.keyspace import KeySpace, Partition
from dataplane_server.core.stats import Stats


class Changes:
    """Per partition, a future resolved at the next change that may make room for a grant
    (a claim, ack, clear, drop, release or version bump); waiters then check again."""

    def __init__(self) -> None:
        self._next: dict[str, asyncio.Future] = {}

    def notify(self, partition_id: str) -> None:
        future = self._next.pop(partition_id, None)
        if future is not None and not future.done():
            future.set_result(None)

    async def wait(self, partition_id: str, timeout_s: float) -> None:
        future = self._next.get(partition_id)
        if future is None:
            future = self._next[partition_id] = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(asyncio.shield(future), max(timeout_s, 0.001))
        except asyncio.TimeoutError:
            pass


class AsyncRLVerbs:
    # Kept by the controller; named here for readers and type checkers.
    keys: KeySpace
    units: list
    stats: Stats
    changes: Changes

    def _log(self, *record) -> None: ...
    def _compact_if_due(self) -> None: ...

    _remove_rows: Callable[..., Any]  # -> actor.Removed (the actor imports this module)
    _free: Callable[[Any], Awaitable[int]]

    @served
    async def set_policy_version(self, partition_id: str, version: int) -> int:
        """The trainer's current policy version (never backwards: VersionRegression). Samples
        now older than a task's window are dropped (when the partition drops stale ones)."""
        part, versions = self.keys.versioned(partition_id)
        version = versions.check_version(version)
        self._log("version", partition_id, version)
        versions.set_version(version)
        self.stats.inc("policy_version_bumps_total")
        await self._drop_stale(part)
        self._compact_if_due()
        self.changes.notify(partition_id)
        return version

    @served
    def policy_version(self, partition_id: str) -> int:
        return self.keys.versioned(partition_id)[1].version

    async def _drop_stale(self, part: Partition) -> None:
        removal = async_rl.stale_removal(self.keys, part)
        if removal is not None:
            await self._remove(removal)

    async def _remove(self, removal: async_rl.Removal) -> int:
        """Journal, forget and free a removal; returns how many samples went."""
        pid = removal.part.partition_id
        removed = self._remove_rows(
            "dropped", removal.part, removal.rows, dict(removal.per_task), removal.evicted
        )
        async_rl.count_removal(removal, list(removed.births))  # its ids, in order
        self.stats.inc("stale_samples_dropped_total", len(removal.rows) - removal.evicted)
        self.stats.inc("samples_evicted_total", removal.evicted)
        self.changes.notify(pid)
        await self._free(removed)
        return len(removal.rows)

    # ---- rollout admission -----------------------------------------------------------
    @served
    async def admit_rollouts(
        self,
        partition_id: str,
        n: int,
        wait: bool = False,
        timeout_s: float = 60.0,
        lease_s: float = 300.0,
    ) -> RolloutGrant | None:
        """Leave to start ``n`` trajectories at the current version, while the samples started
        and not trained stay within the bound; else None (``wait`` False) or, waiting,
        AdmissionTimeout after ``timeout_s``. The grant counts until released or expired."""
        ask = async_rl.AdmissionAsk(self.keys, partition_id, n, wait, timeout_s, lease_s)
        while True:
            ask.check_partition()
            await self._drop_stale(ask.part)
            grant = ask.offer()
            if grant is not None:
                self._log(
                    "grant", partition_id, grant.grant_id, grant.n, grant.version, grant.expires_at
                )
                ask.record(grant)
                self._compact_if_due()
                self.stats.inc("rollouts_admitted_total", grant.n)
                return grant
            if not ask.wait:
                self.stats.inc("rollouts_refused_total", ask.n)
                return None
            if not ask.waits:  # journaled: describe's count survives a restart
                self._log("admission_wait", partition_id)
                self.stats.inc("admission_waits_total")
            await self.changes.wait(partition_id, ask.wait_s())

    @served
    async def release_rollouts(self, partition_id: str, grant_id: int) -> bool:
        """The producer has put (or given up) its trajectories: the grant stops counting.
        False when it had expired already (or was released before)."""
        _, versions = self.keys.versioned(partition_id)
        grant_id = arguments.count(grant_id, "grant_id", minimum=1)
        if grant_id not in versions.live_grants():  # released before, or lapsed
            return False
        self._log("release", partition_id, grant_id)
        versions.release(grant_id)
        self._compact_if_due()
        self.changes.notify(partition_id)
        return True

    # ---- retirement and eviction -------------------------------------------------------
    @served
    async def clear_versions(self, partition_id: str, lowest: int, highest: int) -> ClearResult:
        """Retire whole generations: every sample whose version is in [lowest, highest]."""
        part, rows = async_rl.versions_range(self.keys, partition_id, lowest, highest)
        freed = await self._free(self._remove_rows("clear", part, rows))
        self.stats.inc("cleared_samples_total", len(rows))
        self.changes.notify(partition_id)
        return ClearResult(cleared=len(rows), bytes_freed=freed)

    @served
    async def evict_samples(self, partition_id: str, sample_ids: list[str]) -> int:
        """Evict samples by id (counted as evicted, listed among the recently dropped)."""
        return await self._remove(async_rl.evict_ids(self.keys, partition_id, sample_ids))

    @served
    async def make_room(self, partition_id: str) -> int:
        """A put found a unit full: evict the oldest version's unclaimed groups, when the
        partition opted in (``evict_stale``). Returns how many samples went (0: none may)."""
        removal = async_rl.eviction(self.keys, self.keys.partition(partition_id))
        return 0 if removal is None else await self._remove(removal)

    # ---- introspection without consuming ----------------------------------------------
    @served
    def peek_meta(self, request: ClaimRequest) -> KVBatchMeta:
        """The batch a claim would get now; nothing is handed out."""
        return async_rl.peek(self.keys, arguments.claim_request(request))

    @served
    def ready_depth(
        self, partition_id: str, task_names: list[str], required_fields: list[str]
    ) -> dict[str, int]:
        return async_rl.ready_depth(self.keys, partition_id, task_names, required_fields)

    @served
    def capabilities(self, verbs: list[str]) -> Capabilities:
        return async_rl.capabilities("ray", verbs)

    @served
    def ping(self) -> bool:
        return True
