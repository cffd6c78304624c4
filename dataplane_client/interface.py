"""The abstract data-plane client: NeMo-RL's ``DataPlaneClient`` contract, and our verbs.

NeMo-RL's trainer and workers talk to a data plane only through the eight
methods of :class:`DataPlaneClient` and :class:`~dataplane_client.wire.meta.KVBatchMeta`.
Code written against that class runs on any implementation of it. Implementations may
add methods and keyword arguments after these (ours: async twins, leases, ``ack``,
object fields), but never change what these do. Errors are the typed classes of
``dataplane_client.wire.errors``, each also the built-in named below.

:class:`DataPlaneService` is what both of our clients implement. Each of its verbs
is declared once, here (``@verb``): the declaration's signature and docstring are
the verb's, and its body checks the caller's arguments (typed ``InvalidBatch``
naming the argument) and returns them checked. Both clients take their public
``name`` and its awaitable ``name_async`` from it; a client writes only the verb's
private body ``_name`` (the checked arguments in) and two runners that complete a
body's result, synchronously or awaited (see :class:`DataPlaneService`).
"""

from __future__ import annotations

import dataclasses
import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar, cast

from dataplane_client.codec import appends, devices, prepare
from dataplane_client.wire import arguments
from dataplane_client.wire.messages import (
    Capabilities,
    ClaimRequest,
    ClearResult,
    PartitionDescription,
    PartitionSpec,
    RolloutGrant,
    ServiceInfo,
    StalenessSpec,
    TaskConsumption,
)
from dataplane_client.wire.meta import KVBatchMeta

if TYPE_CHECKING:
    from tensordict import TensorDict


class DataPlaneClient(ABC):
    """Per-sample storage keyed by ``(partition_id, sample_id)``, with task-mediated claims."""

    # ---- A. task-mediated ----------------------------------------------------------
    @abstractmethod
    def register_partition(
        self,
        partition_id: str,
        fields: Sequence[str],
        num_samples: int,
        consumer_tasks: Sequence[str],
        grpo_group_size: int | None = None,
        enums: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        """Declare a partition: its fields, expected sample count and consumer tasks.

        Registering an existing id again overwrites it cleanly (retries
        re-register). ``enums`` maps a field to a fixed vocabulary of strings,
        shipped once, so that string column travels as integer codes.
        """

    @abstractmethod
    def claim_meta(
        self,
        partition_id: str,
        task_name: str,
        required_fields: Sequence[str],
        batch_size: int,
        dp_rank: int | None = None,
        blocking: bool = True,
        timeout_s: float = 60.0,
    ) -> KVBatchMeta:
        """Claim up to ``batch_size`` samples ready for ``task_name``.

        A sample is ready when every field of ``required_fields`` is produced
        and ``task_name`` has not consumed it; the claim advances the task's
        cursor, so a claimed id is not returned to that task again. A task not
        registered for the partition raises ``KeyError`` naming it; a blocking
        claim that runs out of time raises ``TimeoutError``; a non-blocking one
        with nothing ready returns an empty meta (``len() == 0``, falsy).
        """

    @abstractmethod
    def get_data(self, meta: KVBatchMeta, select_fields: Sequence[str] | None = None) -> TensorDict:
        """Fetch the rows of ``meta`` as a TensorDict with ``batch_size=[meta.size]``.

        Fields read are ``select_fields``, else ``meta.fields``; with neither,
        ``ValueError`` (never every field silently). Rows come back in
        ``meta.sample_ids`` order.
        """

    @abstractmethod
    def check_consumption_status(self, partition_id: str, task_names: Sequence[str]) -> bool:
        """True iff every named task has consumed every sample of the partition."""

    # ---- B. direct-by-key ----------------------------------------------------------
    @abstractmethod
    def put_samples(
        self,
        sample_ids: Sequence[str],
        partition_id: str,
        fields: Any = None,
        tags: Sequence[dict] | None = None,
    ) -> KVBatchMeta:
        """Write fields of samples; returns a meta covering ``sample_ids``.

        ``fields`` is a TensorDict (plain dicts and BatchedDataDict are accepted
        too) of one row per id. Each write flips the produced bit of (sample,
        field), the signal that a stage is done. A non-tensor leaf raises
        ``TypeError`` saying "non-tensor"; strings travel through ``enums``.
        """

    @abstractmethod
    def get_samples(
        self, sample_ids: Sequence[str], partition_id: str, select_fields: Sequence[str]
    ) -> TensorDict:
        """Read fields of samples by id, in request order; touches no consumption cursor.

        Unknown or cleared ids, and fields not produced, raise ``KeyError``.
        """

    @abstractmethod
    def clear_samples(self, sample_ids: Sequence[str] | None, partition_id: str) -> None:
        """Drop the given samples; ``None`` drops the whole partition, so that the
        next ``register_partition`` of the same id starts clean."""

    # ---- C. lifecycle ----------------------------------------------------------------
    @abstractmethod
    def close(self) -> None:
        """Release handles. Idempotent."""


# ---- a verb, declared once -------------------------------------------------------------

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S")
F = TypeVar("F", bound=Callable[..., Any])


class _Checked:
    """A verb's arguments as its declaration checked them: what a client's body receives."""

    __slots__ = ("args", "kwargs")

    def __init__(self, args: tuple, kwargs: dict[str, Any]):
        self.args, self.kwargs = args, kwargs


def checked(*args: Any, **kwargs: Any) -> Any:
    """What a declaration returns: the arguments its clients' bodies receive, checked.
    (Typed Any: a declaration is annotated with the verb's result, what callers get.)"""
    return _Checked(args, kwargs)


def message(kind: Any, given: Mapping[str, Any]) -> Any:
    """The message ``kind`` (a dataclass of ``wire.messages``) made of a declaration's
    arguments (``locals()``): each field the argument of its name, as the caller gave it
    (unchecked: ``arguments`` checks the message)."""
    return kind(**{f.name: given[f.name] for f in dataclasses.fields(kind) if f.name in given})


def verb(declaration: F) -> F:
    """Declare a verb of a client class: ``declaration`` is the verb as callers see it.

    Its signature and docstring are the verb's; its body checks the caller's raw
    arguments and returns them checked (``return checked(...)``). The class gets the
    public method ``name``: the client's ``_check_open()``, the declaration, then the
    client's body ``_name(*checked)`` completed by ``_run_verb``. Write
    ``name_async = awaitable(name)`` after it for the awaitable twin (the same
    declaration, the body completed by ``_run_verb_async``). Until a class defines
    ``_name``, it is an abstract method there.
    """
    return cast(F, _Verb(declaration))


def awaitable(
    declared: Callable[Concatenate[S, P], R],
) -> Callable[Concatenate[S, P], Coroutine[Any, Any, R]]:
    """``name_async = awaitable(name)``: the awaitable twin of the verb declared as ``name``."""
    return cast(Any, _Twin(declared))


def _body(client: Any, name: str, args: Any) -> Callable[[], Any]:
    """The client's body of verb ``name`` with the arguments its declaration checked."""
    if not isinstance(args, _Checked):
        raise TypeError(f"the declaration of {name} must return checked(...), not {args!r:.80}")
    return functools.partial(getattr(client, f"_{name}"), *args.args, **args.kwargs)


def _abstract_body(owner: type, name: str) -> Callable[..., Any]:
    def body(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} has no body for {name}")

    body.__name__, body.__qualname__ = f"_{name}", f"{owner.__qualname__}._{name}"
    body.__doc__ = f"The client's part of ``{name}``: its checked arguments in, its result out."
    return abstractmethod(body)


class _Verb:
    """``@verb``: at class creation, the public method ``name`` (and the abstract ``_name``)."""

    def __init__(self, declaration: Callable[..., Any]):
        self.declaration = declaration
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        declaration = self.declaration
        self.name = name

        @functools.wraps(declaration)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            self._check_open()
            return self._run_verb(_body(self, name, declaration(self, *args, **kwargs)))

        setattr(owner, name, call)
        if f"_{name}" not in vars(owner):
            setattr(owner, f"_{name}", _abstract_body(owner, name))


class _Twin:
    """``awaitable(name)``: at class creation, the coroutine method ``name_async``."""

    def __init__(self, declared: Any):
        self.verb = declared

    def __set_name__(self, owner: type, name: str) -> None:
        verb_name = name.removesuffix("_async")
        if not isinstance(self.verb, _Verb) or f"{self.verb.name}_async" != name:
            raise TypeError(
                f"{owner.__qualname__}.{name}: write `x_async = awaitable(x)` after @verb x"
            )
        declaration = self.verb.declaration

        @functools.wraps(declaration)
        async def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            self._check_open()
            return await self._run_verb_async(
                _body(self, verb_name, declaration(self, *args, **kwargs))
            )

        call.__name__, call.__qualname__ = name, f"{owner.__qualname__}.{name}"
        setattr(owner, name, call)


class DataPlaneService(DataPlaneClient):
    """``DataPlaneClient`` plus the extras both of our clients offer, typed, each verb
    declared once.

    ``RayDataPlaneClient`` and ``InProcessDataPlaneClient`` implement this, so code may
    rely on these verbs without naming an implementation. The eight contract methods
    keep NeMo-RL's meaning; ours take keyword extras after the contract's arguments
    (leases, claim policies, ``overwrite``, ``device``, ...). The extras:

    - ``delete_partition``: the partition's samples, bytes and declaration gone.
    - ``ack``: a leased claim (or a slice of it) done for its task.
    - ``reset_consumption``: every sample claimable again by a task.
    - ``consumption_detail``: per task, consumed / total / expected, leases, redeliveries.
    - ``describe_partition``: fields, produced counts, consumption, bytes per unit.
    - ``service_info``: units, samples, bytes held and capacity (what rollout actors
      back off on).
    - the async-RL verbs (versions, rollout admission, eviction, peeking) and
      ``capabilities`` / ``ping``.

    Ray-only extras, not declared here: ``checkpoint`` / ``restore`` (the in-process
    store has no files to save), ``list_partitions`` and the admin endpoint's views.

    Awaitable twins: every verb ``v`` has ``v_async``, from the same declaration. A
    client implements each verb's body ``_v`` (the declaration's checked arguments in)
    and two runners: ``_run_verb`` completes a body's result, ``_run_verb_async`` awaits
    it without blocking the event loop. The Ray client's bodies return a Ray ObjectRef
    or a flow of them, which its runners wait on with ``ray.get`` or ``await``; the
    in-process client's bodies return the answer, and its awaitable runner runs the
    body in a worker thread (``asyncio.to_thread``), so a blocking claim never stalls
    the event loop.
    """

    # ---- what a client writes besides each verb's body --------------------------------
    @abstractmethod
    def _check_open(self) -> None:
        """ServiceUnavailable once the client is closed (before a verb reads its arguments)."""

    @abstractmethod
    def _run_verb(self, body: Callable[[], Any]) -> Any:
        """Call a verb's body (its checked arguments bound) and complete what it returns."""

    @abstractmethod
    async def _run_verb_async(self, body: Callable[[], Any]) -> Any:
        """``_run_verb``, awaitable: it never blocks the event loop."""

    # ---- A. task-mediated (the contract's, with our extras) ----------------------------
    @verb
    def register_partition(
        self,
        partition_id: str,
        fields: Sequence[str] = (),
        num_samples: int | None = None,
        consumer_tasks: Sequence[str] = (),
        grpo_group_size: int | None = None,
        enums: Mapping[str, Sequence[str]] | None = None,
        *,
        object_fields: Sequence[str] = (),
        task_leases: Mapping[str, float] | None = None,
        claim_policy: str | None = None,
        policy_options: Mapping[str, Any] | None = None,
        numeric_tags: Mapping[str, str] | None = None,
        staleness: StalenessSpec | None = None,
        group_fields: Sequence[str] = (),
        group_deadline_s: float | None = None,
    ) -> None:
        """Declare a partition; one of the same id is replaced (its samples deleted), so
        retries re-register cleanly.

        ``enums`` maps a field to its vocabulary: puts give strings, rows travel
        as int32 codes, gets return the strings. Ours, opt-in: ``object_fields``
        may hold msgpack values (any other non-tensor value is refused);
        ``task_leases`` maps a consumer task to a lease in seconds: that task's
        claims must be acknowledged with ``ack``, and samples whose lease runs
        out are handed out again. ``claim_policy`` names how claims choose
        samples (default ``"sequential"``, or ``"grpo_groups"`` with a group
        size; also ``"seqlen_balanced"`` and ``"token_budget"``), ``policy_options``
        its options (e.g. ``{"dp_size": 4}``); ``numeric_tags`` declares tags kept as typed
        columns (e.g. ``{"policy_version": "int64"}``); ``staleness`` makes the partition
        versioned (async RL: ``StalenessSpec``); ``group_fields`` names fields whose
        value is one per GRPO group (the ``group_id`` tag): stored once per group, read
        back by every member (needs ``grpo_group_size``). ``group_deadline_s``: a group
        whose members have not all arrived that many seconds after its first is no longer
        waited for: a claim of whole groups drops it (counted in ``describe_partition``'s
        ``groups``), a claim with ``policy_options={"partial_groups": True}`` takes the
        members present as a group (docs/architecture.md, "Stragglers").
        """
        return checked(arguments.partition_spec(message(PartitionSpec, locals())))

    register_partition_async = awaitable(register_partition)

    @verb
    def claim_meta(
        self,
        partition_id: str,
        task_name: str,
        required_fields: Sequence[str],
        batch_size: int,
        dp_rank: int | None = None,
        blocking: bool = True,
        timeout_s: float = 60.0,
        *,
        claim_policy: str | None = None,
        policy_options: Mapping[str, Any] | None = None,
        where: Any = None,
        max_staleness: int | None = None,
    ) -> KVBatchMeta:
        """Claim up to ``batch_size`` ready samples the task has not consumed yet (a
        non-blocking claim with nothing due: an empty meta; a blocking one that runs out
        of time: ``ClaimTimeout``, a ``TimeoutError``).

        ``claim_policy`` overrides the partition's for this claim (``policy_options``:
        its options, over the partition's when it is the partition's own policy).
        ``where`` keeps only samples whose numeric tags pass every comparison (e.g.
        ``"reward_std > 0"``); ``max_staleness`` tightens a versioned partition's window
        (a looser one than its bound for the task is InvalidBatch).
        On Ray, concurrent claims of one client (threads and coroutines alike) share one
        controller call (``ClaimBatcher``); each still gets its own answer, error and
        timeout.
        """
        return checked(arguments.claim_request(message(ClaimRequest, locals())))

    claim_meta_async = awaitable(claim_meta)

    @verb
    def get_data(
        self, meta: KVBatchMeta, select_fields: Sequence[str] | None = None, device: Any = None
    ) -> TensorDict:
        """Read a meta's samples as a TensorDict: ``select_fields``, else the meta's fields
        (neither: ``InvalidBatch``, never every field silently), rows in
        ``meta.sample_ids`` order. ``device`` (ours: ``'cpu'``, ``'cuda'``, ``'cuda:<i>'``
        or a ``torch.device``): the TensorDict and its tensors on that device, copied there
        straight from where the rows lie (host-to-device from pinned memory on a GPU, one
        wait for the whole batch). None, the default: in host memory, zero-copy where the
        rows allow. Any other value: ``InvalidBatch`` naming ``device``. On Ray, a
        claimed meta says where its rows live (``routes``): read straight from the units."""
        meta = arguments.batch_meta(meta, "get_data")
        fields = prepare.read_fields(meta, select_fields)
        ids = arguments.id_list(
            meta.sample_ids, partition_id=arguments.partition_name(meta.partition_id)
        )
        return checked(meta, ids, fields, devices.parse_device(device))

    get_data_async = awaitable(get_data)

    @verb
    def check_consumption_status(self, partition_id: str, task_names: Sequence[str]) -> bool:
        """True iff every named task has consumed every sample of the partition."""
        return checked(
            arguments.partition_name(partition_id), arguments.name_list(task_names, "task_names")
        )

    check_consumption_status_async = awaitable(check_consumption_status)

    # ---- B. direct-by-key ------------------------------------------------------------
    @verb
    def put_samples(
        self,
        sample_ids: Sequence[str],
        partition_id: str,
        fields: Any = None,
        tags: Sequence[dict] | None = None,
        overwrite: bool = False,
        *,
        version: int | Sequence[int] | None = None,
    ) -> KVBatchMeta:
        """Write fields of samples (new samples, or new fields of existing ones); returns
        a meta covering ``sample_ids``.

        ``fields``: a TensorDict (plain dicts and BatchedDataDict are accepted too) of one
        row per id. Each write flips the produced bit of (sample, field), the signal that
        a stage is done. A non-tensor leaf raises ``NonTensorField`` (a ``TypeError``)
        saying "non-tensor"; strings travel through ``enums``. ``overwrite`` (ours)
        replaces fields already produced. ``version`` (ours, async RL): the policy version
        the samples were generated under, one int for all or one per sample; a versioned
        partition keeps it as its version column (readers see it in ``meta.tags`` under
        the partition's ``StalenessSpec.version_tag``); an unversioned one keeps it as a
        plain ``weight_version`` tag.
        """
        return checked(
            prepare.put_arguments(sample_ids, partition_id, fields, tags, overwrite, version)
        )

    put_samples_async = awaitable(put_samples)

    @verb
    def get_samples(
        self,
        sample_ids: Sequence[str],
        partition_id: str,
        select_fields: Sequence[str],
        device: Any = None,
    ) -> TensorDict:
        """Read fields of samples as a TensorDict in ``sample_ids`` order; touches no
        consumption cursor. Unknown or cleared ids, and fields not produced, raise
        ``KeyError``. ``device`` as in :meth:`get_data`."""
        pid = arguments.partition_name(partition_id)
        return checked(
            arguments.id_list(sample_ids, partition_id=pid),
            pid,
            arguments.name_list(select_fields, "select_fields"),
            devices.parse_device(device),
        )

    get_samples_async = awaitable(get_samples)

    # Ours return what was freed; the contract's clear_samples says None.
    @verb
    def clear_samples(  # type: ignore[override]
        self, sample_ids: Sequence[str] | None, partition_id: str
    ) -> ClearResult:
        """Forget samples and free their bytes; ``None`` deletes the whole partition, so
        that the next ``register_partition`` of the same id starts clean."""
        pid = arguments.partition_name(partition_id)
        ids = None if sample_ids is None else arguments.id_list(sample_ids, partition_id=pid)
        return checked(ids, pid)

    clear_samples_async = awaitable(clear_samples)

    # ---- extras ----------------------------------------------------------------------
    @verb
    def delete_partition(self, partition_id: str) -> ClearResult:
        """Delete the partition (samples, bytes, declaration); what was freed.
        An unknown partition raises ``UnknownPartition`` (a ``KeyError``)."""
        return checked(arguments.partition_name(partition_id))

    delete_partition_async = awaitable(delete_partition)

    @verb
    def ack(self, meta: KVBatchMeta) -> int:
        """Acknowledge a leased claim (or a slice of it): its samples are done for its task;
        returns how many the ack completed. Late acks are harmless while nobody re-claimed
        the samples; once another claim holds them, the ack raises ``LeaseExpired`` and
        changes nothing."""
        return checked(*arguments.lease_ack(meta))

    ack_async = awaitable(ack)

    @verb
    def reset_consumption(self, partition_id: str, task_name: str) -> None:
        """Make every sample of the partition claimable again by the task."""
        return checked(
            arguments.partition_name(partition_id), arguments.name(task_name, "task_name")
        )

    reset_consumption_async = awaitable(reset_consumption)

    @verb
    def commit_step(self, partition_id: str, task_name: str, step: int) -> None:
        """The trainer's step-``step`` policy is saved: a run resumed from it later
        (``rewind_to_step``) gets back exactly the samples the task claimed after this
        call, and none claimed before. Call it once the checkpoint is durable. Steps only
        move forward (a lower one is ``InvalidBatch``); the last one again is a no-op."""
        return checked(
            arguments.partition_name(partition_id),
            arguments.name(task_name, "task_name"),
            arguments.count(step, "step", minimum=0),
        )

    commit_step_async = awaitable(commit_step)

    @verb
    def rewind_to_step(self, partition_id: str, task_name: str, step: int | None) -> int:
        """A trainer resumed from its step-``step`` checkpoint: every sample the task
        claimed after ``commit_step(step)`` is claimable again (consumed or leased),
        those claimed up to it stay done, and later steps' commits are forgotten.
        ``None``: back to before the first commit (every claim handed back). An
        uncommitted step is ``InvalidBatch`` naming the committed ones. Returns how many
        samples were handed back (cleared or dropped ones are gone either way)."""
        return checked(
            arguments.partition_name(partition_id),
            arguments.name(task_name, "task_name"),
            arguments.optional_count(step, "step", minimum=0),
        )

    rewind_to_step_async = awaitable(rewind_to_step)

    @verb
    def consumption_detail(
        self, partition_id: str, task_names: Sequence[str]
    ) -> list[TaskConsumption]:
        """Per named task, in order: consumed / total / expected, leases, redeliveries."""
        return checked(
            arguments.partition_name(partition_id), arguments.name_list(task_names, "task_names")
        )

    consumption_detail_async = awaitable(consumption_detail)

    @verb
    def describe_partition(self, partition_id: str) -> PartitionDescription:
        """The partition's fields (and how many samples produced each), consumption per
        task, claims waiting and bytes per storage unit."""
        return checked(arguments.partition_name(partition_id))

    describe_partition_async = awaitable(describe_partition)

    @verb
    def service_info(self) -> ServiceInfo:
        """The service's storage units (alive, bytes, samples, capacity) and totals: what
        rollout actors back off on."""
        return checked()

    service_info_async = awaitable(service_info)

    # ---- async RL (a partition registered with a StalenessSpec) -----------------------
    @verb
    def set_policy_version(self, partition_id: str, version: int) -> int:
        """Publish the trainer's policy version; below the current one: VersionRegression.
        Samples now older than a task's window are dropped (when the partition drops them)."""
        return checked(arguments.partition_name(partition_id), version)

    set_policy_version_async = awaitable(set_policy_version)

    @verb
    def policy_version(self, partition_id: str) -> int:
        """The partition's current policy version (0 until set)."""
        return checked(arguments.partition_name(partition_id))

    policy_version_async = awaitable(policy_version)

    @verb
    def admit_rollouts(
        self,
        partition_id: str,
        n: int,
        *,
        wait: bool = False,
        timeout_s: float = 60.0,
        lease_s: float = 300.0,
    ) -> RolloutGrant | None:
        """Leave to start ``n`` trajectories now, while samples started and not trained stay
        within ``(max_staleness + 1) * admission_batch`` (less with ``StalenessSpec(pace=True)``
        while an old sample is outstanding): a grant; None when there is no room
        and ``wait`` is False; AdmissionTimeout when waiting ran out. Release it with
        ``release_rollouts`` once its samples are put."""
        return checked(arguments.partition_name(partition_id), n, wait, timeout_s, lease_s)

    admit_rollouts_async = awaitable(admit_rollouts)

    @verb
    def release_rollouts(self, grant: RolloutGrant) -> bool:
        """The grant's samples are put (or abandoned): it stops counting. False: it had
        expired or was released already."""
        return checked(arguments.rollout_grant(grant))

    release_rollouts_async = awaitable(release_rollouts)

    @verb
    def append_tokens(
        self,
        sample_ids: Sequence[str],
        partition_id: str,
        fields: Any,
        version: int,
        *,
        tags: Sequence[dict] | None = None,
        start: bool = False,
        finish: bool = False,
    ) -> KVBatchMeta:
        """Partial rollouts: append tokens generated under policy ``version`` to each
        sample's jagged per-token fields (token ids, generation logprobs, masks; one row
        per sample, every field as many tokens), recording the segment. ``start=True``
        begins the samples (their first segment; ``tags``: group_id and others, as a
        put's); later appends resume them. A sample in progress is not claimable, counts
        against admission, and its staleness is its oldest segment's version;
        ``finish=True`` (with the last tokens) makes it claimable. ``meta.tags`` then read
        ``token_segments``: [[version, tokens], ...], oldest first. Errors, nothing
        stored: a non-jagged field, or other fields than the first segment's
        (``InvalidBatch``); a version below the last segment's (``VersionRegression``); a
        finished sample or one ``put_samples`` wrote whole (``RolloutFinished``); a
        resumed sample not stored (never started, cleared, dropped as stale, evicted:
        ``SamplesNotFound``). Other fields (rewards) go by ``put_samples`` as usual
        (docs/architecture.md, "Partial rollouts")."""
        return checked(
            appends.append_arguments(sample_ids, partition_id, fields, version, tags, finish, start)
        )

    append_tokens_async = awaitable(append_tokens)

    @verb
    def evict_samples(self, sample_ids: Sequence[str], partition_id: str) -> int:
        """Evict samples by id: cleared, counted as evicted and listed as recently dropped;
        returns how many."""
        pid = arguments.partition_name(partition_id)
        return checked(arguments.id_list(sample_ids, partition_id=pid), pid)

    evict_samples_async = awaitable(evict_samples)

    @verb
    def clear_versions(self, partition_id: str, lowest: int, highest: int) -> ClearResult:
        """Retire whole generations: every sample whose version is in [lowest, highest]."""
        return checked(arguments.partition_name(partition_id), lowest, highest)

    clear_versions_async = awaitable(clear_versions)

    @verb
    def peek_meta(
        self,
        partition_id: str,
        task_name: str,
        required_fields: Sequence[str],
        batch_size: int,
        *,
        where: Any = None,
        max_staleness: int | None = None,
    ) -> KVBatchMeta:
        """The batch ``claim_meta`` would hand out now, claiming nothing (empty: none)."""
        request = message(ClaimRequest, {**locals(), "dp_rank": None, "blocking": False})
        return checked(arguments.claim_request(request))

    peek_meta_async = awaitable(peek_meta)

    @verb
    def ready_depth(
        self, partition_id: str, task_names: Sequence[str], required_fields: Sequence[str] = ()
    ) -> dict[str, int]:
        """Per task: how many samples it could claim now (within its staleness window)."""
        return checked(
            arguments.partition_name(partition_id),
            arguments.name_list(task_names, "task_names"),
            arguments.name_list(required_fields, "required_fields", allow_empty=True),
        )

    ready_depth_async = awaitable(ready_depth)

    @verb
    def capabilities(self) -> Capabilities:
        """What this implementation supports: verbs, claim policies, filter operators."""
        return checked()

    capabilities_async = awaitable(capabilities)

    @verb
    def ping(self) -> bool:
        """True when the service answers."""
        return checked()

    ping_async = awaitable(ping)


def service_verbs(cls: type) -> list[str]:
    """The public verbs of ``DataPlaneService`` that ``cls`` has (its capabilities' list)."""
    names = {n for n in dir(DataPlaneService) if not n.startswith("_")}
    return sorted(n for n in names if callable(getattr(cls, n, None)))
