"""The key space: partitions, rows, produced bits, consumption and leases. No Ray, no asyncio.

Per partition the metadata is columnar (numpy arrays grown geometrically, one
entry per row): live bit, sequence length, storage unit, group, one produced
bit per field, one typed column per declared numeric tag, and per consumer
task a consumed bit (plus, for a leased task, the lease's deadline, its holder
and how often the row was handed out). Rows are never reused; a cleared row is
only marked not live. Which ready rows a claim hands out is its claim policy's
choice (``dataplane_server.core.claim_policies``), made over those columns.

A write is checked (``check_commit``: a pure function of the state, returning
a plan or raising a typed error), its bytes are published on the units by the
caller, then ``apply_commit`` makes it visible in one synchronous step, so the
columns are consistent whenever the caller awaits. Time comes from an
injected clock, so leases are tested without sleeping.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dataplane_client.wire import arguments
from dataplane_client.wire.errors import (
    CodecsChanged,
    FieldAlreadyProduced,
    FieldNotProduced,
    InvalidBatch,
    LeaseExpired,
    SamplesLost,
    SamplesNotFound,
    SchemaConflict,
    UnknownPartition,
    UnknownTask,
)
from dataplane_client.wire.messages import (
    ClaimRequest,
    CommitRequest,
    CommitResult,
    FieldCodecs,
    Location,
    PartitionSpec,
    StalenessSpec,
    TagFilter,
    TaskConsumption,
)
from dataplane_client.wire.meta import KVBatchMeta
from dataplane_client.wire.routes import ROUTES_KEY, route_hints
from dataplane_server.core import claim_policies, group_deadline, partial_rollouts, steps
from dataplane_server.core.claim_answers import ClaimAnswer, ClaimAnswers, new_lease_id
from dataplane_server.core.claim_policies import ClaimPolicy, PartitionTraits, ReadyRows, RowColumns
from dataplane_server.core.columns import grown
from dataplane_server.core.group_deadline import GroupDeadlines
from dataplane_server.core.in_flight import SamplesInFlight
from dataplane_server.core.recovery_messages import StoredRows
from dataplane_server.core.staleness import VersionState, matching

NO_VERSION = np.iinfo(np.int64).max  # a group's oldest version before any member has one

NO_LEASE = 0  # holder id of a row nobody holds


@dataclass(frozen=True)
class Declaration:
    """What ``register_partition`` said about a partition (``declaration`` builds a checked one).

    ``enums`` and ``object_fields`` live here, with the partition, so every
    client of the service encodes and decodes them alike, not only the one
    that registered it.
    """

    fields: list[str]
    expected_samples: int | None
    consumer_tasks: list[str]
    group_size: int | None
    task_leases: dict[str, float] = field(default_factory=dict)  # task -> lease seconds
    enums: dict[str, tuple[str, ...]] = field(default_factory=dict)  # field -> vocabulary
    object_fields: frozenset[str] = frozenset()
    # How claims choose rows ("": the default, resolved below) and the policy's options.
    claim_policy: str = ""
    policy_options: dict[str, Any] = field(default_factory=dict)
    numeric_tags: dict[str, str] = field(default_factory=dict)  # tag -> dtype of its column
    staleness: StalenessSpec | None = None  # async RL: versions, the window, admission
    group_fields: frozenset[str] = frozenset()  # stored once per group (group_id tag)
    group_deadline_s: float | None = None  # a group short of members stops being waited for

    def __post_init__(self) -> None:
        unknown = sorted(set(self.task_leases) - set(self.consumer_tasks))
        if unknown:
            raise UnknownTask(f"task_leases names tasks that are not consumer tasks: {unknown}")
        if self.staleness is not None:
            self._declare_version_tag(self.staleness)
        if not self.claim_policy:  # groups are never split unless a policy says otherwise
            default = "grpo_groups" if self.group_size is not None else "sequential"
            object.__setattr__(self, "claim_policy", default)

    def _declare_version_tag(self, spec: StalenessSpec) -> None:
        """The version tag is an integer column; per-task bounds name consumer tasks."""
        if isinstance(spec.max_staleness, dict):
            unknown = sorted(set(spec.max_staleness) - set(self.consumer_tasks))
            if unknown:
                raise UnknownTask(
                    f"max_staleness names tasks that are not consumer tasks: {unknown}"
                )
        dtype = self.numeric_tags.get(spec.version_tag, "int64")
        if dtype not in ("int64", "int32"):
            raise InvalidBatch(
                f"version_tag {spec.version_tag!r} is declared a numeric tag of dtype {dtype}; "
                "a version is an integer"
            )
        # A new dict: the caller's numeric_tags is never changed under it (frozen dataclass).
        object.__setattr__(self, "numeric_tags", {**self.numeric_tags, spec.version_tag: dtype})

    @functools.cached_property
    def codecs(self) -> FieldCodecs:
        return FieldCodecs(
            enums=dict(self.enums),
            object_fields=self.object_fields,
            group_fields=self.group_fields,
            version_tag=None if self.staleness is None else self.staleness.version_tag,
        )

    @property
    def traits(self) -> PartitionTraits:
        return PartitionTraits(
            group_size=self.group_size,
            numeric_tags=dict(self.numeric_tags),
            version_tag=None if self.staleness is None else self.staleness.version_tag,
        )

    def to_record(self) -> dict[str, Any]:
        """Plain lists and dicts (msgpack has no tuples or sets): journal and checkpoint."""
        return {
            "fields": list(self.fields),
            "expected_samples": self.expected_samples,
            "consumer_tasks": list(self.consumer_tasks),
            "group_size": self.group_size,
            "task_leases": dict(self.task_leases),
            "enums": {name: list(words) for name, words in self.enums.items()},
            "object_fields": sorted(self.object_fields),
            "claim_policy": self.claim_policy,
            "policy_options": dict(self.policy_options),
            "numeric_tags": dict(self.numeric_tags),
            "staleness": None if self.staleness is None else dataclasses.asdict(self.staleness),
            "group_fields": sorted(self.group_fields),
            "group_deadline_s": self.group_deadline_s,
        }

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Declaration:
        """Inverse of ``to_record``. A record of an older version lacks what came later:
        codecs (none), claim policy (the default), numeric tags (none), group fields (none)."""
        return cls(
            fields=list(record["fields"]),
            expected_samples=record["expected_samples"],
            consumer_tasks=list(record["consumer_tasks"]),
            group_size=record["group_size"],
            task_leases=dict(record.get("task_leases") or {}),
            enums={name: tuple(words) for name, words in (record.get("enums") or {}).items()},
            object_fields=frozenset(record.get("object_fields") or ()),
            claim_policy=record.get("claim_policy") or "",
            policy_options=dict(record.get("policy_options") or {}),
            numeric_tags=dict(record.get("numeric_tags") or {}),
            staleness=None if not record.get("staleness") else StalenessSpec(**record["staleness"]),
            group_fields=frozenset(record.get("group_fields") or ()),
            group_deadline_s=record.get("group_deadline_s"),
        )


def declare(spec: Any) -> Declaration:
    """A registration (``PartitionSpec``) checked in full, typed errors naming what is
    wrong, as the key space keeps it: the one check of the Ray controller and the
    in-process client. Nothing changes here; a refused spec touches no partition."""
    spec = arguments.partition_spec(spec)
    declared = Declaration(
        fields=spec.fields,
        expected_samples=spec.num_samples,
        consumer_tasks=spec.consumer_tasks,
        group_size=spec.grpo_group_size,
        task_leases=spec.task_leases,
        enums={name: tuple(words) for name, words in spec.enums.items()},
        object_fields=frozenset(spec.object_fields),
        claim_policy=spec.claim_policy or "",
        policy_options=spec.policy_options,
        numeric_tags=dict(spec.numeric_tags),
        staleness=spec.staleness,
        group_fields=frozenset(spec.group_fields),
        group_deadline_s=spec.group_deadline_s,
    )
    policy = claim_policies.get(declared.claim_policy)
    options = policy.check_options(declared.policy_options, declared.traits)
    return dataclasses.replace(declared, policy_options=options)


def declaration(*args: Any, **kwargs: Any) -> Declaration:
    """``declare`` of a ``PartitionSpec`` made of these arguments (its field order)."""
    return declare(PartitionSpec(*args, **kwargs))


@dataclass(frozen=True)
class PolicyCall:
    """The claim policy one claim runs, with its checked options."""

    name: str
    policy: ClaimPolicy
    options: dict[str, Any]
    # What the claim may see at all, before its policy chooses: numeric-tag comparisons and
    # a staleness bound tighter than the partition's (both checked against the partition).
    where: tuple[TagFilter, ...] = ()
    max_staleness: int | None = None


class Partition:
    """One partition's columns. Row r is sample ``ids[r]`` (None once cleared)."""

    def __init__(self, partition_id: str, declaration: Declaration, created_at: float):
        self.partition_id = partition_id
        self.declaration = declaration
        self.created_at = created_at
        self.schema: dict[str, tuple] = {}  # field -> (layout, dtype, trailing shape)
        self.row_of: dict[str, int] = {}
        self.ids: list[str | None] = []
        # Each row's tags but its declared numeric ones, which live in ``tag_values``
        # alone (a version is kept once, as a number); ``tags_of`` joins the two.
        self.tags: list[dict | None] = []
        # Groups as int codes (one per distinct group_id): row -> code (-1: none), and per
        # code its live rows, so a policy finds complete groups with vector operations.
        self.group_code = np.zeros(0, dtype=np.int64)
        self.group_index: dict[Any, int] = {}  # group_id -> code
        self.group_live = np.zeros(0, dtype=np.int64)
        self.group_version = np.zeros(0, dtype=np.int64)  # per code: oldest member's version
        # Per code: when its first member arrived (the key space's clock) and how many have
        # arrived since (a cleared member still counts): its deadline (group_deadline.py).
        self.group_started = np.zeros(0, dtype=np.float64)
        self.group_arrived = np.zeros(0, dtype=np.int64)
        deadline = declaration.group_deadline_s
        self.deadlines = None if deadline is None else GroupDeadlines(deadline)
        spec = declaration.staleness
        self.versions = None if spec is None else VersionState(spec)
        self.version_tag = None if spec is None else spec.version_tag
        # Declared numeric tags: a typed column each, and which rows carry the tag.
        self.tag_values: dict[str, np.ndarray] = {
            name: np.zeros(0, dtype=dtype) for name, dtype in declaration.numeric_tags.items()
        }
        self.tag_present: dict[str, np.ndarray] = {
            name: np.zeros(0, dtype=bool) for name in declaration.numeric_tags
        }
        self.n_rows = 0
        self.live = np.zeros(0, dtype=bool)
        # Partial rollouts being generated (core/partial_rollouts.py): never claimable.
        self.in_progress = np.zeros(0, dtype=bool)
        self.seq_len = np.zeros(0, dtype=np.int32)
        self.unit = np.zeros(0, dtype=np.int16)
        self.replica = np.zeros(0, dtype=np.int16)  # unit of the second copy, -1 = none
        # The commit (its seq) that last wrote each row's bytes, -1 = unknown (rebuilt
        # rows): handed to readers with the row's unit, so they may read it straight from
        # the unit, which checks it (docs/architecture.md, "Routing").
        self.gen = np.zeros(0, dtype=np.int64)
        # The commit (its seq) that created each row, -1 = unknown (no journal): what a
        # journaled removal names, so a restart never drops a later sample of the same id.
        self.born = np.zeros(0, dtype=np.int64)
        self.produced: dict[str, np.ndarray] = {}
        self.consumed: dict[str, np.ndarray] = {t: self.live.copy() for t in self.tasks}
        self.lease_until: dict[str, np.ndarray] = {}  # leased task -> deadline per row
        self.holder: dict[str, np.ndarray] = {}  # leased task -> claim id per row
        self.deliveries: dict[str, np.ndarray] = {}  # leased task -> times handed out
        # task -> rows a filtered claim of it refused (versioned partitions: not owed)
        self.filtered: dict[str, np.ndarray] = {}
        # task -> the claim count of each row's latest claim, and the task's step marks
        # (core/steps.py: a run resumed from step k trains every sample once)
        self.claimed_at: dict[str, np.ndarray] = {}
        self.steps: dict[str, steps.TaskSteps] = {}
        self.answers = ClaimAnswers()  # recent claims' answers, by request id
        self.waiting_claims = 0
        self.epoch = 0  # bumped when rows are added or forgotten: a lookup older than it is stale

    @property
    def tasks(self) -> list[str]:
        return self.declaration.consumer_tasks

    @property
    def group_size(self) -> int | None:
        return self.declaration.group_size

    @property
    def num_samples(self) -> int:
        return len(self.row_of)

    def column(self, table: dict[str, np.ndarray], name: str, dtype=bool, fill=False):
        """``table[name]`` with an entry for every row (created or grown on demand)."""
        arr = table.get(name)
        if arr is None or len(arr) < len(self.live):
            arr = table[name] = grown(
                arr if arr is not None else np.zeros(0, dtype=dtype), len(self.live), fill
            )
        return arr

    def rows_of(self, sample_ids: list[str]) -> np.ndarray:
        """Row per id, -1 for ids the partition does not hold."""
        # map() over dict.get: the per-id work stays in C (no generator frame per id).
        found = map(self.row_of.get, sample_ids, itertools.repeat(-1))
        return np.fromiter(found, dtype=np.int64, count=len(sample_ids))

    def existing_rows(self, sample_ids: list[str], why: str) -> np.ndarray:
        """Row per id; SamplesNotFound naming the ids the partition does not hold."""
        rows = self.rows_of(sample_ids)
        if (rows < 0).any():
            raise SamplesNotFound(
                why,
                ids=[s for s, r in zip(sample_ids, rows) if r < 0],
                partition_id=self.partition_id,
            )
        return rows

    def add_rows(
        self, sample_ids: list[str], units: np.ndarray, replicas: np.ndarray | None = None
    ) -> np.ndarray:
        start, end = self.n_rows, self.n_rows + len(sample_ids)
        self.epoch += 1
        self.live = grown(self.live, end, False)
        self.in_progress = grown(self.in_progress, end, False)
        self.seq_len = grown(self.seq_len, end, -1)
        self.unit = grown(self.unit, end, -1)
        self.replica = grown(self.replica, end, -1)
        self.gen = grown(self.gen, end, -1)
        self.born = grown(self.born, end, -1)
        self.group_code = grown(self.group_code, len(self.live), -1)
        # Every column keeps an entry per row, so no reader ever slices a short one.
        for table in self._row_tables():
            for name, arr in table.items():
                table[name] = grown(arr, len(self.live), 0)
        self.row_of.update(zip(sample_ids, range(start, end)))
        self.ids.extend(sample_ids)
        self.tags.extend([None] * len(sample_ids))
        self.live[start:end] = True
        self.unit[start:end] = units
        self.replica[start:end] = -1 if replicas is None else replicas
        self.n_rows = end
        return np.arange(start, end, dtype=np.int64)

    def _row_tables(self) -> tuple[dict[str, np.ndarray], ...]:
        """The per-row columns kept by name (per field, task or numeric tag)."""
        return (
            self.produced,
            self.consumed,
            self.lease_until,
            self.holder,
            self.deliveries,
            self.filtered,
            self.claimed_at,
            self.tag_values,
            self.tag_present,
        )

    def forget(self, rows: list[int]) -> None:
        self.epoch += 1
        was_live = np.asarray(rows, dtype=np.int64)
        was_live = was_live[self.live[was_live]]
        codes = self.group_code[was_live]
        np.subtract.at(self.group_live, codes[codes >= 0], 1)
        for r in rows:
            sid = self.ids[r]
            if sid is not None:
                self.row_of.pop(sid, None)
                self.ids[r] = None
            self.live[r] = False

    def set_group(self, row: int, group_id: Any, now: float = 0.0) -> None:
        """Put a row in a group (a row's first group_id tag is its group for good). A group
        none of whose members is live (new, or every one cleared or dropped) starts anew at
        ``now``: its deadline counts from there, its version from its new members (a group
        dropped as stale and generated again is as old as its new members)."""
        if self.group_code[row] >= 0:
            return
        code = self.group_index.setdefault(group_id, len(self.group_index))
        self.group_live = grown(self.group_live, code + 1, 0)
        self.group_version = grown(self.group_version, code + 1, NO_VERSION)
        self.group_started = grown(self.group_started, code + 1, 0.0)
        self.group_arrived = grown(self.group_arrived, code + 1, 0)
        if self.group_live[code] == 0:
            self.group_started[code] = now
            self.group_arrived[code] = 0
            self.group_version[code] = NO_VERSION
        self.group_code[row] = code
        self.group_live[code] += 1
        self.group_arrived[code] += 1
        self._age_group(row)

    def set_numeric_tags(self, row: int, tag: dict) -> None:
        for name, column in self.tag_values.items():
            if name in tag:
                column[row] = tag[name]
                self.tag_present[name][row] = True
        if self.version_tag in tag:
            self._age_group(row)

    def _age_group(self, row: int) -> None:
        """A group is as old as its oldest member (kept as members are tagged)."""
        code = self.group_code[row]
        if self.version_tag is None or code < 0 or not self.tag_present[self.version_tag][row]:
            return
        version = self.tag_values[self.version_tag][row]
        self.group_version[code] = min(self.group_version[code], version)

    def versions_of(self, rows: np.ndarray) -> np.ndarray:
        """Each row's version for the staleness window: its group's oldest, else its own."""
        assert self.version_tag is not None
        own = self.tag_values[self.version_tag][rows].astype(np.int64, copy=False)
        code = self.group_code[rows]
        grouped = code >= 0
        if not grouped.any():
            return own
        return np.where(grouped, np.minimum(own, self.group_version[np.maximum(code, 0)]), own)

    def columns(self, group_short: np.ndarray | None = None) -> RowColumns:
        """Views of this partition's columns, as a claim policy reads them (``group_short``:
        per group code, members an overdue group will never get)."""
        n = self.n_rows
        return RowColumns(
            sequence_lengths=self.seq_len[:n],
            group=self.group_code[:n],
            group_live=self.group_live,
            tags={name: col[:n] for name, col in self.tag_values.items()},
            tag_present={name: col[:n] for name, col in self.tag_present.items()},
            ids=self.ids,
            versions_of=None if self.version_tag is None else self.versions_of,
            group_short=np.zeros(0, dtype=np.int64) if group_short is None else group_short,
        )

    def metadata_bytes(self) -> int:
        """Rough bytes of this partition's metadata (benchmarks: bytes per sample)."""
        arrays = self.live.nbytes + self.seq_len.nbytes + self.unit.nbytes + self.replica.nbytes
        arrays += self.gen.nbytes + self.born.nbytes
        arrays += self.group_code.nbytes + self.group_live.nbytes
        arrays += self.group_started.nbytes + self.group_arrived.nbytes
        arrays += sum(a.nbytes for t in self._row_tables() for a in t.values())
        dict_bytes = sys.getsizeof(self.row_of) + sum(sys.getsizeof(s) for s in self.row_of)
        dict_bytes += sys.getsizeof(self.group_index)
        lists = sys.getsizeof(self.ids) + sys.getsizeof(self.tags)
        return arrays + dict_bytes + lists

    def fields_of(self, row: int) -> list[str]:
        return [f for f, col in self.produced.items() if len(col) > row and col[row]]

    def tags_of(self, rows: list[int]) -> list[dict]:
        """Each row's tags as written (its numeric tags read back from their columns);
        a cleared row (-1) has none."""
        out = [dict(self.tags[r] or {}) if r >= 0 else {} for r in rows]
        if not self.tag_values or not rows:
            return out
        at = np.asarray(rows, dtype=np.int64)
        live = at >= 0
        for name, column in self.tag_values.items():
            present = np.zeros(len(rows), dtype=bool)
            present[live] = self.tag_present[name][at[live]]
            values = column[at[present]].tolist()
            for i, value in zip(np.nonzero(present)[0].tolist(), values):
                out[i][name] = value
        return out


@dataclass(frozen=True, eq=False)  # a plan is itself: compared by identity
class CommitPlan:
    """A checked commit: apply it after the units published its bytes."""

    partition: Partition
    request: CommitRequest
    rows: np.ndarray  # -1 for samples the commit creates
    epoch: int  # the partition's epoch when ``rows`` were looked up
    # Tokens of partial rollouts this commit resumes under newer weights (partial_rollouts)
    resumed_tokens: int = 0

    # Built only when another commit of the partition is checked while this one is in
    # flight (rare): a lone commit makes no per-sample dict.
    @functools.cached_property
    def unit_of(self) -> dict[str, int]:
        """sample -> unit it was staged on."""
        return dict(zip(self.request.sample_ids, self.request.units))

    @functools.cached_property
    def replica_of(self) -> dict[str, int]:
        """sample -> second copy's unit (absent: none)."""
        replicas = self.request.replicas or ()
        return {s: u for s, u in zip(self.request.sample_ids, replicas) if u >= 0}


def _id_count(ids: Any, partition_id: str) -> int:
    """How many ids, once they are known good (``arguments.id_list``'s rules)."""
    if arguments.plainly_good_ids(ids):
        return len(ids)
    return len(arguments.id_list(ids, partition_id=partition_id))


def _check_shapes(req: CommitRequest, num_units: int) -> None:
    """A request whose parts disagree is refused before anything is reserved or published
    (apply must not fail half way, e.g. on an unhashable group_id)."""
    n = _id_count(req.sample_ids, req.partition_id)
    arguments.tag_list(req.tags, n, partition_id=req.partition_id)
    checked = (
        ("units", req.units),
        ("replicas", req.replicas),
        ("sequence_lengths", req.sequence_lengths),
    )
    for what, values in checked:
        if values is not None and len(values) != n:
            raise InvalidBatch(
                f"{len(values)} {what} for {n} sample ids", partition_id=req.partition_id
            )
    if set(req.staged_units) != set(req.units) | {u for u in req.replicas or () if u >= 0}:
        raise InvalidBatch("staged_units must be the units the samples were staged on")
    if req.replicas is not None and any(r == u for r, u in zip(req.replicas, req.units)):
        raise InvalidBatch("a sample's second copy must be on another unit than its first")
    if any(not 0 <= u < num_units for u in req.staged_units):
        raise InvalidBatch(f"staged_units {req.staged_units} name units the service lacks")


def _fits(value: Any, dtype: np.dtype) -> bool:
    """Whether a tag value is a number its declared column holds exactly (bool refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if dtype.kind == "i":
        bounds = np.iinfo(dtype)
        return isinstance(value, int) and bounds.min <= value <= bounds.max
    return True  # an int or float: a float column holds it (rounded, as numpy would)


def _check_numeric_tags(part: Partition, req: CommitRequest) -> None:
    """Each declared numeric tag a commit gives must be a number of its column's type."""
    if not req.tags or not part.tag_values:
        return
    for name, column in part.tag_values.items():
        bad = [
            s
            for s, t in zip(req.sample_ids, req.tags)
            if t and name in t and not _fits(t[name], column.dtype)
        ]
        if bad:
            raise InvalidBatch(
                f"tag {name!r} is declared a numeric tag of dtype {column.dtype}: "
                "each value must be a number that fits it",
                ids=bad,
                partition_id=part.partition_id,
            )


def _check_new_samples_tagged(part: Partition, req: CommitRequest, old: np.ndarray) -> None:
    """A new sample of a grouped partition needs its group_id, of a versioned one its version."""
    needed = [("group_id", "partition has group_size", "a group_id tag")]
    needed = needed if part.group_size is not None else []
    if part.version_tag is not None:
        needed.append(
            (
                part.version_tag,
                "partition is versioned (StalenessSpec)",
                f"its policy version (put_samples(..., version=v); read as tag {part.version_tag})",
            )
        )
    tags = req.tags or [{}] * len(req.sample_ids)
    for tag, why, what in needed:
        missing = [s for i, s in enumerate(req.sample_ids) if not old[i] and tag not in tags[i]]
        if missing:
            raise InvalidBatch(
                f"{why}: every new sample needs {what}",
                ids=missing,
                partition_id=req.partition_id,
            )


def _produced_everywhere(part: Partition, names: list[str], rows: np.ndarray) -> list[str]:
    return [f for f in names if f in part.produced and part.produced[f][rows].all()]


@dataclass(frozen=True)
class ClaimChoice:
    """A batch ``KeySpace.choose`` picked and nothing has handed out yet."""

    part: Partition
    request_id: str | None
    rows: np.ndarray
    answer: ClaimAnswer


class KeySpace:
    """Every partition of one service, and which storage units are alive."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.partitions: dict[str, Partition] = {}
        self.unit_alive: list[bool] = []
        # Plans whose bytes are being published right now, per partition and by sample (a
        # check looks up its own samples, not every plan: thousands may be in flight);
        # nothing per sample outlives its commit.
        self._samples_in_flight = SamplesInFlight()
        self.redeliveries_total = 0

    # ---- partitions ---------------------------------------------------------------
    def partition(self, partition_id: str) -> Partition:
        if not isinstance(partition_id, str):  # unhashable ids would fail the lookup untyped
            raise InvalidBatch(f"partition_id must be a str, got {type(partition_id).__name__}")
        part = self.partitions.get(partition_id)
        if part is None:
            raise UnknownPartition("no such partition", partition_id=partition_id)
        return part

    def register(self, partition_id: str, declaration: Declaration) -> Partition | None:
        """Create the partition, replacing any of that id; returns the replaced one."""
        old = self.partitions.pop(partition_id, None)
        self.partitions[partition_id] = Partition(partition_id, declaration, time.time())
        return old

    def delete(self, partition_id: str) -> Partition:
        part = self.partition(partition_id)
        del self.partitions[partition_id]
        return part

    def task_of(self, part: Partition, task: str) -> str:
        if task not in part.tasks:
            raise UnknownTask(
                f"task {task!r} is not a consumer task of this partition "
                f"(registered: {part.tasks})",
                partition_id=part.partition_id,
            )
        return task

    # ---- commit -------------------------------------------------------------------
    def check_commit(self, req: CommitRequest) -> CommitPlan | CommitResult:
        """A plan for the commit, or a CommitResult naming samples to re-route; changes nothing
        but the reservation of the plan's cells (release it with ``release``)."""
        part = self.partition(req.partition_id)
        pid, names, ids = req.partition_id, list(req.schemas), req.sample_ids
        if req.codecs_key is not None and req.codecs_key != part.declaration.codecs.key:
            raise CodecsChanged(
                "the partition was registered again with other enums or object fields "
                "since this write was encoded",
                partition_id=pid,
            )
        _check_shapes(req, len(self.unit_alive))
        _check_numeric_tags(part, req)
        self._check_schemas(part, req)
        rows = part.rows_of(ids)
        units = np.asarray(req.units, dtype=np.int64)
        # Where each sample lives: its row, else a commit creating it right now.
        home = np.where(rows >= 0, part.unit[np.maximum(rows, 0)] if part.n_rows else -1, -1)
        replicas = (
            np.full(len(ids), -1, dtype=np.int64)
            if req.replicas is None
            else np.asarray(req.replicas, dtype=np.int64)
        )
        home_replica = np.where(
            rows >= 0, part.replica[np.maximum(rows, 0)] if part.n_rows else -1, -1
        )
        plan = CommitPlan(part, req, rows, part.epoch)
        busy: list[int] = []  # positions of cells another commit in flight is writing
        for i, other in self._samples_in_flight.sharing(pid, ids):
            if rows[i] < 0:
                home[i] = other.unit_of[ids[i]]
                home_replica[i] = other.replica_of.get(ids[i], -1)
            if not set(names).isdisjoint(other.request.schemas):
                busy.append(i)
        # A sample whose every copy is gone is not re-routed: it is lost (below).
        alive = np.asarray(self.unit_alive + [False], dtype=bool)  # [-1]: no unit
        elsewhere = (home != units) | (home_replica != replicas)
        moved = np.nonzero((home >= 0) & elsewhere & alive[home])[0]
        if len(moved):
            return CommitResult(
                rerouted={ids[i]: int(home[i]) for i in moved},
                rerouted_replicas={
                    ids[i]: int(home_replica[i]) for i in moved if home_replica[i] >= 0
                },
            )
        old = rows >= 0
        # Gone: the recorded unit of an existing sample, or a unit this write was staged on.
        dead = (old & ~alive[home]) | ~alive[units] | ((replicas >= 0) & ~alive[replicas])
        if dead.any():
            raise SamplesLost(
                "their storage unit is gone",
                ids=[ids[i] for i in np.nonzero(dead)[0]],
                partition_id=pid,
            )
        if not req.overwrite and old.any():
            for name in names:
                col = part.produced.get(name)
                if col is None:
                    continue
                hit = [ids[i] for i in np.nonzero(old & col[np.maximum(rows, 0)])[0]]
                if hit:
                    raise FieldAlreadyProduced(
                        "field already produced (pass overwrite=True to replace it)",
                        ids=hit,
                        fields=[name],
                        partition_id=pid,
                    )
        if busy:
            raise FieldAlreadyProduced(
                "another writer is committing these cells right now",
                ids=[ids[i] for i in sorted(busy)],
                fields=names,
                partition_id=pid,
            )
        _check_new_samples_tagged(part, req, old)
        resumed = partial_rollouts.check_appends(part, req, rows)
        plan = dataclasses.replace(plan, resumed_tokens=resumed)
        self._samples_in_flight.add(pid, ids, plan)
        return plan

    def _check_schemas(self, part: Partition, req: CommitRequest) -> None:
        """SchemaConflict unless each field's schema is the one the partition recorded or,
        for a field not recorded yet, the one a commit in flight is writing it with: a
        first write in flight claims the field's schema until it is applied or released,
        so two concurrent first writes with different dtypes cannot both apply."""
        # Plans of a partition since replaced under the same id claim nothing here.
        in_flight = self._samples_in_flight.plans(part.partition_id)
        for name, schema in req.schemas.items():
            known = part.schema.get(name)
            if known is not None:
                whose = "field is"
            else:
                whose = "another write of the field, in flight, has"
                known = next(
                    (
                        p.request.schemas[name]
                        for p in in_flight
                        if p.partition is part and name in p.request.schemas
                    ),
                    None,
                )
            if known is not None and tuple(known) != tuple(schema):
                raise SchemaConflict(
                    f"{whose} {tuple(known)}, this write has {tuple(schema)}",
                    fields=[name],
                    partition_id=part.partition_id,
                )

    def release(self, plan: CommitPlan) -> None:
        """Drop the plan's reservation (after apply, or when publishing failed)."""
        self._samples_in_flight.remove(plan.request.partition_id, plan.request.sample_ids, plan)

    def apply_commit(
        self, plan: CommitPlan, generation: int = -1
    ) -> tuple[CommitResult, dict[int, list[str]]]:
        """Make a published write visible; ``generation``: the seq it was published under.

        Also returns, per unit, the samples a concurrent clear removed while the
        write was publishing: the write counts as done before that clear, so the
        caller frees their freshly published bytes. Raises UnknownPartition,
        changing nothing, when the partition itself was deleted meanwhile.
        """
        req, part = plan.request, plan.partition
        self.release(plan)
        if self.partitions.get(req.partition_id) is not part:
            raise UnknownPartition(
                "partition deleted while the write was in flight", partition_id=req.partition_id
            )
        # A sample the plan found may have been cleared since; one it did not find may have
        # been created since by a commit of other fields (on the same unit: check_commit sends
        # every commit of a sample in flight to one unit). Neither happened when no row was
        # added or forgotten since the check: its lookup still holds (no second pass over ids).
        if part.epoch == plan.epoch:
            rows = plan.rows.copy()
        else:
            rows = part.rows_of(req.sample_ids)
        gone = (plan.rows >= 0) & (rows != plan.rows)
        cleared: dict[int, list[str]] = {}
        for i in np.nonzero(gone)[0].tolist():
            cleared.setdefault(req.units[i], []).append(req.sample_ids[i])
            if req.replicas is not None and req.replicas[i] >= 0:
                cleared.setdefault(req.replicas[i], []).append(req.sample_ids[i])
        new = np.nonzero((rows < 0) & ~gone)[0]
        if len(new):
            units = np.asarray(req.units, dtype=np.int16)[new]
            replicas = None if req.replicas is None else np.asarray(req.replicas)[new]
            created = req.sample_ids if len(new) == len(rows) else [req.sample_ids[i] for i in new]
            rows[new] = part.add_rows(created, units, replicas)
            part.born[rows[new]] = generation
            if not all(self.unit_alive):  # a copy's unit died while this write was publishing
                self.fail_over(part)
        keep = np.nonzero(~gone)[0]
        written = rows[keep]
        part.gen[written] = generation
        for name, schema in req.schemas.items():
            part.schema.setdefault(name, tuple(schema))
            part.column(part.produced, name)[written] = True
        if req.sequence_lengths is not None:
            given = np.asarray(req.sequence_lengths, dtype=np.int32)[keep]
            unset = part.seq_len[written] < 0
            part.seq_len[written[unset]] = given[unset]
        if req.tags:
            for i in keep.tolist():
                tag = req.tags[i]
                if tag:
                    self._merge_tags(part, int(rows[i]), tag)
        lengths = np.full(len(rows), -1, dtype=np.int64)
        lengths[keep] = part.seq_len[written]
        return CommitResult(sequence_lengths=lengths.tolist(), generation=generation), cleared

    def _merge_tags(self, part: Partition, row: int, tag: dict) -> None:
        gid = tag.get("group_id")
        if gid is not None:
            part.set_group(row, gid, self.clock())
        partial_rollouts.merge(part, row, tag)
        if part.tag_values:
            part.set_numeric_tags(row, tag)
            tag = {k: v for k, v in tag.items() if k not in part.tag_values}
        if tag:
            part.tags[row] = {**(part.tags[row] or {}), **tag}

    # ---- reads --------------------------------------------------------------------
    def locate(self, partition_id: str, sample_ids: list[str], fields: list[str]) -> Location:
        """Validate a read; say where each sample's bytes live."""
        part = self.partition(partition_id)
        rows = part.existing_rows(sample_ids, "unknown or cleared samples")
        units = part.unit[rows]
        lost = ~np.asarray(self.unit_alive, dtype=bool)[units]
        if lost.any():
            raise SamplesLost(
                "their storage unit is gone",
                ids=[s for s, x in zip(sample_ids, lost) if x],
                partition_id=partition_id,
            )
        for name in fields:
            col = part.produced.get(name)
            ok = col[rows] if col is not None else np.zeros(len(rows), dtype=bool)
            if not ok.all():
                raise FieldNotProduced(
                    "field not produced for these samples",
                    ids=[s for s, x in zip(sample_ids, ok) if not x],
                    fields=[name],
                    partition_id=partition_id,
                )
        return Location(
            fields=list(fields),
            units=units.tolist(),
            codecs_key=part.declaration.codecs.key,
            generations=part.gen[rows].tolist(),
        )

    def committed_result(self, req: CommitRequest) -> CommitResult:
        """The result of a commit already applied (a retry of it): lengths as stored."""
        part = self.partition(req.partition_id)
        rows = part.rows_of(req.sample_ids)
        return CommitResult(sequence_lengths=[int(part.seq_len[r]) if r >= 0 else -1 for r in rows])

    def lookup_units(self, partition_id: str, sample_ids: list[str]) -> list[int]:
        """Recorded unit per sample (-1 = not written yet)."""
        part = self.partition(partition_id)
        return [int(part.unit[r]) if r >= 0 else -1 for r in part.rows_of(sample_ids)]

    # ---- claims -------------------------------------------------------------------
    def claimable(
        self, part: Partition, task: str, required: list[str], policy: PolicyCall | None = None
    ) -> np.ndarray:
        """Rows ready for the task, within its staleness window and the claim's ``where``."""
        return self.judged(part, task, required, policy)[0]

    def judged(
        self, part: Partition, task: str, required: list[str], policy: PolicyCall | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """The rows ready for the task within its window (the claim's ``max_staleness`` may
        tighten it), split by the claim's ``where``: those it passes (``claimable``), and
        those it refuses for the first time on a versioned partition, where a refused sample
        stops being owed (``mark_filtered``; docs/architecture.md, "Async RL"). A row
        missing a tag the filter names is neither: not judged yet (the tag may come with a
        later write)."""
        rows = self._ready(part, task, required)
        rows = self._within_window(part, task, rows, policy.max_staleness if policy else None)
        if policy is None or not policy.where or not len(rows):
            return rows, rows[:0]
        keep = matching(part.tag_values, part.tag_present, rows, policy.where, part.partition_id)
        refused = rows[~keep] if part.versions is not None else rows[:0]
        refused = refused[~part.column(part.filtered, task)[refused]]
        for name in {f.tag for f in policy.where}:
            refused = refused[part.tag_present[name][refused]]
        return rows[keep], refused

    @staticmethod
    def _within_window(
        part: Partition, task: str, rows: np.ndarray, tighter: int | None
    ) -> np.ndarray:
        if part.versions is None or not len(rows):
            return rows
        bound = part.versions.bound(task, tighter)
        if bound is None:
            return rows
        return rows[part.versions_of(rows) >= part.versions.oldest_allowed(bound)]

    def _ready(self, part: Partition, task: str, required: list[str]) -> np.ndarray:
        n = part.n_rows
        ok = part.live[:n].copy()
        for name in required:
            col = part.produced.get(name)
            if col is None:
                return np.zeros(0, dtype=np.int64)
            ok &= col[:n]
        ok &= ~part.column(part.consumed, task)[:n]
        ok &= ~part.in_progress[:n]  # a partial rollout is claimable once finished
        if task in part.declaration.task_leases:
            ok &= part.column(part.lease_until, task, np.float64, 0.0)[:n] <= self.clock()
        ok &= np.asarray(self.unit_alive, dtype=bool)[part.unit[:n]]
        return np.nonzero(ok)[0]

    @staticmethod
    def claim_policy(
        part: Partition,
        name: str | None = None,
        options: dict[str, Any] | None = None,
        where: tuple[TagFilter, ...] = (),
        max_staleness: int | None = None,
    ) -> PolicyCall:
        """The policy a claim runs: ``name``, else the partition's. Options given for the
        partition's own policy go over its declared ones. InvalidBatch, changing nothing,
        for an unknown policy or options it refuses, a ``where`` on a tag that is not a
        numeric tag, or a ``max_staleness`` on a partition without versions."""
        decl = part.declaration
        if name is None or name == decl.claim_policy:
            name, options = decl.claim_policy, {**decl.policy_options, **(options or {})}
        unknown = sorted({f.tag for f in where} - set(part.tag_values))
        if unknown:
            raise InvalidBatch(
                f"where names tags that are not numeric tags of this partition: {unknown} "
                f"(declared: {sorted(part.tag_values)})",
                partition_id=part.partition_id,
            )
        if max_staleness is not None and part.versions is None:
            raise InvalidBatch(
                "max_staleness needs a partition registered with a StalenessSpec",
                partition_id=part.partition_id,
            )
        try:
            policy = claim_policies.get(name)
            checked = policy.check_options(options or {}, decl.traits)
        except InvalidBatch as e:
            raise InvalidBatch(e.message, partition_id=part.partition_id) from None
        return PolicyCall(name, policy, checked, tuple(where), max_staleness)

    def claim_setup(self, request: ClaimRequest) -> tuple[Partition, str, PolicyCall]:
        """A checked claim's partition, task and the policy it runs (``claim_policy``);
        UnknownPartition, UnknownTask or InvalidBatch, changing nothing. The one set-up of
        every claim: the controller's, the in-process client's and a peek's."""
        part = self.partition(request.partition_id)
        task = self.task_of(part, request.task_name)
        policy = self.claim_policy(
            part, request.claim_policy, request.policy_options, request.where, request.max_staleness
        )
        declared = part.versions.spec.bound(task) if part.versions is not None else None
        loose = request.max_staleness
        if loose is not None and declared is not None and loose > declared:
            raise InvalidBatch(  # a claim may only tighten the partition's bound
                f"max_staleness {loose} of this claim is looser than the partition's bound "
                f"of {declared} for task {task!r}: a claim may only tighten it",
                partition_id=part.partition_id,
            )
        return part, task, policy

    def _pick(
        self,
        part: Partition,
        ready: np.ndarray,
        batch_size: int,
        policy: PolicyCall | None,
        task: str | None = None,
    ) -> np.ndarray:
        """The ready rows the claim policy hands out, in its order (``task``: the claiming
        task, whose consumed-or-held count a policy may read: ``ReadyRows.taken``)."""
        policy = policy or self.claim_policy(part)
        taken_of = None if task is None else (lambda: self.taken(part, task))
        columns = part.columns(self.group_short(part))
        view = ReadyRows(rows=ready, group_size=part.group_size, columns=columns, taken_of=taken_of)
        try:
            chosen = np.asarray(policy.policy.choose(view, batch_size, policy.options), np.int64)
        except InvalidBatch as e:
            raise InvalidBatch(e.message, partition_id=part.partition_id) from None
        # Handing a row out twice, or one that is not ready, would break every guarantee.
        if len(chosen) > batch_size or (
            len(chosen)
            and (
                chosen.min() < 0
                or chosen.max() >= len(ready)
                or len(np.unique(chosen)) < len(chosen)
            )
        ):
            raise RuntimeError(
                f"claim policy {policy.name!r} chose {len(chosen)} positions of {len(ready)} "
                f"ready rows for a batch of {batch_size}, not distinct positions among them"
            )
        return ready[chosen]

    def ready_count(
        self,
        part: Partition,
        task: str,
        required: list[str],
        batch_size: int,
        policy: PolicyCall | None = None,
    ) -> int:
        ready = self.claimable(part, task, required, policy)
        return len(self._pick(part, ready, batch_size, policy, task))

    def choose(
        self,
        part: Partition,
        task: str,
        required: list[str],
        batch_size: int,
        *,
        partial_ok: bool,
        dp_rank: int | None = None,
        request_id: str | None = None,
        policy: PolicyCall | None = None,
        claimable: np.ndarray | None = None,
    ) -> ClaimChoice | None:
        """The batch a claim would hand out, changing nothing (``grant`` hands it out); None
        when none is due yet.

        ``policy`` chooses the rows (None: the partition's, see ``claim_policy``) among
        ``claimable`` (None: ``self.claimable``, for a caller that has not judged them). A
        full batch is always due; so is the tail of a partition of known size;
        anything non-empty is due when ``partial_ok``.
        """
        self.task_of(part, task)
        if part.group_size and batch_size % part.group_size:
            raise InvalidBatch(
                f"batch_size {batch_size} is not a multiple of group_size "
                f"{part.group_size}; groups are never split",
                partition_id=part.partition_id,
            )
        if claimable is None:
            claimable = self.claimable(part, task, required, policy)
        rows = self._pick(part, claimable, batch_size, policy, task)
        # Members of an overdue group handed out partial never come: they count as handed.
        never = self.short_of(part, rows)
        expected = part.declaration.expected_samples
        left = None
        if expected is not None:  # samples of a lost unit will never come: not waited for
            left = expected - self._consumed_or_held(part, task) - len(self.lost_rows(part, task))
            left -= self.never_coming(part)  # nor those of groups past their deadline
        tail = left is not None and 0 < len(rows) >= min(batch_size, left)
        if not (len(rows) + never >= batch_size or tail or (partial_ok and len(rows))):
            return None
        leased = task in part.declaration.task_leases
        return ClaimChoice(
            part,
            request_id,
            rows,
            ClaimAnswer(
                task=task,
                sample_ids=[part.ids[r] for r in rows.tolist()],
                fields=_produced_everywhere(part, list(part.schema), rows),
                lease_id=new_lease_id() if leased else None,
                dp_rank=dp_rank,
            ),
        )

    def choose_for(
        self,
        request: ClaimRequest,
        part: Partition,
        policy: PolicyCall,
        *,
        partial_ok: bool,
        claimable: np.ndarray | None = None,
    ) -> ClaimChoice | None:
        """``choose`` for a checked claim (after ``claim_setup``): its task, fields, batch
        size, rank and request id."""
        return self.choose(
            part,
            request.task_name,
            request.required_fields,
            request.batch_size,
            partial_ok=partial_ok,
            dp_rank=request.dp_rank,
            request_id=request.request_id,
            policy=policy,
            claimable=claimable,
        )

    def grant(self, choice: ClaimChoice) -> KVBatchMeta:
        """Hand out a chosen batch: consumed for its task, or leased to its claim."""
        part, rows, answer = choice.part, choice.rows, choice.answer
        lease = part.declaration.task_leases.get(answer.task)
        if lease is None:
            part.column(part.consumed, answer.task)[rows] = True
        else:
            part.column(part.lease_until, answer.task, np.float64, 0.0)[rows] = self.clock() + lease
            part.column(part.holder, answer.task, np.int64, NO_LEASE)[rows] = answer.lease_id
            deliveries = part.column(part.deliveries, answer.task, np.int32, 0)
            self.redeliveries_total += int((deliveries[rows] > 0).sum())
            deliveries[rows] += 1
        steps.stamp(part, answer.task, rows)
        if part.versions is not None:
            part.versions.count_claimed(answer.task, len(rows))
        part.answers.add(choice.request_id, answer)
        return self.meta_of(part, answer)

    def claim(
        self,
        part: Partition,
        task: str,
        required: list[str],
        batch_size: int,
        *,
        partial_ok: bool,
        dp_rank: int | None = None,
        policy: PolicyCall | None = None,
    ) -> KVBatchMeta | None:
        """``choose`` then ``grant``: for callers with no journal to write in between (what
        the claim's ``where`` refuses is marked first, ``judged``)."""
        claimable, refused = self.judged(part, task, required, policy)
        self.mark_filtered(part, task, refused)
        choice = self.choose(
            part,
            task,
            required,
            batch_size,
            partial_ok=partial_ok,
            dp_rank=dp_rank,
            policy=policy,
            claimable=claimable,
        )
        return None if choice is None else self.grant(choice)

    @staticmethod
    def mark_filtered(part: Partition, task: str, rows: np.ndarray) -> None:
        """The task's filtered claims refused these rows: counted, and no longer owed."""
        if not len(rows):
            return
        part.column(part.filtered, task)[rows] = True
        assert part.versions is not None
        part.versions.count_filtered(task, len(rows))

    def answered(self, part: Partition, request_id: str | None) -> KVBatchMeta | None:
        """The batch a claim of this request id was already given (a retry), else None."""
        answer = part.answers.get(request_id)
        return None if answer is None else self.meta_of(part, answer)

    @staticmethod
    def meta_of(part: Partition, answer: ClaimAnswer) -> KVBatchMeta:
        """A claim's answer as the meta its claimer gets (lengths and tags as stored now)."""
        rows = part.rows_of(answer.sample_ids)
        live = rows >= 0
        lengths = np.full(len(rows), -1, dtype=np.int64)
        lengths[live] = part.seq_len[rows[live]]
        tags = part.tags_of(rows.tolist())
        extra: dict[str, Any] = {} if answer.dp_rank is None else {"dp_rank": answer.dp_rank}
        if answer.lease_id is not None:
            extra["lease_id"] = answer.lease_id
        if live.all():
            extra[ROUTES_KEY] = route_hints(
                part.declaration.codecs.key, answer.sample_ids, part.unit[rows], part.gen[rows]
            )
        return KVBatchMeta(
            partition_id=part.partition_id,
            task_name=answer.task,
            sample_ids=list(answer.sample_ids),
            fields=list(answer.fields),
            sequence_lengths=lengths.tolist(),
            extra_info=extra,
            tags=tags if any(tags) else None,
        )

    def lost_rows(self, part: Partition, task: str | None = None) -> np.ndarray:
        """Live rows whose unit is gone (not yet consumed by ``task``, when given)."""
        n = part.n_rows
        lost = part.live[:n] & ~np.asarray(self.unit_alive, dtype=bool)[part.unit[:n]]
        if task is not None:
            lost &= ~part.column(part.consumed, task)[:n]
        return np.nonzero(lost)[0]

    def unsatisfiable(self, part: Partition, task: str) -> list[str]:
        """Lost ids, when a partition of known size has nothing else left for the task: a
        waiting claim can never be served (empty list: it still can)."""
        expected = part.declaration.expected_samples
        lost = self.lost_rows(part, task)
        if expected is None or not len(lost):
            return []
        if expected - self._consumed_or_held(part, task) - len(lost) > 0:
            return []
        return [part.ids[r] for r in lost.tolist()]

    def _consumed_or_held(self, part: Partition, task: str) -> int:
        n = part.n_rows
        done = part.column(part.consumed, task)[:n].copy()
        if task in part.declaration.task_leases:
            done |= part.column(part.lease_until, task, np.float64, 0.0)[:n] > self.clock()
        return int(done.sum())

    def taken(self, part: Partition, task: str) -> int:
        """Live samples the task has consumed or holds under a lease: ``consumed + leased``
        of its ``consumption`` (``ReadyRows.taken``)."""
        n = part.n_rows
        done = part.column(part.consumed, task)[:n].copy()
        if task in part.declaration.task_leases:
            done |= part.column(part.lease_until, task, np.float64, 0.0)[:n] > self.clock()
        return int((done & part.live[:n]).sum())

    # ---- group deadlines (core/group_deadline.py) ------------------------------------------
    def _group_due(self, part: Partition) -> np.ndarray | None:
        """Per group code: when it is overdue, inf never (None: no deadline)."""
        if part.deadlines is None or part.group_size is None:
            return None
        return group_deadline.due_times(
            part.group_started,
            part.group_arrived,
            part.group_live,
            part.group_size,
            part.deadlines.deadline_s,
        )

    def overdue_groups(self, part: Partition) -> np.ndarray:
        """Per group code: past its deadline and short of members (all False: no deadline)."""
        due = self._group_due(part)
        return np.zeros(len(part.group_live), dtype=bool) if due is None else due <= self.clock()

    def group_short(self, part: Partition) -> np.ndarray | None:
        """Per group code: members an overdue group will never get (None: no deadline)."""
        if part.deadlines is None or part.group_size is None:
            return None
        overdue = self.overdue_groups(part)
        return np.where(overdue, part.group_size - part.group_arrived, 0).astype(np.int64)

    def short_of(self, part: Partition, rows: np.ndarray) -> int:
        """Members that never came of the overdue groups ``rows`` belong to."""
        short = self.group_short(part)
        if short is None or not len(rows):
            return 0
        codes = np.unique(part.group_code[rows])
        return int(short[codes[codes >= 0]].sum())

    def never_coming(self, part: Partition) -> int:
        """Samples a partition of known size will never get because of group deadlines:
        every member of a dropped group, and the missing ones of an overdue group."""
        short = self.group_short(part)
        if short is None or part.deadlines is None or part.group_size is None:
            return 0
        return part.deadlines.groups * part.group_size + int(short.sum())

    def expired_rows(self, part: Partition, policy: PolicyCall) -> tuple[np.ndarray, int]:
        """The rows a claim running ``policy`` drops before it chooses, and how many groups
        they are: the members of overdue groups none of which any task has taken, when the
        claim takes whole groups only (``grpo_groups`` without ``partial_groups``)."""
        none = np.zeros(0, dtype=np.int64)
        if part.deadlines is None or policy.name != "grpo_groups":
            return none, 0
        if policy.options.get("partial_groups"):
            return none, 0
        overdue = self.overdue_groups(part)
        if not overdue.any():
            return none, 0
        n = part.n_rows
        code = part.group_code[:n]
        member = part.live[:n] & (code >= 0)
        member[member] = overdue[code[member]]
        taken = np.zeros(n, dtype=bool)
        for task in part.tasks:
            taken |= part.column(part.consumed, task)[:n]
            if task in part.declaration.task_leases:
                taken |= part.column(part.lease_until, task, np.float64, 0.0)[:n] > self.clock()
        spoiled = np.unique(code[member & taken])
        member[member] &= ~np.isin(code[member], spoiled)
        rows = np.nonzero(member)[0]
        return rows, len(np.unique(code[rows]))

    def next_group_deadline(self, part: Partition) -> float | None:
        """When the next group short of members becomes overdue (the key space's clock;
        None: none will): a blocking claim wakes then."""
        due = self._group_due(part)
        if due is None:
            return None
        later = due[np.isfinite(due) & (due > self.clock())]
        return float(later.min()) if len(later) else None

    def next_lease_expiry(self, part: Partition, task: str) -> float | None:
        """When the earliest lease of the task runs out (None: no lease held)."""
        if task not in part.declaration.task_leases:
            return None
        n = part.n_rows
        held = part.column(part.lease_until, task, np.float64, 0.0)[:n]
        held = held[(held > self.clock()) & ~part.column(part.consumed, task)[:n]]
        return float(held.min()) if len(held) else None

    def check_ack(
        self, partition_id: str, task: str, sample_ids: list[str], claim_id: int
    ) -> tuple[Partition, np.ndarray]:
        """The rows an ack would mark done (``apply_ack``), changing nothing.

        An ack after the lease expired is harmless while nobody re-claimed the
        samples (the work was done once); if another claim holds them now, the
        ack is refused (LeaseExpired) and changes nothing: the new holder owns them.
        Samples cleared since the claim are done already (a clear acknowledges):
        they are skipped, so an ack racing a clear still acknowledges the rest.
        """
        part = self.partition(partition_id)
        self.task_of(part, task)
        if task not in part.declaration.task_leases:
            raise InvalidBatch(
                f"task {task!r} has no lease: its claims need no ack", partition_id=partition_id
            )
        rows = part.rows_of(sample_ids)
        sample_ids = [s for s, r in zip(sample_ids, rows.tolist()) if r >= 0]
        rows = rows[rows >= 0]
        holder = part.column(part.holder, task, np.int64, NO_LEASE)
        consumed = part.column(part.consumed, task)
        stolen = [s for s, r in zip(sample_ids, rows) if holder[r] != claim_id and not consumed[r]]
        if stolen:
            raise LeaseExpired(
                f"lease {claim_id} of task {task!r} expired and another claim holds these now",
                ids=stolen,
                partition_id=partition_id,
            )
        return part, rows[~consumed[rows]]

    def apply_ack(self, part: Partition, task: str, rows: np.ndarray) -> int:
        """Mark acknowledged rows done for the task; returns how many."""
        part.column(part.consumed, task)[rows] = True
        part.column(part.lease_until, task, np.float64, 0.0)[rows] = 0.0
        return len(rows)

    def ack(self, partition_id: str, task: str, sample_ids: list[str], claim_id: int) -> int:
        """Acknowledge leased samples (``check_ack`` then ``apply_ack``). Returns how many."""
        part, rows = self.check_ack(partition_id, task, sample_ids, claim_id)
        return self.apply_ack(part, task, rows)

    def reset_consumption(self, partition_id: str, task: str) -> None:
        """Re-open the partition for the task: every live sample is claimable again."""
        part = self.partition(partition_id)
        self.task_of(part, task)
        for table in (part.consumed, part.lease_until, part.holder, part.filtered):
            if task in table:
                table[task][:] = 0
        if task in part.claimed_at:
            part.claimed_at[task][:] = steps.NOT_CLAIMED
        steps.forget_after(part, task, None)  # a reset run starts its steps anew
        part.answers.forget_task(task)

    # ---- steps: consumption tied to the trainer's saved steps (core/steps.py) ---------
    def check_commit_step(self, partition_id: str, task: str, step: int) -> tuple[Partition, bool]:
        """The partition, and whether committing ``step`` records a mark (False: the last
        step again); a step going back is InvalidBatch. Changes nothing."""
        part = self.partition(partition_id)
        self.task_of(part, task)
        return part, steps.check_commit(part, task, step)

    def rows_to_rewind(
        self, partition_id: str, task: str, step: int | None
    ) -> tuple[Partition, np.ndarray]:
        """The live rows the task claimed after ``step``'s mark (an unknown step is
        InvalidBatch naming the committed ones). Changes nothing."""
        part = self.partition(partition_id)
        self.task_of(part, task)
        return part, steps.rows_after(part, task, step)

    def rewind(self, part: Partition, task: str, rows: np.ndarray, step: int | None) -> int:
        """Hand ``rows`` back to the task (claimable again) and forget later steps' marks
        and its remembered claim answers; returns how many rows."""
        for table in (part.consumed, part.lease_until, part.holder):
            if task in table:
                table[task][rows] = 0
        part.column(part.claimed_at, task, np.int64, steps.NOT_CLAIMED)[rows] = steps.NOT_CLAIMED
        steps.forget_after(part, task, step)
        part.answers.forget_task(task)  # a retry of a rewound claim must not replay it
        return len(rows)

    def consumption(self, part: Partition, task: str) -> TaskConsumption:
        self.task_of(part, task)
        n = part.n_rows
        live = part.live[:n]
        consumed = int((part.column(part.consumed, task)[:n] & live).sum())
        lost = len(self.lost_rows(part, task))  # terminal: they count towards done
        total = int(live.sum())
        expected = part.declaration.expected_samples
        lease = part.declaration.task_leases.get(task)
        leased = redelivered = 0
        if lease is not None:
            held = part.column(part.lease_until, task, np.float64, 0.0)[:n] > self.clock()
            leased = int((held & live & ~part.column(part.consumed, task)[:n]).sum())
            extra = part.column(part.deliveries, task, np.int32, 0)[:n] - 1
            redelivered = int(np.clip(extra[live], 0, None).sum())
        return TaskConsumption(
            task=task,
            consumed=consumed,
            total=total,
            expected=expected,
            # Cleared samples count as done (clearing acknowledges); a declared size must
            # also have arrived in full.
            done=consumed + lost == total and (expected is None or part.n_rows >= expected),
            leased=leased,
            lease_s=lease,
            redeliveries=redelivered,
            lost=lost,
            committed_step=part.steps[task].last if task in part.steps else None,
        )

    def redeliveries_of(self, part: Partition, row: int) -> int:
        return sum(max(int(col[row]) - 1, 0) for col in part.deliveries.values() if len(col) > row)

    # ---- clearing -----------------------------------------------------------------
    def clear_samples(self, partition_id: str, sample_ids: list[str]) -> dict[int, list[str]]:
        """Forget samples (clearing acknowledges them); returns their ids per live unit."""
        return self.clear_rows(*self.rows_to_clear(partition_id, sample_ids))

    def rows_to_clear(
        self, partition_id: str, sample_ids: list[str]
    ) -> tuple[Partition, np.ndarray]:
        """The rows ``clear_samples`` would forget, changing nothing (SamplesNotFound first)."""
        part = self.partition(partition_id)
        return part, part.existing_rows(sample_ids, "cannot clear unknown samples")

    @staticmethod
    def removal_record(part: Partition, rows: np.ndarray) -> tuple[list[str], list[int]]:
        """What a journal record of the rows' removal names: ids and births (journal.py)."""
        return [part.ids[r] or "" for r in rows.tolist()], part.born[rows].tolist()

    def clear_rows(self, part: Partition, rows: np.ndarray) -> dict[int, list[str]]:
        """Forget live rows; returns their ids per live unit (whose bytes to free)."""
        by_unit: dict[int, list[str]] = {}
        for r in rows.tolist():
            sid = part.ids[r]
            by_unit.setdefault(int(part.unit[r]), []).append(sid)
            if part.replica[r] >= 0:
                by_unit.setdefault(int(part.replica[r]), []).append(sid)
        part.forget(rows.tolist())
        return {u: ids for u, ids in by_unit.items() if self.unit_alive[u]}

    # ---- versions (async RL): which rows are stale, evictable, of a generation ----------
    def versioned(self, partition_id: str) -> tuple[Partition, VersionState]:
        part = self.partition(partition_id)
        if part.versions is None:
            raise InvalidBatch(
                "the partition has no policy versions: register it with a StalenessSpec",
                partition_id=partition_id,
            )
        return part, part.versions

    def _taken(self, part: Partition, task: str) -> np.ndarray:
        """Per row: consumed by the task, or held by one of its live leases."""
        n = part.n_rows
        taken = part.column(part.consumed, task)[:n].copy()
        if task in part.declaration.task_leases:
            taken |= part.column(part.lease_until, task, np.float64, 0.0)[:n] > self.clock()
        return taken

    def stale_rows(self, part: Partition) -> tuple[np.ndarray, dict[str, int]]:
        """Live rows some bounded task still needs and may never claim (older than its
        window), and how many per task; a partition that keeps stale samples has none."""
        versions = part.versions
        n = part.n_rows
        if versions is None or versions.spec.stale_samples != "drop" or not n:
            return np.zeros(0, dtype=np.int64), {}
        # A partial rollout in progress is its producer's until finished: judged then.
        live = np.nonzero(part.live[:n] & ~part.in_progress[:n])[0]
        row_versions = part.versions_of(live)
        stale = np.zeros(len(live), dtype=bool)
        per_task: dict[str, int] = {}
        for task, bound in versions.bounded_tasks(part.tasks).items():
            owed = ~(self._taken(part, task) | part.column(part.filtered, task)[:n])[live]
            mine = (row_versions < versions.oldest_allowed(bound)) & owed
            if mine.any():
                per_task[task] = int(mine.sum())
                stale |= mine
        return live[stale], per_task

    def evictable_rows(self, part: Partition) -> np.ndarray:
        """Whole groups (or single rows) of the oldest version no task has claimed: what
        makes room when a unit is full (empty: nothing may go)."""
        n = part.n_rows
        if part.versions is None or not part.versions.spec.evict_stale or not n:
            return np.zeros(0, dtype=np.int64)
        live = part.live[:n]
        claimed = np.zeros(n, dtype=bool)
        for task in part.tasks:
            claimed |= self._taken(part, task)
        # A group with any member claimed stays whole: none of it is evictable.
        grouped = part.group_code[:n] >= 0
        if grouped.any():
            touched = np.zeros(len(part.group_live), dtype=bool)
            touched[part.group_code[:n][grouped & claimed & live]] = True
            claimed |= grouped & touched[np.maximum(part.group_code[:n], 0)]
        candidates = np.nonzero(live & ~claimed & ~part.in_progress[:n])[0]
        if not len(candidates):
            return candidates
        versions = part.versions_of(candidates)
        return candidates[versions == versions.min()]

    def rows_of_versions(self, part: Partition, lowest: int, highest: int) -> np.ndarray:
        """Live rows whose version tag is within [lowest, highest] (their own, not their
        group's: a generation is retired by what each sample was generated under)."""
        assert part.version_tag is not None
        n = part.n_rows
        own = part.tag_values[part.version_tag][:n]
        keep = part.live[:n] & part.tag_present[part.version_tag][:n]
        return np.nonzero(keep & (own >= lowest) & (own <= highest))[0]

    def untrained_versions(self, part: Partition) -> np.ndarray:
        """The versions of the live samples some bounded task has not consumed yet and
        still may (within its window): what admission counts (paced admission looks at the
        oldest). A kept stale sample will never be trained, nor will one the task's
        filtered claims refused."""
        versions = part.versions
        assert versions is not None
        live = np.nonzero(part.live[: part.n_rows])[0]
        row_versions = part.versions_of(live)
        needed = np.zeros(len(live), dtype=bool)
        for task, bound in versions.bounded_tasks(part.tasks).items():
            fresh = row_versions >= versions.oldest_allowed(bound)
            done = part.column(part.consumed, task)[live] | part.column(part.filtered, task)[live]
            needed |= fresh & ~done
        return row_versions[needed]

    def untrained(self, part: Partition) -> int:
        return len(self.untrained_versions(part))

    def ready_by_version(self, part: Partition) -> dict[int, int]:
        """Live samples per version tag."""
        assert part.version_tag is not None
        n = part.n_rows
        keep = part.live[:n] & part.tag_present[part.version_tag][:n]
        values, counts = np.unique(part.tag_values[part.version_tag][:n][keep], return_counts=True)
        return dict(zip(values.tolist(), counts.tolist()))

    def live_units(self) -> list[int]:
        return [u for u, ok in enumerate(self.unit_alive) if ok]

    # ---- replication: the second copy takes over ---------------------------------
    def fail_over(self, part: Partition | None = None) -> None:
        """After a unit died: rows whose unit is gone are served by their second copy (it
        becomes their unit), and a gone second copy is forgotten. Rows with no copy left
        keep their dead unit: they are lost. ``part`` None: every partition."""
        alive = np.asarray(self.unit_alive, dtype=bool)
        for p in self.partitions.values() if part is None else [part]:
            unit, replica = p.unit[: p.n_rows], p.replica[: p.n_rows]
            has = replica >= 0
            replica_ok = has & alive[np.where(has, replica, 0)]
            promote = replica_ok & ~alive[unit]
            unit[promote] = replica[promote]
            replica[promote | (has & ~replica_ok)] = -1

    def replica_units(self, partition_id: str, sample_ids: list[str]) -> list[int]:
        """Second copy's unit per sample (-1 = none, or not written yet)."""
        part = self.partition(partition_id)
        return [int(part.replica[r]) if r >= 0 else -1 for r in part.rows_of(sample_ids)]

    # ---- rebuilding from the units, and what only the key space knows ---------------
    def rebuild_partition(
        self, partition_id: str, declaration: Declaration, stored: list[tuple[int, StoredRows]]
    ) -> Partition:
        """Recreate a partition from what its units hold (``stored``: (unit, rows) pairs).

        Rows come back in commit order (the units keep each sample's commit
        number), so claims hand samples out in the order they were written.
        Consumption starts empty: ``restore_consumption`` puts it back.
        """
        part = Partition(partition_id, declaration, time.time())
        self.partitions[partition_id] = part
        if self._rebuild_single_copies(part, stored):
            return part
        order = sorted((seq, unit, i) for unit, rows in stored for i, seq in enumerate(rows.seq))
        by_unit = dict(stored)
        # A replicated sample is held by two units: the first in (commit order, unit) is its
        # unit, the other its second copy.
        first: dict[str, int] = {}
        replica_at: dict[int, int] = {}
        copies = []  # (key of the sample's first copy in ``order``, unit, index in unit)
        for k, (_, u, i) in enumerate(order):
            j = first.setdefault(by_unit[u].sample_ids[i], k)
            if j != k:
                replica_at[j] = u
            copies.append((j, u, i))
        primary = sorted(first.values())
        if not primary:
            return part
        ids = [by_unit[order[k][1]].sample_ids[order[k][2]] for k in primary]
        units = np.asarray([order[k][1] for k in primary], dtype=np.int16)
        replicas = np.asarray([replica_at.get(k, -1) for k in primary], dtype=np.int16)
        rows = part.add_rows(ids, units, replicas)
        part.born[rows] = [order[k][0] for k in primary]
        part.seq_len[rows] = [by_unit[order[k][1]].sequence_lengths[order[k][2]] for k in primary]
        row_of_key = dict(zip(primary, rows.tolist()))
        row_in = {u: np.empty(len(got.sample_ids), dtype=np.int64) for u, got in stored}
        for j, u, i in copies:
            row_in[u][i] = row_of_key[j]
        for u, got in stored:
            for name, schema in got.fields.items():
                part.schema.setdefault(name, tuple(schema))
                bits = np.asarray(got.produced[name], dtype=bool)
                part.column(part.produced, name)[row_in[u][bits]] = True
            for i, tag in enumerate(got.tags):
                if tag:
                    self._merge_tags(part, int(row_in[u][i]), tag)
        return part

    def _rebuild_single_copies(self, part: Partition, stored: list[tuple[int, StoredRows]]) -> bool:
        """``rebuild_partition`` for rows no two units hold (no second copies): the same
        rows in the same order, in array operations, so a restart with a million samples
        stored spends no Python step per row. False (nothing done) when some id is held
        twice: the general path sorts the copies out."""
        ids = [s for _, got in stored for s in got.sample_ids]
        if len(set(ids)) != len(ids):
            return False
        if not ids:
            return True
        seq = np.concatenate([np.asarray(got.seq, dtype=np.int64) for _, got in stored])
        unit = np.concatenate(
            [np.full(len(got.sample_ids), u, dtype=np.int16) for u, got in stored]
        )
        order = np.lexsort((unit, seq))  # commit order, then unit: as the general path
        rows = part.add_rows([ids[k] for k in order.tolist()], unit[order])
        part.born[rows] = seq[order]
        lengths = np.concatenate(
            [np.asarray(got.sequence_lengths, dtype=np.int64) for _, got in stored]
        )
        part.seq_len[rows] = lengths[order]
        row_at = np.empty(len(ids), dtype=np.int64)
        row_at[order] = rows
        start = 0
        for _, got in stored:
            row_in = row_at[start : start + len(got.sample_ids)]
            start += len(got.sample_ids)
            for name, schema in got.fields.items():
                part.schema.setdefault(name, tuple(schema))
                bits = np.asarray(got.produced[name], dtype=bool)
                part.column(part.produced, name)[row_in[bits]] = True
            for i, tag in enumerate(got.tags):
                if tag:
                    self._merge_tags(part, int(row_in[i]), tag)
        return True

    def export_state(self) -> dict[str, dict]:
        """What only the key space knows, per partition: its declaration (as a record) and
        its consumption. The journal's snapshot and a checkpoint's state, in this form."""
        return {
            pid: {
                "declaration": p.declaration.to_record(),
                "created_at": p.created_at,
                "tasks": self.export_consumption(p),
                "answers": p.answers.export(),
                "staleness": None if p.versions is None else p.versions.export(),
                "groups": None if p.deadlines is None else p.deadlines.export(),
            }
            for pid, p in self.partitions.items()
        }

    def export_consumption(self, part: Partition) -> dict:
        """Per task: consumed ids, held leases (wall-clock deadlines) and delivery counts."""
        n, now, wall = part.n_rows, self.clock(), time.time()
        live = np.nonzero(part.live[:n])[0]
        out = {}
        for task in part.tasks:
            consumed = part.column(part.consumed, task)[:n]
            filtered = part.column(part.filtered, task)[:n]
            stamped = part.column(part.claimed_at, task, np.int64, steps.NOT_CLAIMED)[:n]
            state: dict[str, Any] = {
                "consumed": [part.ids[r] for r in live if consumed[r]],
                "filtered": [part.ids[r] for r in live if filtered[r]],
                "claimed_at": [[part.ids[r], int(stamped[r])] for r in live if stamped[r] > 0],
                "steps": steps.steps_of(part, task).export(),
            }
            if task in part.declaration.task_leases:
                until = part.column(part.lease_until, task, np.float64, 0.0)[:n]
                holder = part.column(part.holder, task, np.int64, NO_LEASE)[:n]
                deliveries = part.column(part.deliveries, task, np.int32, 0)[:n]
                state["leases"] = [
                    [part.ids[r], float(until[r] - now + wall), int(holder[r])]
                    for r in live
                    if until[r] > now and not consumed[r]
                ]
                state["deliveries"] = [
                    [part.ids[r], int(deliveries[r])] for r in live if deliveries[r]
                ]
            out[task] = state
        return out

    def restore_consumption(self, part: Partition, state: dict) -> None:
        """Put back what ``export_consumption`` (or a replayed journal) said; unknown ids are
        samples cleared since, and are skipped."""
        now, wall = self.clock(), time.time()
        for task, task_state in state.items():
            if task not in part.tasks:
                continue
            rows = part.rows_of(list(task_state.get("consumed", ())))
            part.column(part.consumed, task)[rows[rows >= 0]] = True
            rows = part.rows_of(list(task_state.get("filtered", ())))
            part.column(part.filtered, task)[rows[rows >= 0]] = True
            stamped = task_state.get("claimed_at", ())
            if stamped:
                rows = part.rows_of([sid for sid, _ in stamped])
                keep = rows >= 0
                counts = np.asarray([c for _, c in stamped], dtype=np.int64)
                column = part.column(part.claimed_at, task, np.int64, steps.NOT_CLAIMED)
                column[rows[keep]] = counts[keep]
            part.steps[task] = steps.TaskSteps.restore(task_state.get("steps"))
            leases = task_state.get("leases", ())
            if leases:
                rows = part.rows_of([sid for sid, _, _ in leases])
                keep = rows >= 0
                until = np.asarray([d for _, d, _ in leases], dtype=np.float64) - wall + now
                holder = np.asarray([h for _, _, h in leases], dtype=np.int64)
                part.column(part.lease_until, task, np.float64, 0.0)[rows[keep]] = until[keep]
                part.column(part.holder, task, np.int64, NO_LEASE)[rows[keep]] = holder[keep]
            counts = task_state.get("deliveries", ())
            if counts:
                rows = part.rows_of([sid for sid, _ in counts])
                keep = rows >= 0
                n = np.asarray([c for _, c in counts], dtype=np.int32)
                part.column(part.deliveries, task, np.int32, 0)[rows[keep]] = n[keep]
