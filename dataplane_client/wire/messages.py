"""Typed messages: everything that crosses an actor boundary, in one place.

Client, controller, storage units and the admin endpoint exchange these frozen
dataclasses (never string-keyed dicts), so a reader sees every field a message
carries and a consumer reads attributes instead of guarding keys. They live in
the bottom layer because the client builds and reads most of them.

Only builtins, numpy arrays and other messages inside: they pickle through Ray
and nothing here is reachable from a non-Ray client.
"""

from __future__ import annotations

import functools
import hashlib
import json
import pickle
from dataclasses import dataclass, field
from typing import Any

from dataplane_client.wire.meta import KVBatchMeta

# ---- storage units -----------------------------------------------------------------


@dataclass(frozen=True)
class UnitInfo:
    """Who a storage unit is and where it runs (its answer to ``ping``)."""

    index: int
    node_id: str
    node_ip: str
    pid: int
    shm: bool  # keeps chunks in shared memory a same-node client can map


@dataclass(frozen=True)
class UnitSnapshot:
    """A unit's figures for the admin endpoint and metrics."""

    index: int
    node_id: str
    node_ip: str
    bytes: int
    samples: int
    capacity_bytes: int
    warm_reserve_bytes: int
    partition_bytes: dict[str, int] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)  # Stats.snapshot()


# ---- controller: wiring and the data path --------------------------------------------


@dataclass(frozen=True)
class Routing:
    """What a client needs to reach the units: handles, liveness, nodes, shm ability."""

    units: list[Any]
    alive: list[bool]
    nodes: list[str]
    shm: list[bool]
    replicas: int = 1  # copies a put writes of each sample (config ``replicas``)
    # A client process's put admission (config ``put_credits``, ``put_admission_timeout_s``,
    # ``put_queue_limit``): see dataplane_client.transport.admission.
    put_credits: int = 256
    put_admission_timeout_s: float = 60.0
    put_queue_limit: int = 65536
    stage_ttl_s: float = 30.0  # a put's deadline, from its admission (put_deadline)
    cross_node_transport: str = "auto"  # config ``cross_node_transport`` (transport/payload)
    transfer_puts: bool = False  # config ``transfer_puts``


# The tag a put's ``version=`` is kept under, unless a StalenessSpec names another.
DEFAULT_VERSION_TAG = "weight_version"

# Partial rollouts (``append_tokens``): tags the store keeps with such a sample, read back
# in ``meta.tags``. Its segments, oldest first: [[policy version, tokens appended], ...];
# the per-token fields they cover; True while it is being generated (not claimable).
SEGMENTS_TAG = "token_segments"
TOKEN_FIELDS_TAG = "token_fields"
IN_PROGRESS_TAG = "in_progress"
PARTIAL_NOT_STORED = (
    "no partial rollout of these samples is stored (start=True begins one; or it was "
    "cleared, dropped as stale or evicted)"
)


@dataclass(frozen=True)
class FieldCodecs:
    """How a partition's non-tensor fields travel, declared at registration.

    ``enums`` maps a field to its vocabulary (rows travel as int32 codes and
    read back as the strings); ``object_fields`` may hold msgpack values. Any
    other field takes tensors only.
    """

    enums: dict[str, tuple[str, ...]] = field(default_factory=dict)
    object_fields: frozenset[str] = frozenset()
    # Fields whose value is one per GRPO group (``group_fields``): a put sends and the
    # units store each group's value once (``dataplane_client.wire.group_fields``).
    group_fields: frozenset[str] = frozenset()
    # A versioned partition's ``StalenessSpec.version_tag``: the typed column a put's
    # ``version=`` fills (``dataplane_client.codec.prepare.write``). None: not versioned.
    version_tag: str | None = None

    @functools.cached_property
    def key(self) -> str:
        """A fingerprint of the encoding: equal keys encode and decode every row alike. A
        client checks its cached codecs against the partition's with it (a partition
        re-registered with another vocabulary has another key)."""
        words = sorted((name, list(vocab)) for name, vocab in self.enums.items())
        declared: list = [words, sorted(self.object_fields)]
        if self.group_fields:  # without them the key is what it always was
            declared.append(sorted(self.group_fields))
        if self.version_tag is not None:  # likewise: unversioned keys are unchanged
            declared.append(["version_tag", self.version_tag])
        blob = json.dumps(declared, ensure_ascii=False)
        return hashlib.blake2b(blob.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


@dataclass(frozen=True)
class CommitRequest:
    """A writer's commit: its bytes are staged under ``write_id`` on ``staged_units``.

    ``units[i]`` is where sample ``sample_ids[i]`` was staged; ``schemas`` maps
    each written field to its (layout, dtype, trailing shape); ``tags`` holds one
    dict per sample (or None). With replication, ``replicas[i]`` is the unit on
    another node that holds the sample's second copy (-1: none); it is staged
    too, and the one commit publishes both copies or neither.
    """

    partition_id: str
    write_id: str
    sample_ids: list[str]
    units: list[int]
    schemas: dict[str, tuple]
    sequence_lengths: list[int] | None
    tags: list[dict] | None
    overwrite: bool
    staged_units: list[int]
    replicas: list[int] | None = None
    # The FieldCodecs.key the writer encoded with; the commit is refused (CodecsChanged)
    # when the partition's differs (re-registered since). None: not checked.
    codecs_key: str | None = None
    # The put's deadline (time.time(), ``put_deadline``): a commit reaching the controller
    # later is refused (Overloaded) before any work. None: no deadline.
    expires_at: float | None = None


@dataclass(frozen=True)
class CommitResult:
    """The answer to a commit.

    ``rerouted`` non-empty means nothing was committed: some existing samples
    live on other units than the writer assumed (sample_id -> unit); the
    writer stages again there. Otherwise ``sequence_lengths`` are the rows'
    recorded lengths, in the order of the commit's ids. ``rerouted_replicas``
    says where rerouted samples with a second copy keep it.
    """

    rerouted: dict[str, int] = field(default_factory=dict)
    rerouted_replicas: dict[str, int] = field(default_factory=dict)
    sequence_lengths: list[int] = field(default_factory=list)
    # The seq the write was published under: its rows' generation (-1: not known, e.g. the
    # answer to a retried commit); the writer remembers it with the rows' units.
    generation: int = -1


@dataclass(frozen=True)
class Location:
    """A validated read: the fields to read and, per requested id, its unit."""

    fields: list[str]
    units: list[int]
    codecs_key: str = ""  # the partition's FieldCodecs.key: how its rows are encoded
    generations: list[int] | None = None  # per id: its bytes' generation (-1: unknown)


@dataclass(frozen=True)
class PartitionSpec:
    """One ``register_partition`` call, whole: both clients build it, the Ray client sends
    it, and the key space turns it into the declaration it keeps (checked again there:
    ``arguments.partition_spec``, then the claim policy's own checks).

    ``claim_policy`` names how claims choose rows (None: ``"grpo_groups"`` with a
    ``grpo_group_size``, else ``"sequential"``), with ``policy_options`` for it;
    ``numeric_tags`` maps a tag to the dtype it is kept as (a typed column claim
    policies filter on, e.g. ``{"policy_version": "int64"}``).
    """

    partition_id: str
    fields: Any = ()
    num_samples: Any = None
    consumer_tasks: Any = ()
    grpo_group_size: Any = None
    task_leases: Any = None
    enums: Any = None
    object_fields: Any = ()
    claim_policy: Any = None
    policy_options: Any = None
    numeric_tags: Any = None
    staleness: Any = None  # StalenessSpec | None: a versioned partition (async RL)
    group_fields: Any = ()  # fields stored once per GRPO group (needs grpo_group_size)
    # seconds from a group's first member after which a group still short of members is
    # dropped, or handed out partial to a claim that asks (needs grpo_group_size)
    group_deadline_s: Any = None


@dataclass(frozen=True)
class StalenessSpec:
    """A partition's async-RL options (opt in: a partition without one behaves as before).

    Every put says the policy version its samples were generated under
    (``put_samples(..., version=v)``), kept as an int64 column and read back in
    ``meta.tags`` under ``version_tag`` (a put may also give that tag itself). ``max_staleness``
    bounds, per task (a dict) or for every task (an int), how many versions
    behind the current one (``set_policy_version``) a claimed sample may be; a
    GRPO group is as old as its oldest member. ``stale_samples``: "drop"
    (cleared, counted, ids listed for a while) or "keep" (left for other tasks).
    ``admission_batch`` (the trainer's batch, in samples) turns on
    ``admit_rollouts``: grants only while samples started but not trained stay
    within ``(max_staleness + 1) * admission_batch``, and, with
    ``oversample_ratio``, while samples granted at one version stay within
    ``ratio * admission_batch``. ``evict_stale``: a put that finds a unit full
    evicts whole unclaimed groups of the oldest version instead of failing.
    ``pace`` (with ``admission_batch``): admission paces producers instead of letting
    slow samples go stale. The room follows how far the trainer is from the oldest
    sample started and not trained: with ``h`` the versions the trainer may still
    publish before that sample leaves the window (``max_staleness`` when none is
    outstanding), grants only while started and not trained stay within
    ``(h + 1) * admission_batch``. A trainer that trains ``admission_batch`` samples
    per version then has to train that sample before it goes stale (no stale drops);
    producers should ask in units that divide ``admission_batch``.
    """

    version_tag: str = DEFAULT_VERSION_TAG
    max_staleness: Any = None  # int (every task) | {task: int} | None (no bound)
    stale_samples: str = "drop"
    admission_batch: Any = None
    oversample_ratio: Any = None
    evict_stale: bool = False
    pace: bool = False

    def bound(self, task: str) -> int | None:
        """The task's staleness bound (None: unbounded); only on a checked spec."""
        if isinstance(self.max_staleness, dict):
            return self.max_staleness.get(task)
        return self.max_staleness


@dataclass(frozen=True)
class TagFilter:
    """One comparison of a claim's ``where``: ``tag op value`` on a numeric tag column."""

    tag: str
    op: str  # one of TAG_FILTER_OPS
    value: float


TAG_FILTER_OPS = ("<", "<=", ">", ">=", "==", "!=")


@dataclass(frozen=True)
class RolloutGrant:
    """Leave to start ``n`` trajectories at policy ``version`` (``admit_rollouts``).

    Counted against the partition's admission bound until ``release_rollouts``
    or until ``expires_at`` (wall clock): a producer that dies gives it back then.
    """

    grant_id: int
    partition_id: str
    n: int
    version: int
    expires_at: float


@dataclass(frozen=True)
class StalenessInfo:
    """A versioned partition's async-RL state: what ``describe_partition`` and the admin
    endpoint show and metrics export."""

    version: int
    version_tag: str
    max_staleness: dict[str, int]  # bounded tasks only
    stale_samples: str
    ready_by_version: dict[int, int]  # live samples per version tag
    dropped_stale: dict[str, int]  # per task whose bound made them stale
    evicted: int
    granted_in_flight: int  # samples of live grants
    grants: int  # live grants
    untrained: int  # live samples some bounded task has not consumed
    # (max_staleness + 1) * admission_batch; paced: less while an old sample is outstanding
    admission_limit: int | None
    admission_waits: int
    recently_dropped: list[str]  # ids dropped or evicted, newest last (the last 4,096)
    # per task: samples its filtered claims refused, no longer owed (never counted stale)
    filtered: dict[str, int]
    partial_in_progress: int = 0  # partial rollouts being generated (append_tokens)


@dataclass(frozen=True)
class GroupDeadlineInfo:
    """A partition's group deadline (``group_deadline_s``) and what it did: groups whose
    members had not all arrived in time, dropped by claims of whole groups
    (docs/architecture.md, "Stragglers")."""

    deadline_s: float
    dropped_groups: int
    dropped_samples: int  # their members that had arrived
    overdue_groups: int  # past their deadline now, not yet dropped (or taken partial)
    recently_dropped: list[str]  # ids of dropped members, newest last (the last 4,096)


@dataclass(frozen=True)
class Capabilities:
    """What this implementation supports (``capabilities``): a trainer checks before use."""

    implementation: str
    version: str
    claim_policies: list[str]
    tag_filter_ops: list[str]
    verbs: list[str]
    async_rl: bool = True


@dataclass(frozen=True)
class ClaimRequest:
    """One ``claim_meta`` call, whole: what both clients check (``arguments.claim_request``),
    what ``claim_many`` carries in batches and a blocking ``claim_meta`` alone.

    Arguments are checked by the controller per request, so a bad one fails alone.
    """

    partition_id: str
    task_name: str
    required_fields: list[str]
    batch_size: int
    dp_rank: int | None
    blocking: bool
    # Names this claim across retries: a controller that answered it before (and died
    # before the answer arrived) gives the same batch again, never a second one.
    request_id: str | None = None
    timeout_s: float = 60.0  # a blocking claim's wait (claim_many never waits)
    claim_policy: str | None = None  # None: the partition's
    policy_options: dict[str, Any] | None = None  # over the partition's, for its policy
    where: tuple[TagFilter, ...] = ()  # numeric-tag comparisons, all must hold
    max_staleness: int | None = None  # tighter than the partition's bound for this claim

    def nothing_due(self) -> KVBatchMeta:
        """The answer to a non-blocking claim with nothing due: an empty ``KVBatchMeta``
        (falsy: ``len() == 0``), as NeMo-RL answers it, never None."""
        extra = {} if self.dp_rank is None else {"dp_rank": self.dp_rank}  # as a full batch
        return KVBatchMeta(
            self.partition_id,
            self.task_name,
            [],
            fields=list(self.required_fields),
            extra_info=extra,
        )


@dataclass(frozen=True)
class ClaimOutcome:
    """The answer to one request of a ``claim_many`` batch: exactly one of three.

    ``meta`` (or None for a non-blocking claim with nothing due); ``error``, a
    typed error for this request alone; or ``must_wait``: a blocking claim with
    no batch due now, which the caller then makes as a plain blocking claim.
    """

    meta: Any = None  # KVBatchMeta | None
    error: BaseException | None = None
    must_wait: bool = False


@dataclass(frozen=True)
class ClearResult:
    cleared: int
    bytes_freed: int


@dataclass(frozen=True)
class TaskConsumption:
    """How far one consumer task got through a partition.

    ``consumed`` counts live samples the task is done with (for a leased task:
    acknowledged); ``leased`` counts those it holds under an unexpired lease.
    ``done``: every live sample is consumed (cleared ones count as done) and,
    when the partition's size was declared, that many samples were written.
    ``lost`` counts live samples not yet consumed whose storage unit is gone:
    terminal, so they count towards ``done``.
    """

    task: str
    consumed: int
    total: int
    expected: int | None
    done: bool
    leased: int = 0
    lease_s: float | None = None
    redeliveries: int = 0
    lost: int = 0
    committed_step: int | None = None  # the trainer's last ``commit_step`` (None: none)


# ---- controller: admin views ---------------------------------------------------------


@dataclass(frozen=True)
class UnitStatus:
    index: int
    node_id: str
    node_ip: str
    alive: bool
    bytes: int
    samples: int
    capacity_bytes: int
    # How reader processes on other nodes reach this unit's bytes, as their probes chose.
    payload_paths: list[PayloadChoice] = field(default_factory=list)


@dataclass(frozen=True)
class PayloadChoice:
    """``readers`` processes on other nodes chose ``path`` ("mooncake-tcp", "ray") to reach
    a unit's bytes; ``detail``: the engine's peer, or why they fell back to Ray."""

    path: str
    detail: str
    readers: int


@dataclass(frozen=True)
class CheckpointSummary:
    """The last checkpoint this service saved: where, its cut's position (the last commit
    sequence number in it; the journal's generation and record count then, -1 without a
    journal) and time, and what it cost (bytes written, bytes linked from its parent)."""

    directory: str
    position: int
    journal_generation: int
    journal_records: int
    taken_at: float
    parent: str  # "" for a full checkpoint
    samples: int
    bytes_written: int
    bytes_linked: int
    seconds: float
    partitions: dict[str, int] = field(default_factory=dict)  # samples of each in the cut


@dataclass(frozen=True)
class ServiceInfo:
    name: str
    namespace: str
    version: str
    started_at: float
    uptime_s: float
    draining: bool
    num_partitions: int
    num_samples: int
    bytes: int
    capacity_bytes: int
    units: list[UnitStatus]
    # How the asking client process reaches each unit's bytes (filled in by the Ray
    # client, from its capability probe at connect; empty from the service itself).
    payload_paths: list[PayloadPath] = field(default_factory=list)
    # What a committed sample survives (DataPlaneConfig.durability) and where it is kept.
    durability: str = "memory"
    state_dir: str = ""
    last_checkpoint: CheckpointSummary | None = None  # none saved since the controller started


@dataclass(frozen=True)
class PartitionSummary:
    partition_id: str
    num_samples: int
    bytes: int
    fields: list[str]
    consumer_tasks: list[str]
    created_at: float


@dataclass(frozen=True)
class FieldSummary:
    name: str
    dtype: str  # "" until the field's first write
    layout: str  # "dense" | "jagged" | "object" | ""
    trailing_shape: list[int]
    produced: int


@dataclass(frozen=True)
class PartitionDescription:
    partition_id: str
    num_samples: int
    expected_samples: int | None
    group_size: int | None
    created_at: float
    fields: list[FieldSummary]
    consumption: list[TaskConsumption]
    pending_claims: int
    bytes_per_unit: list[int]  # index = unit
    staleness: StalenessInfo | None = None  # a versioned partition's async-RL state
    groups: GroupDeadlineInfo | None = None  # a partition with a group_deadline_s
    durability: str = "memory"  # the service's level: what its samples survive
    checkpointed_samples: int | None = None  # of it in the last checkpoint (None: none yet)
    last_checkpoint_at: float | None = None


@dataclass(frozen=True)
class SampleStatus:
    """One sample as the admin endpoint shows it; ``redeliveries`` counts, over
    every leased task, the times it was handed out again after a lease expired.
    ``leased_by``: task -> lease id of the claim holding it (unexpired, unacknowledged);
    ``status``: lost, pending, leased, consumed or ready, the first that holds."""

    sample_id: str
    fields: list[str]
    sequence_length: int
    unit: int
    consumed_by: list[str]
    tags: dict[str, Any]
    lost: bool
    redeliveries: int = 0
    leased_by: dict[str, int] = field(default_factory=dict)
    status: str = "ready"


@dataclass(frozen=True)
class SamplePage:
    samples: list[SampleStatus]
    total: int
    next_offset: int | None


@dataclass(frozen=True)
class PartitionStats:
    partition_id: str
    num_samples: int
    staleness: StalenessInfo | None = None  # a versioned partition's async-RL figures


@dataclass(frozen=True)
class ControllerSnapshot:
    """The controller's figures for metrics: counters, waiting claims, live partitions."""

    stats: dict[str, Any]  # Stats.snapshot()
    claims_waiting: int
    partitions: list[PartitionStats]
    # Put admission, over the writer processes' latest reports (``WriterLoad``).
    puts_waiting: int = 0
    puts_in_flight: int = 0
    last_checkpoint: CheckpointSummary | None = None


@dataclass(frozen=True)
class WriterLoad:
    """A writer process's put admission figures (``dataplane_client.transport.admission``), sent
    with its commits and when it refuses a put: how operators see writers queueing."""

    writer: str  # the client's id
    waiting: int  # puts waiting for a credit now
    in_flight: int  # puts holding a credit now
    admitted_total: int
    waited_total: int  # admitted after waiting in the queue
    wait_seconds_total: float  # time those waited, summed
    rejected_total: int  # refused with Overloaded


# ---- storage units: where bulk bytes sit in shared memory -----------------------------


@dataclass(frozen=True)
class ChunkRef:
    """How a same-node process opens one of a unit's shared-memory chunks.

    ``path`` (``/proc/<unit pid>/fd/<n>``) names a descriptor number, which the
    unit's kernel reuses once the chunk is freed; ``name`` is the chunk's memfd
    name, unique for the life of the unit process, so whoever opens ``path``
    checks it got this chunk and not a later one.
    """

    path: str
    name: str


@dataclass(frozen=True)
class ShmRegion:
    """Where a same-node writer copies one field of a staged write: ``nbytes`` at ``offset``."""

    chunk: ChunkRef
    offset: int
    nbytes: int


@dataclass(frozen=True)
class ChunkClosures:
    """The chunks a unit closed since a same-node client's ``closed_seq`` (in a stage's or
    a read's answer), so it drops its kept mappings of them (``reset``: too many to list,
    drop every mapping of this unit's chunks, whose names start with ``chunk_prefix``)."""

    closed: list[str]
    closed_seq: int
    reset: bool
    chunk_prefix: str


@dataclass(frozen=True)
class SharedRows:
    """Where a unit holds some rows of one field: row i is bytes [starts[i], ends[i])
    of ``chunks[which[i]]``. ``header`` (an EncodedField without values) describes the field."""

    header: Any
    chunks: list[ChunkRef]
    which: Any  # int64 ndarray
    starts: Any  # int64 ndarray
    ends: Any  # int64 ndarray
    # The unit's read lease on ``chunks`` (an int on the wire; the client swaps in a
    # handle that releases it once its last mapping of them is gone): a leased chunk
    # is never recycled for another write.
    lease: Any = None
    closures: ChunkClosures | None = None  # when the reader said which it knows of

    @property
    def nbytes(self) -> int:
        return int((self.ends - self.starts).sum())


@dataclass(frozen=True)
class RemoteRows:
    """Where a unit holds some rows of one field, for a reader on another node to pull
    with a transfer engine (``dataplane_client.transport.payload``): the field's bytes, in
    request order, are the ``segments`` (address in the unit's registered memory, length)
    back to back. ``crc32s``: the CRC-32C of each segment (one transfer each), which the
    reader checks before its get returns. ``lease``: the unit's read lease on the chunks
    (released once pulled)."""

    header: Any  # an EncodedField without values
    segments: list[tuple[int, int]]
    crc32s: list[int]
    lease: int

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.segments)


@dataclass(frozen=True)
class PayloadPath:
    """How one client process reaches one unit's bytes (``ServiceInfo.payload_paths``):
    ``backend`` "shm" (same node), "mooncake-tcp" or "ray", and why (the engine's peer, or
    the reason for falling back to Ray)."""

    unit: int
    node_id: str
    backend: str
    detail: str = ""


@dataclass(frozen=True)
class PayloadOffer:
    """How a unit offers its bytes to readers on other nodes (its answer to
    ``payload_offer``): ``backend`` "mooncake-tcp" or "mooncake-rdma" (what its engine
    moves bytes over) with the engine's ``session``
    ("ip:port") and a probe region (address, length, CRC-32C) a reader pulls to prove the
    path works; or "ray" with ``reason`` (no engine: not installed, turned off, failed)."""

    backend: str
    session: str = ""
    reason: str = ""
    probe: tuple[int, int, int] | None = None
    min_bytes: int = 0  # fields of fewer bytes come back inline (a pull costs a round trip)
    devices: tuple[str, ...] = ()  # the RDMA devices of a "mooncake-rdma" engine


def read_request(
    partition_id: str,
    sample_ids: list[str],
    fields: list[str],
    owner: list | bytes | None = None,
    expect: list[int] | None = None,
    closed_seq: int | None = None,
) -> tuple:
    """A unit's ``read_shm`` arguments in the one tuple it takes: ``owner``, the reader's
    boxed process token (its read leases end with it), or the key of one it sent that
    unit before (``dataplane_server.unit.reader_tokens``); ``expect``, the generations a
    direct read means; ``closed_seq``, the chunk closures the reader knows of."""
    return (partition_id, sample_ids, fields, owner, expect, closed_seq)


def pack_read_answer(answer: dict) -> bytes:
    """A same-node read's answer (``{field: EncodedField | SharedRows}``) as one in-band
    pickle: it holds small arrays only (row offsets, or a field of at most
    ``INLINE_READ_BYTES``), which Ray would otherwise ship out of band one by one."""
    return pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)


def unpack_read_answer(packed: bytes) -> dict:
    """The answer ``pack_read_answer`` packed; its arrays are the caller's own (writable:
    what a same-node get returns is writable whichever way it came)."""
    return pickle.loads(packed)


@dataclass(frozen=True)
class WriteLease:
    """A region a unit set aside for this writer's next same-node put (held ``ttl_s``).

    The writer copies its next write into it at once and names the lease in that
    write's stage call, sent before the copy: allocation costs no round trip of its own.
    """

    lease: int
    region: ShmRegion
    ttl_s: float


@dataclass(frozen=True)
class ShmAlloc:
    """A unit's answer to a same-node writer's allocation: per field the region to copy
    into, and the chunks closed since the writer's ``closed_seq``."""

    regions: dict[str, ShmRegion]
    closures: ChunkClosures
    next_lease: WriteLease | None = None  # for the writer's next put to this unit
