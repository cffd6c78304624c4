"""What a claim policy sees and promises, and the registry that finds one by name.

A claim policy decides which of a partition's ready rows a claim hands out,
and in which order. It sees the ready rows as columns (``ReadyRows``: numpy
arrays, one entry per ready row, oldest commit first) and returns positions
into them; the key space does everything else (what is ready, due, consumed,
leased, journaled). A policy is pure: no state, no Ray, no I/O.

Policies register under a name (``@register("name")``); a partition names
one at registration and a claim may name another. Every module of this
package is imported by the package itself, so a new policy is one file here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np

from dataplane_client.wire.errors import InvalidBatch


@dataclass(frozen=True)
class PartitionTraits:
    """What a policy may check its options against: the partition's declaration, in brief."""

    group_size: int | None = None
    numeric_tags: Mapping[str, str] = field(default_factory=dict)  # tag -> dtype name
    version_tag: str | None = None  # a versioned partition's (StalenessSpec)


@dataclass(frozen=True, eq=False)
class RowColumns:
    """A partition's columns, one entry per row of the partition (``ReadyRows`` gathers the
    ready rows' entries from them only when a policy asks)."""

    sequence_lengths: np.ndarray  # int, -1: unknown
    group: np.ndarray  # int64 group code, -1: no group
    group_live: np.ndarray  # per group code: live rows of that group
    tags: Mapping[str, np.ndarray] = field(default_factory=dict)  # declared numeric tags
    tag_present: Mapping[str, np.ndarray] = field(default_factory=dict)
    ids: Sequence[str | None] = ()
    # rows -> each row's policy version (a group's oldest member's); None: not versioned.
    versions_of: Callable[[np.ndarray], np.ndarray] | None = None
    # per group code: members that will never come (an overdue group's, past its
    # partition's group_deadline_s; 0 for every other group). Empty: no deadline.
    group_short: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


@dataclass(frozen=True, eq=False)
class ReadyRows:
    """The rows a claim may hand out, as columns. Position ``i`` is row ``rows[i]``.

    ``rows`` ascend, and a row's number is its place in commit order: position
    0 is the oldest ready sample. Every other column is gathered on first use
    (a policy that reads only ``rows`` costs nothing more).
    """

    rows: np.ndarray  # int64
    group_size: int | None
    columns: RowColumns
    # How many samples of the partition the claiming task has consumed or holds under a
    # lease (``taken``), asked only when a policy reads it; None: 0.
    taken_of: Callable[[], int] | None = None

    def __len__(self) -> int:
        return len(self.rows)

    @functools.cached_property
    def sequence_lengths(self) -> np.ndarray:
        """Each row's sequence length (int64; -1 where the writer gave none)."""
        return self.columns.sequence_lengths[self.rows].astype(np.int64, copy=False)

    @functools.cached_property
    def group(self) -> np.ndarray:
        """Each row's group (an int64 code per distinct group_id tag; -1: no group)."""
        return self.columns.group[self.rows]

    @functools.cached_property
    def group_members(self) -> np.ndarray:
        """How many live rows the row's group has (ready or not; 0 for no group)."""
        if not len(self.columns.group_live):
            return np.zeros(len(self.rows), dtype=np.int64)
        group = self.group
        return np.where(group >= 0, self.columns.group_live[np.maximum(group, 0)], 0)

    @functools.cached_property
    def group_short(self) -> np.ndarray:
        """Per row: how many members its group will never get (0 unless the group is
        overdue: past its partition's ``group_deadline_s`` and short of members)."""
        short = self.columns.group_short
        if not len(short):
            return np.zeros(len(self.rows), dtype=np.int64)
        group = self.group
        inside = (group >= 0) & (group < len(short))
        return np.where(inside, short[np.clip(group, 0, len(short) - 1)], 0)

    @functools.cached_property
    def sample_ids(self) -> list[str | None]:
        """Each row's sample id (a ready row is live, so never None in practice)."""
        ids = self.columns.ids
        return [ids[r] for r in self.rows.tolist()]

    @functools.cached_property
    def taken(self) -> int:
        """How many of the partition's live samples the claiming task has consumed or holds
        under a lease, before this claim (``token_budget``'s ``step_end`` counts from it)."""
        return 0 if self.taken_of is None else int(self.taken_of())

    @functools.cached_property
    def versions(self) -> np.ndarray:
        """Each row's policy version, a group's being its oldest member's (int64).
        InvalidBatch on a partition without versions."""
        if self.columns.versions_of is None:
            raise InvalidBatch("this claim policy needs a partition registered with versions")
        return self.columns.versions_of(self.rows)

    @property
    def tag_names(self) -> list[str]:
        return list(self.columns.tags)

    def tag(self, name: str) -> np.ndarray:
        """The numeric tag ``name`` per row, as its declared dtype (0 where a row lacks it:
        see ``has_tag``). KeyError for a tag the partition did not declare numeric."""
        return self.columns.tags[name][self.rows]

    def has_tag(self, name: str) -> np.ndarray:
        """Which rows carry the numeric tag ``name`` (bool per row)."""
        return self.columns.tag_present[name][self.rows]

    @classmethod
    def of(
        cls,
        sequence_lengths: Sequence[int] | np.ndarray,
        *,
        group: Sequence[int] | np.ndarray | None = None,
        group_size: int | None = None,
        tags: Mapping[str, Sequence[Any] | np.ndarray] | None = None,
        versions: Sequence[int] | np.ndarray | None = None,
        group_short: Sequence[int] | np.ndarray | None = None,
        taken: int = 0,
    ) -> ReadyRows:
        """Every row ready, from plain columns: for testing a policy without a key space.
        Groups count their members among these rows; every given tag is present;
        ``group_short``: per group code, members that will never come (overdue groups);
        the task has consumed or holds ``taken`` other samples."""
        lengths = np.asarray(sequence_lengths, dtype=np.int64)
        n = len(lengths)
        codes = np.full(n, -1, dtype=np.int64) if group is None else np.asarray(group, np.int64)
        live = np.bincount(codes[codes >= 0]) if (codes >= 0).any() else np.zeros(0, np.int64)
        given = {name: np.asarray(values) for name, values in (tags or {}).items()}
        return cls(
            rows=np.arange(n, dtype=np.int64),
            group_size=group_size,
            columns=RowColumns(
                sequence_lengths=lengths,
                group=codes,
                group_live=live,
                tags=given,
                tag_present={name: np.ones(n, dtype=bool) for name in given},
                ids=[f"row-{i}" for i in range(n)],
                versions_of=None
                if versions is None
                else np.asarray(versions, dtype=np.int64).__getitem__,
                group_short=np.asarray(group_short if group_short is not None else (), np.int64),
            ),
            taken_of=lambda: taken,
        )


class ClaimPolicy(Protocol):
    """Chooses which ready rows a claim hands out.

    ``check_options`` runs at registration and for each claim, before anything
    changes: it returns the options as the policy wants them, or raises
    ``InvalidBatch`` naming what is wrong. ``choose`` returns distinct positions
    into ``ready`` (at most ``batch_size``), in the order the claimer gets the
    samples; it may raise ``InvalidBatch`` for a ``batch_size`` it cannot serve.
    Fewer rows than ``batch_size`` make a claim wait (or, where allowed, a short
    batch): a policy that holds rows back must hand them out once nothing else comes.
    """

    def check_options(self, options: Mapping[str, Any], traits: PartitionTraits) -> dict: ...

    def choose(
        self, ready: ReadyRows, batch_size: int, options: Mapping[str, Any]
    ) -> np.ndarray: ...


_REGISTRY: dict[str, ClaimPolicy] = {}

P = TypeVar("P")


def register(name: str) -> Callable[[type[P]], type[P]]:
    """Class decorator: the policy (instantiated once, with no arguments) is known as ``name``."""

    def add(cls: type[P]) -> type[P]:
        if name in _REGISTRY:
            raise ValueError(f"a claim policy named {name!r} is registered already")
        _REGISTRY[name] = cls()  # type: ignore[assignment]
        return cls

    return add


def names() -> list[str]:
    return sorted(_REGISTRY)


def get(name: str) -> ClaimPolicy:
    """The policy registered as ``name``; InvalidBatch naming it and the known ones."""
    policy = _REGISTRY.get(name)
    if policy is None:
        raise InvalidBatch(f"unknown claim_policy {name!r}; known policies: {names()}")
    return policy


# ---- helpers for policies' option checks ----------------------------------------------
def only_options(policy: str, options: Mapping[str, Any], known: Sequence[str]) -> None:
    """InvalidBatch naming options the policy does not take."""
    unknown = sorted(set(options) - set(known))
    if unknown:
        takes = f"it takes {sorted(known)}" if known else "it takes none"
        raise InvalidBatch(f"claim policy {policy!r} has no option {unknown}: {takes}")


def positive_int(policy: str, options: Mapping[str, Any], key: str) -> int:
    """``options[key]``, an int >= 1 (bool refused), or InvalidBatch naming it."""
    if key not in options:
        raise InvalidBatch(f"claim policy {policy!r} needs the option {key!r} (an int >= 1)")
    value = options[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidBatch(f"claim policy {policy!r}: {key} must be an int >= 1, got {value!r}")
    return value
