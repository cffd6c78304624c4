"""Controller: the async Ray actor around the key space.

All metadata and every decision live in ``dataplane_server.core.keyspace`` (no Ray
there); this shell validates arguments, talks to the storage units, and makes
blocking claims wait on a per-partition asyncio condition, so a waiting claim
never stalls another caller. Whenever it awaits, the key space is consistent:
a commit is checked, then published on the units, then applied in one step.

Surviving its own death: Ray restarts the controller with the same arguments
(the unit handles and a journal directory). Before serving the first call a
(re)started controller rebuilds its key space (``recovery``); a background
watch (``liveness``) makes a lost unit's samples lost (terminal) within
seconds; checkpoints are ``controller.checkpoint``'s. This file only awaits, locks,
calls the key space and talks to units.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from dataclasses import dataclass

import ray

from dataplane_client.wire import arguments, failpoints
from dataplane_client.wire.config import DataPlaneConfig
from dataplane_client.wire.errors import (
    DataPlaneError,
    InvalidBatch,
    JournalWriteFailed,
    ServiceUnavailable,
    UnknownPartition,
)
from dataplane_client.wire.messages import (
    CheckpointSummary,
    ClaimOutcome,
    ClaimRequest,
    ClearResult,
    CommitRequest,
    CommitResult,
    FieldCodecs,
    Location,
    PartitionSpec,
    Routing,
    TaskConsumption,
    UnitInfo,
    WriterLoad,
)
from dataplane_client.wire.meta import KVBatchMeta
from dataplane_client.wire.put_deadline import late_commit
from dataplane_server.controller import checkpoint, claim_wait, liveness, publish, unit_lookup
from dataplane_server.controller.async_rl_verbs import AsyncRLVerbs, Changes
from dataplane_server.controller.checkpoint import Cut
from dataplane_server.controller.cut_gate import CutGate
from dataplane_server.controller.inspection import Inspection
from dataplane_server.controller.verbs import served
from dataplane_server.controller.writer_loads import WriterLoads
from dataplane_server.core import async_rl, partial_rollouts, recovery, steps, unit_calls
from dataplane_server.core.claim_wait import raise_if_unsatisfiable
from dataplane_server.core.journal import Journal
from dataplane_server.core.keyspace import CommitPlan, KeySpace, Partition, PolicyCall, declare
from dataplane_server.core.retention import EmptiedPartitions
from dataplane_server.core.stats import Stats


@dataclass(frozen=True)
class Removed:
    """Samples journaled as removed and forgotten, whose bytes the units are to free."""

    partition_id: str
    targets: dict[int, list[str]]  # unit -> ids
    births: dict[str, int]  # id -> birth (journal.py)


@ray.remote
class Controller(Inspection, AsyncRLVerbs):
    def __init__(
        self, config: DataPlaneConfig, units: list | None = None, state_dir: str | None = None
    ):
        self.config = config
        self.keys = KeySpace()
        # Names (what start() passes; see unit_lookup) or handles (tests building one by hand).
        self.units: list = unit_lookup.resolve(list(units or []), config.namespace)
        self.unit_info: list[UnitInfo] = []
        self.journal = Journal(state_dir, fsync=config.journal_fsync) if state_dir else None
        self._recovery: asyncio.Future | None = None
        self._watcher: asyncio.Task | None = None
        self._next_seq = 1  # commit sequence number: row order when rebuilt from the units
        self._applied = publish.AppliedWrites()
        self._publishes = publish.UnitPublishes(lambda: self.units)
        self.writer_loads = WriterLoads()  # writers' put admission figures, for operators
        self._emptied = EmptiedPartitions(
            config.retain_emptied_partitions, config.retain_emptied_partitions_s
        )
        self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        if self.restarted:  # tests hold a restart here to outlast the clients' retry budget
            failpoints.hold_while_armed(failpoints.CONTROLLER_RESTART)
        self.started_at = time.time()
        self.draining = False
        self.stats = Stats()
        self._waits = claim_wait.ClaimWaits()  # blocking claims wait here, per partition
        self.changes = Changes()  # rollout admissions wait here, per partition
        self._lifecycle = asyncio.Lock()  # register / delete of one id never interleave
        # A checkpoint's cut holds commits and frees back while the units pin (cut_gate.py);
        # checkpoints are taken one at a time (a unit keeps one pinned cut).
        self._cut_gate = CutGate()
        self._checkpointing = asyncio.Lock()
        self.last_checkpoint: CheckpointSummary | None = None
        # partition -> {id: birth} of removed samples whose bytes the units are freeing now:
        # a snapshot taken meanwhile must still name them (``_durable_state``).
        self._freeing: dict[str, dict[str, int]] = {}
        self._background: set[asyncio.Task] = set()  # frees started by a synchronous verb

    # ---- wiring -------------------------------------------------------------------
    async def attach_units(self, handles: list | None = None) -> list[UnitInfo]:
        """Wait for the key space to be rebuilt; ``handles`` only if none were given at start."""
        if handles is not None and not self.units:
            self.units = list(handles)
        await self._up()
        return self.unit_info

    async def _up(self) -> None:
        if self._recovery is None:
            self._recovery = asyncio.ensure_future(self._recover())
        try:
            await asyncio.shield(self._recovery)
        except DataPlaneError:
            raise
        except Exception as e:  # said as the typed error; the cause is kept
            raise ServiceUnavailable(f"the controller could not rebuild its state: {e!r}") from e

    async def _recover(self) -> None:
        """Rebuild the key space from the units and the journal (fresh start: both empty)."""
        t0 = time.perf_counter()
        rebuilt = await recovery.restart(self.units, self.journal)
        self.keys, self.unit_info = rebuilt.keys, rebuilt.unit_info
        self._next_seq = rebuilt.next_seq
        for pid, units in rebuilt.orphans.items():  # deleted just before a crash: free the bytes
            await unit_calls.free(self.units, pid, dict.fromkeys(units))
        for pid, targets in rebuilt.removed.items():  # removed, not freed before a crash
            await unit_calls.free(self.units, pid, targets)
        self._applied.add(*rebuilt.published)
        if self.journal:
            self.journal.compact(self._durable_state())
        self.stats.observe("recovery_seconds", time.perf_counter() - t0)
        if self.restarted:
            self.stats.inc("controller_restarts_total")
        if self._watcher is None:
            every_s = self.config.liveness_interval_s
            self._watcher = asyncio.ensure_future(
                liveness.every(
                    every_s,
                    functools.partial(self._watch_round, every_s),
                    functools.partial(self.stats.inc, "liveness_check_errors_total"),
                )
            )

    # ---- the journal: written after validation and before the state changes ----------
    def _pack(self, *record) -> bytes | None:
        """A journal record's bytes (None without a journal); what cannot be journaled is
        refused here, before anything changed."""
        if self.journal is None:
            return None
        try:
            return self.journal.pack(*record)
        except (ValueError, TypeError, OverflowError) as e:
            raise InvalidBatch(f"cannot be journaled ({e}): {record[:2]!r}") from None

    def _write(self, packed: bytes | None) -> None:
        """Append a packed record; a failure (e.g. a full disk) is JournalWriteFailed and the
        caller has changed nothing yet."""
        if self.journal is None or packed is None:
            return
        try:
            self.journal.write(packed)
        except OSError as e:
            self.stats.inc("journal_write_errors_total")
            raise JournalWriteFailed(
                f"the controller's journal could not be written ({e}); nothing was changed"
            ) from None

    def _log(self, *record) -> None:
        self._write(self._pack(*record))

    def _compact_if_due(self) -> None:
        """Snapshot the state once enough records piled up: called after a change is applied,
        so the snapshot holds it. A failed snapshot is retried later (the log still holds
        every record)."""
        if self.journal is None or not self.journal.due():
            return
        try:
            self.journal.compact(self._durable_state())
        except OSError:
            self.stats.inc("journal_write_errors_total")

    def _durable_state(self) -> dict[str, dict]:
        """A snapshot's state: the key space's, and the removals whose bytes are still being
        freed (a restart must not find those samples again)."""
        state = self.keys.export_state()
        for pid, freeing in self._freeing.items():
            if pid in state and freeing:
                state[pid]["removed"] = [[sid, born] for sid, born in freeing.items()]
        return state

    def _remove_rows(self, record: str, part: Partition, rows, *extra) -> Removed:
        """Journal a removal of ``rows`` (a "clear" record, or "dropped" with its counts in
        ``extra``), then forget them; what ``_free`` frees on the units."""
        ids, births = self.keys.removal_record(part, rows)
        self._log(record, part.partition_id, *extra, ids, births)
        removed = Removed(
            part.partition_id, self.keys.clear_rows(part, rows), dict(zip(ids, births))
        )
        self._freeing.setdefault(part.partition_id, {}).update(removed.births)
        self._compact_if_due()
        return removed

    async def _free(self, removed: Removed) -> int:
        """Free removed samples' bytes on their units; from then on no snapshot names them
        (unless the same id was removed again meanwhile: a later birth stays named)."""
        try:
            await self._cut_gate.freeing()
            return await unit_calls.free(self.units, removed.partition_id, removed.targets)
        finally:
            freeing = self._freeing.get(removed.partition_id, {})
            for sid, born in removed.births.items():
                if freeing.get(sid) == born:
                    del freeing[sid]
            if not freeing:
                self._freeing.pop(removed.partition_id, None)

    @served
    def unit_handles(self) -> list:
        return self.units

    @served
    def routing(self) -> Routing:
        return Routing(
            units=self.units,
            alive=list(self.keys.unit_alive),
            nodes=[info.node_id for info in self.unit_info],
            shm=[bool(info.shm) for info in self.unit_info],
            replicas=self.config.replicas,
            put_credits=self.config.put_credits,
            put_admission_timeout_s=self.config.put_admission_timeout_s,
            put_queue_limit=self.config.put_queue_limit,
            stage_ttl_s=self.config.stage_ttl_s,
            cross_node_transport=self.config.cross_node_transport,
            transfer_puts=self.config.transfer_puts,
        )

    @served
    async def mark_unit_lost(self, index: int) -> bool:
        """Called when a client (or a publish) saw a unit die; verify before believing it.

        Lost is for good (its samples with it), so only proof counts, as for the
        liveness watch: Ray saying the actor died, or its node dead. A unit that is
        merely slow to answer (a loaded machine) is alive: False, nothing changes.
        """
        if not self.keys.unit_alive[index]:
            return False
        dead = await liveness.dead_units(
            self.units, self.unit_info, [index], unit_calls.UNIT_PING_TIMEOUT_S
        )
        if not dead:
            return False
        await self._lose_unit(index)
        return True

    async def _lose_unit(self, index: int) -> None:
        """Its samples are lost (terminal) from now on; waiting claims re-check."""
        if not self.keys.unit_alive[index]:
            return
        self.keys.unit_alive[index] = False
        self.keys.fail_over()  # replicated samples are served by their second copy from now on
        self.stats.inc("units_lost_total")
        await self._waits.wake_all()

    # ---- background: liveness of units and nodes, retention of emptied partitions ----
    async def _watch_round(self, timeout_s: float) -> None:
        watched = self.keys.live_units()
        for i in await liveness.dead_units(self.units, self.unit_info, watched, timeout_s):
            await self._lose_unit(i)
        await self._apply_retention()

    async def _apply_retention(self) -> None:
        """Delete emptied partitions past the configured retention (opt-in)."""
        for pid in self._emptied.victims(self.keys):
            async with self._lifecycle:
                part = self.keys.partitions.get(pid)
                if part is not None and not part.num_samples:
                    await self._delete(pid)
                    self.stats.inc("partitions_retired_total")

    def set_draining(self, flag: bool) -> None:
        self.draining = bool(flag)

    # ---- partitions ---------------------------------------------------------------
    @served
    async def register_partition(self, spec: PartitionSpec) -> None:
        """Declare a partition; an existing one of that id is deleted first (bytes freed).

        Checked in full (its claim policy and options too) before the old
        partition is touched, so a refused registration never reaches the
        partition it would replace.
        """
        declared = declare(spec)
        partition_id = spec.partition_id
        record = self._pack("register", partition_id, declared.to_record())
        async with self._lifecycle:
            if partition_id in self.keys.partitions:
                await self._delete(partition_id)
            try:
                self._write(record)
            except JournalWriteFailed as e:
                raise JournalWriteFailed(
                    f"{e.message}, except that the partition it replaces was deleted",
                    partition_id=partition_id,
                ) from None
            self.keys.register(partition_id, declared)
            self._compact_if_due()

    @served
    def field_codecs(self, partition_id: str) -> FieldCodecs:
        """The partition's enums and object fields, for clients that did not register it."""
        return self.keys.partition(partition_id).declaration.codecs

    @served
    async def delete_partition(self, partition_id: str) -> ClearResult:
        """Forget the partition and free its bytes; claims waiting on it fail (UnknownPartition)."""
        async with self._lifecycle:
            return await self._delete(partition_id)

    async def _delete(self, partition_id: str) -> ClearResult:
        self.keys.partition(partition_id)  # UnknownPartition before anything is journaled
        self._log("delete", partition_id)  # before the bytes go: a crash now frees them anyway
        part = self.keys.delete(partition_id)
        self._compact_if_due()
        self._emptied.forget(partition_id)
        await self._waits.wake(partition_id)
        self._waits.drop(partition_id)
        self.changes.notify(partition_id)
        await self._cut_gate.freeing()
        freed = await unit_calls.free(
            self.units, partition_id, dict.fromkeys(self.keys.live_units())
        )
        self.stats.inc("cleared_samples_total", part.num_samples)
        self.stats.inc("partitions_deleted_total")
        return ClearResult(cleared=part.num_samples, bytes_freed=freed)

    # ---- commit (the single visibility point of a write) --------------------------
    @served
    async def commit(self, request: CommitRequest) -> CommitResult:
        """Check, publish the staged bytes on every unit, then make the fields visible.

        A result with ``rerouted`` changed nothing: existing samples live on other
        units than the writer assumed. A commit spanning several units is first
        prepared on each (pinned), so publishing can fail only by a unit's death
        and a controller that dies half way rolls it forward when it restarts.
        A commit retried after a restart (its write already published) is a no-op.
        """
        (answer,) = await self._commit_together([request])
        if isinstance(answer, BaseException):
            raise answer
        return answer

    @served
    async def commit_many(
        self, requests: list[CommitRequest], load: WriterLoad | None = None
    ) -> list:
        """The commits of one writer process's concurrent puts (its ``CallBatcher``), applied
        together. One answer per request, in order: its ``CommitResult`` or its typed
        error; one commit's error is only its own. ``load``: the writer's put admission
        figures (``writer_loads``)."""
        self.stats.inc("commit_batches_total")
        self.writer_loads.report(load)
        await failpoints.pause_if_armed(failpoints.COMMIT_QUEUED)
        answers = await self._commit_together(requests)
        for answer in answers:
            if isinstance(answer, DataPlaneError):
                self.stats.error(answer)
        return answers

    async def _commit_together(self, requests: list[CommitRequest]) -> list:
        async with self._cut_gate.publishing():  # a checkpoint's cut never sees half a commit
            return await self._commit_now(requests)

    async def _commit_now(self, requests: list[CommitRequest]) -> list:
        """Each commit as ``commit`` says, in one pass: every request checked, then all
        published at once (a one-unit publish shares one call per unit with every other
        batch's, ``publish.UnitPublishes``), then every published one applied, with no
        await between the checks nor between the applies. One answer per request: its
        result or its error (an exception object, not raised)."""
        answers: list = [None] * len(requests)
        planned: list[tuple[int, CommitPlan]] = []
        live: list[tuple[int, CommitPlan]] = []  # published: to be applied
        seqs: dict[int, int] = {}  # id(plan) -> the seq it is published under: its generation
        ready = False
        try:
            metas = []
            for i, request in enumerate(requests):
                if request.write_id in self._applied:
                    answers[i] = self.keys.committed_result(request)
                    continue
                try:
                    late_commit(request)  # Overloaded: no work for a put past its deadline
                    plan = self.keys.check_commit(request)
                except DataPlaneError as e:
                    answers[i] = e
                    continue
                if not isinstance(plan, CommitPlan):
                    answers[i] = plan  # re-routed: nothing changed
                    continue
                planned.append((i, plan))
                metas.append(publish.sample_metas(request, self._next_seq))
                seqs[id(plan)] = self._next_seq
                self._next_seq += 1
            if planned:  # tests widen the window in which a clear frees the samples first
                await failpoints.pause_if_armed(failpoints.COMMIT_BEFORE_PUBLISH)
            published = await asyncio.gather(
                *[
                    publish.publish(
                        self.units, plan.request, meta, self.mark_unit_lost, self._publishes
                    )
                    for (_, plan), meta in zip(planned, metas)
                ],
                return_exceptions=True,
            )
            for (i, plan), outcome in zip(planned, published):
                if isinstance(outcome, BaseException):
                    answers[i] = unit_calls.typed(outcome)
                else:
                    live.append((i, plan))
            if live:  # clears race in here
                await failpoints.pause_if_armed(failpoints.COMMIT_AFTER_PUBLISH)
            ready = True
        finally:
            applying = {id(plan) for _, plan in live} if ready else set()
            for _, plan in planned:
                if id(plan) not in applying:
                    self.keys.release(plan)  # not published, or cancelled: nothing reserved
        undo, changed = [], set()
        for i, plan in live:
            request = plan.request
            try:
                answers[i], cleared_meanwhile = self.keys.apply_commit(plan, seqs[id(plan)])
            except UnknownPartition as e:
                answers[i] = e
                undo.append(publish.unpublish(self.units, request, request.staged_units))
                continue
            self._applied.add(request.write_id)
            self._emptied.forget(request.partition_id)
            if cleared_meanwhile:
                # By write id: a newer write of a cleared id (made since the clear) keeps
                # its bytes.
                undo.append(publish.unpublish_samples(self.units, request, cleared_meanwhile))
            self.stats.inc("commits_total")
            self.stats.inc("committed_samples_total", len(request.sample_ids))
            self.stats.inc("partial_tokens_resumed_total", plan.resumed_tokens)
            changed.add(request.partition_id)
        await asyncio.gather(*undo)
        for partition_id in changed:
            self._waits.serve(partition_id)  # new samples: hand them to waiting claims
        return answers

    @served
    def report_writer_load(self, load: WriterLoad) -> None:
        """A writer's put admission figures, sent when it refused a put (its commits may
        have stopped, so they cannot carry them)."""
        self.writer_loads.report(load)

    # ---- reads --------------------------------------------------------------------
    @served
    def locate(self, partition_id: str, sample_ids: list[str], fields: list[str]) -> Location:
        """Validate a read and say where each sample's bytes live (and which generation)."""
        self.stats.inc("locates_total")
        return self.keys.locate(partition_id, sample_ids, fields)

    @served
    def lookup_units(self, partition_id: str, sample_ids: list[str]) -> list[int]:
        """Recorded unit per sample (-1 = not written yet), for inspection and tests."""
        return self.keys.lookup_units(partition_id, sample_ids)

    # ---- claims -------------------------------------------------------------------
    @served
    async def claim_meta(self, request: ClaimRequest) -> KVBatchMeta | None:
        """Hand out up to ``batch_size`` ready samples the task has not consumed, as the
        claim's policy (else the partition's) chooses them.

        Without a lease the samples are consumed for the task at once; a leased
        task holds them until ``ack`` (or until the lease runs out). A blocking
        claim waits for a full batch (or the tail of a partition of known size)
        and raises ClaimTimeout otherwise. A claim whose ``request_id`` was
        answered before (a retry after a controller restart) gets that answer.
        """
        request = arguments.claim_request(request)  # checked once, here
        await self._drop_stale_before_claim(request.partition_id)
        part, policy, meta = self._claim_now(request)
        if meta is None and request.blocking:
            t0 = time.monotonic()
            try:
                retry = functools.partial(self._claim, part, request, policy, False)
                meta = await self._waits.wait(self.keys, part, request, policy, retry)
            finally:
                self.stats.observe("claim_wait_seconds", time.monotonic() - t0)
        return meta

    async def _drop_stale_before_claim(self, partition_id: str) -> None:
        """A versioned partition that drops stale samples drops them before a claim chooses
        (a sample put with an old version is stale on arrival); what the claim may see is
        bounded by its window either way, so this is housekeeping, not the bound."""
        part = self.keys.partitions.get(partition_id)
        if part is not None and part.versions is not None:
            await self._drop_stale(part)

    @served
    def claim_many(self, requests: list[ClaimRequest]) -> list[ClaimOutcome]:
        """Claims coalesced by one client process: each tried once, now, in order.

        One Ray round trip serves many concurrent claimers. Each request gets its
        own outcome (a bad one fails alone, as its typed error); a blocking claim
        with nothing due comes back ``must_wait`` and its caller makes it a plain
        blocking ``claim_meta`` with the rest of its timeout, so waiting is
        exactly as for a single claim and never holds the others' answers.
        """
        if not isinstance(requests, list):
            raise InvalidBatch(f"claim_many takes a list of ClaimRequest, got {type(requests)}")
        out = []
        for request in requests:
            try:
                request = arguments.claim_request(request)
                _, _, meta = self._claim_now(request)
                out.append(ClaimOutcome(meta=meta, must_wait=meta is None and request.blocking))
            except DataPlaneError as e:
                self.stats.error(e)
                out.append(ClaimOutcome(error=e))
        return out

    def _claim_now(self, request: ClaimRequest) -> tuple[Partition, PolicyCall, KVBatchMeta | None]:
        """Set up a checked claim (``KeySpace.claim_setup``: its policy and options too) and
        try it once; SamplesLost when a blocking one can never be served."""
        part, task, policy = self.keys.claim_setup(request)
        meta = self._claim(part, request, policy, not request.blocking)
        if meta is None and request.blocking:
            raise_if_unsatisfiable(self.keys, part, task)
        return part, policy, meta

    def _claim(
        self, part: Partition, request: ClaimRequest, policy: PolicyCall, partial_ok: bool
    ) -> KVBatchMeta | None:
        """Choose a batch, journal it, then hand it out (one synchronous step: no await)."""
        answered = self.keys.answered(part, request.request_id)
        if answered is not None:
            self.stats.inc("claims_replayed_total")
            return answered
        task, request_id = request.task_name, request.request_id
        self._drop_expired(part, policy)
        claimable, refused = self.keys.judged(part, task, request.required_fields, policy)
        if len(refused):  # no longer owed: admission may go on (architecture.md "Async RL")
            self._log("filtered", part.partition_id, task, [part.ids[r] for r in refused.tolist()])
            self.keys.mark_filtered(part, task, refused)
            self.changes.notify(part.partition_id)
        choice = self.keys.choose_for(
            request, part, policy, partial_ok=partial_ok, claimable=claimable
        )
        if choice is None:
            return None
        lease = part.declaration.task_leases.get(task)
        answer = choice.answer
        self._log(
            "claim",
            part.partition_id,
            task,
            answer.sample_ids,
            None if lease is None else time.time() + lease,
            answer.lease_id,
            request_id,
            answer.fields,
            answer.dp_rank,
        )
        meta = self.keys.grant(choice)
        self._compact_if_due()
        self.changes.notify(part.partition_id)
        self.stats.inc("claims_total")
        self.stats.inc("claimed_samples_total", meta.size)
        failpoints.die_once_if_armed(failpoints.CLAIM_ANSWER_LOST)  # journaled, not answered
        return meta

    def _drop_expired(self, part: Partition, policy: PolicyCall) -> None:
        """Groups past their deadline that this claim does not take partial: journaled and
        forgotten now (``core/group_deadline.py``), their bytes freed in the background (a
        snapshot meanwhile still names them: ``_freeing``)."""
        removal = async_rl.expired_removal(self.keys, part, policy)
        if removal is None:
            return
        removed = self._remove_rows("expired", part, removal.rows, removal.groups)
        async_rl.count_removal(removal, list(removed.births))  # its ids, in order
        self.stats.inc("expired_groups_dropped_total", removal.groups)
        self.stats.inc("expired_group_samples_dropped_total", len(removal.rows))
        self.changes.notify(part.partition_id)
        task = asyncio.ensure_future(self._free(removed))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    @served
    async def ack(self, partition_id: str, task_name: str, sample_ids: list[str], lease_id) -> int:
        """Acknowledge leased samples (done for the task); returns how many were newly done."""
        ids = arguments.id_list(sample_ids)
        part, rows = self.keys.check_ack(partition_id, task_name, ids, lease_id)
        self._log("ack", partition_id, task_name, ids)
        done = self.keys.apply_ack(part, task_name, rows)
        self._compact_if_due()
        self.changes.notify(partition_id)
        self.stats.inc("acked_samples_total", done)
        return done

    @served
    async def reset_consumption(self, partition_id: str, task_name: str) -> None:
        self.keys.task_of(self.keys.partition(partition_id), task_name)
        self._log("reset", partition_id, task_name)
        self.keys.reset_consumption(partition_id, task_name)
        self._compact_if_due()
        await self._waits.wake(partition_id)

    @served
    def partial_rollouts(self, partition_id: str, sample_ids: list[str]) -> list[list | None]:
        """What ``append_tokens`` reads first (``core/partial_rollouts.held``): per sample,
        its segments and token fields while in progress, None when not stored."""
        ids = arguments.id_list(sample_ids, partition_id=partition_id)
        return partial_rollouts.held(self.keys.partition(partition_id), ids)

    @served
    def commit_step(self, partition_id: str, task_name: str, step: int) -> None:
        """The trainer's step ``step`` is saved (``core/steps.py``); journaled first."""
        task = arguments.name(task_name, "task_name")
        step = arguments.count(step, "step", minimum=0)
        part, new = self.keys.check_commit_step(partition_id, task, step)
        if new:
            self._log("step", partition_id, task, step)
            steps.commit(part, task, step)
            self._compact_if_due()

    @served
    async def rewind_to_step(self, partition_id: str, task_name: str, step: int | None) -> int:
        """Hand back what the task claimed after ``step`` (``core/steps.py``); journaled
        first, then waiting claims may take it."""
        task = arguments.name(task_name, "task_name")
        step = arguments.optional_count(step, "step", minimum=0)
        part, rows = self.keys.rows_to_rewind(partition_id, task, step)
        self._log("rewind", partition_id, task, step)
        handed_back = self.keys.rewind(part, task, rows, step)
        self._compact_if_due()
        self.changes.notify(partition_id)  # owed again: admission counts them untrained
        await self._waits.wake(partition_id)
        return handed_back

    @served
    def check_consumption_status(self, partition_id: str, task_names: list[str]) -> bool:
        """True iff every named task has consumed every sample of the partition."""
        return all(t.done for t in self._consumption(partition_id, task_names))

    @served
    def consumption_detail(self, partition_id: str, task_names: list[str]) -> list[TaskConsumption]:
        """Per task: consumed / total / expected, leases held and redeliveries."""
        return self._consumption(partition_id, task_names)

    def _consumption(self, partition_id: str, task_names: list[str]) -> list[TaskConsumption]:
        part = self.keys.partition(partition_id)
        return [self.keys.consumption(part, t) for t in arguments.name_list(task_names, "tasks")]

    # ---- clearing -----------------------------------------------------------------
    @served
    async def clear(self, partition_id: str, sample_ids: list[str] | None) -> ClearResult:
        """Forget samples and free their bytes; ``None`` deletes the whole partition."""
        if sample_ids is None:
            return await self.delete_partition(partition_id)
        ids = arguments.id_list(sample_ids, partition_id=partition_id)
        part, rows = self.keys.rows_to_clear(partition_id, ids)
        removed = self._remove_rows("clear", part, rows)
        if not part.num_samples:
            self._emptied.emptied(partition_id)
        self.changes.notify(partition_id)
        failpoints.die_once_if_armed(failpoints.CLEAR_BEFORE_FREE)  # journaled, not freed
        freed = await self._free(removed)
        self.stats.inc("cleared_samples_total", len(ids))
        await self._apply_retention()
        return ClearResult(cleared=len(ids), bytes_freed=freed)

    # ---- checkpoint and restore of the whole store ------------------------------------
    @served
    async def checkpoint(self, directory: str, parent: str | None = None) -> str:
        """Save a cut of the store: declarations, samples (metadata and bytes), consumption
        and leases as of one commit sequence number, while commits and claims go on.

        Each unit writes its own files (the directory must be reachable from every
        unit's node), copying only values ``parent`` (an earlier checkpoint) lacks; the
        manifest with every checksum is written last and the directory renamed into
        place, so a crash mid-save never leaves one that loads. Returns its absolute path.
        """
        # Draining, no writer or claimer is left to yield to: the copy runs at full speed.
        share = 1.0 if self.draining else self.config.checkpoint_copy_share
        async with self._checkpointing:
            summary = await checkpoint.save(
                directory, self.units, self._holding_for_cut, self._cut_now, parent, share
            )
        self.last_checkpoint = summary
        self.stats.inc("checkpoints_total")
        self.stats.inc("checkpoint_bytes_written_total", summary.bytes_written)
        return summary.directory

    @contextlib.asynccontextmanager
    async def _holding_for_cut(self):
        async with self._lifecycle, self._cut_gate.closed():
            yield

    def _cut_now(self) -> Cut:
        return checkpoint.cut(self.keys, self._next_seq - 1, self.journal)

    @served
    async def restore(self, directory: str) -> int:
        """Load a checkpoint into this (empty) service; returns the number of samples."""
        async with self._lifecycle:
            self.keys, self._next_seq, loaded = await checkpoint.restore(
                directory, self.units, self.keys, self.journal
            )
        self.stats.inc("restores_total")
        return loaded
