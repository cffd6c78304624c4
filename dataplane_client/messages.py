"""Typed messages: everything that crosses an actor boundary, in one place.

Client, controller, storage units and the admin endpoint exchange these frozen
dataclasses (never string-keyed dicts), so a reader sees every field a message
carries and a consumer reads attributes instead of guarding keys. They live in
the bottom layer because the client builds and reads most of them.

Only builtins, numpy arrays and other messages inside: they pickle through Ray
and nothing here is reachable from a non-Ray client.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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


@dataclass(frozen=True)
class CommitResult:
    """The answer to a commit.

    ``rerouted`` non-empty means nothing was committed: some existing samples
    live on other units than the writer assumed (sample_id -> unit); the
    writer stages again there. Otherwise ``sequence_lengths`` are the rows'
    recorded lengths, in the order of the commit's ids.
    """

    rerouted: dict[str, int] = field(default_factory=dict)
    sequence_lengths: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Location:
    """A validated read: the fields to read and, per requested id, its unit."""

    fields: list[str]
    units: list[int]


@dataclass(frozen=True)
class ClearResult:
    cleared: int
    bytes_freed: int
