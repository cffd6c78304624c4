"""Typed messages between the controller and its storage units for recovery and checkpoints.

They never reach a client, so they live beside the server instead of in
``dataplane_client.wire.messages``. A unit keeps, beside each sample's bytes, what
a restarted controller needs to rebuild its key space (commit order, sequence
length, tags): the units are the ground truth for what is stored.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SampleMeta:
    """Per-sample metadata a commit hands to the unit that holds the samples' bytes."""

    seq: int  # the commit's sequence number: row order after a rebuild
    sequence_lengths: dict[str, int] = field(default_factory=dict)  # sample -> length
    tags: dict[str, dict] = field(default_factory=dict)  # sample -> tags of this commit


@dataclass(frozen=True)
class StoredRows:
    """Every sample of one partition a unit holds, as the unit knows it."""

    sample_ids: list[str]
    seq: list[int]
    sequence_lengths: list[int]
    tags: list[dict | None]
    fields: dict[str, tuple]  # field -> schema (layout, dtype, trailing shape)
    produced: dict[str, list[bool]]  # field -> produced bit per sample


@dataclass(frozen=True)
class PinnedWrite:
    """A write the controller prepared on this unit but may not have published everywhere."""

    partition_id: str
    staged_units: list[int]


@dataclass(frozen=True)
class UnitRecovery:
    """What a unit tells a (re)starting controller."""

    index: int
    partitions: dict[str, StoredRows]
    pinned: dict[str, PinnedWrite]  # write id -> where the write was staged
    published: list[str]  # recently published write ids (a retried commit is a no-op)


@dataclass(frozen=True)
class DumpedFile:
    """One file a unit wrote into a checkpoint."""

    unit: int
    name: str  # relative to the checkpoint directory
    nbytes: int
    digest: str  # core/file_digest.py: "crc32c:<hex>" or "sha256:<hex>"


@dataclass(frozen=True)
class DumpedUnit:
    """A unit's share of a checkpoint: its files (its index first, then the segments it
    uses), the bytes it wrote and those it hard-linked from the parent, its samples."""

    unit: int
    files: list[DumpedFile]
    written: int
    linked: int
    samples: int
