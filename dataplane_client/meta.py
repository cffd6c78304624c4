"""KVBatchMeta: the key list the driver ships instead of tensors.

A meta names samples of one partition (``sample_ids``), optionally the fields
they carry, their sequence lengths and per-sample tags. It is small: no tensor
ever rides in a meta. Every method returns a new meta; ``extra_info`` is copied
(shallowly, per key) so editing one meta's extra_info never edits another's.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dataplane_client.errors import InvalidBatch


def duplicated(ids: Sequence[str]) -> list[str]:
    """The ids that occur more than once, each listed once, in first-repeat order."""
    seen: set[str] = set()
    dups: dict[str, None] = {}
    for s in ids:
        if s in seen:
            dups[s] = None
        seen.add(s)
    return list(dups)


@dataclass
class KVBatchMeta:
    partition_id: str
    task_name: str | None = None
    sample_ids: list[str] = field(default_factory=list)
    fields: list[str] | None = None
    sequence_lengths: list[int] | None = None
    extra_info: dict[str, Any] = field(default_factory=dict)
    tags: list[dict] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.partition_id, str) or not self.partition_id:
            raise InvalidBatch(f"partition_id must be a non-empty str, got {self.partition_id!r}")
        self.sample_ids = list(self.sample_ids)
        for sid in self.sample_ids:
            if not isinstance(sid, str):
                raise InvalidBatch(f"sample ids must be str, got {type(sid).__name__}", ids=[sid])
        n = len(self.sample_ids)
        if self.fields is not None:
            self.fields = list(self.fields)
        if self.sequence_lengths is not None:
            self.sequence_lengths = [int(x) for x in self.sequence_lengths]
            if len(self.sequence_lengths) != n:
                raise InvalidBatch(
                    f"sequence_lengths has {len(self.sequence_lengths)} entries for {n} sample_ids",
                    partition_id=self.partition_id,
                )
        if self.tags is not None:
            self.tags = [dict(t) for t in self.tags]
            if len(self.tags) != n:
                raise InvalidBatch(
                    f"tags has {len(self.tags)} entries for {n} sample_ids",
                    partition_id=self.partition_id,
                )
        if not isinstance(self.extra_info, dict):
            raise InvalidBatch(f"extra_info must be a dict, got {type(self.extra_info).__name__}")
        self.extra_info = copy.copy(self.extra_info)

    # ---- views -------------------------------------------------------------
    @property
    def size(self) -> int:
        return len(self.sample_ids)

    def __len__(self) -> int:
        return len(self.sample_ids)

    def _pick(self, idx: Sequence[int]) -> KVBatchMeta:
        idx = [int(i) for i in idx]
        n = len(self.sample_ids)
        bad = [i for i in idx if not -n <= i < n]
        if bad:
            raise InvalidBatch(f"indices {bad[:10]} out of range for a meta of {n} samples")
        return KVBatchMeta(
            partition_id=self.partition_id,
            task_name=self.task_name,
            sample_ids=[self.sample_ids[i] for i in idx],
            fields=self.fields,
            sequence_lengths=None
            if self.sequence_lengths is None
            else [self.sequence_lengths[i] for i in idx],
            extra_info=self.extra_info,
            tags=None if self.tags is None else [self.tags[i] for i in idx],
        )

    def subset(self, idx: Sequence[int]) -> KVBatchMeta:
        """The samples at positions ``idx``, in that order."""
        return self._pick(idx)

    def slice(self, start: int, end: int) -> KVBatchMeta:
        """Samples ``[start, end)``."""
        return self._pick(range(*slice(start, end).indices(len(self.sample_ids))))

    def drop(self, idx: Sequence[int]) -> KVBatchMeta:
        """Everything except the samples at positions ``idx``."""
        n = len(self.sample_ids)
        gone = {int(i) % n for i in idx} if n else set()
        return self._pick([i for i in range(n) if i not in gone])

    def with_fields(self, names: Sequence[str]) -> KVBatchMeta:
        out = self._pick(range(len(self.sample_ids)))
        out.fields = list(names)
        return out

    def stamp_tags(self, scalars: dict[str, Any]) -> KVBatchMeta:
        """Set the same scalar tags on every sample (existing keys are replaced)."""
        out = self._pick(range(len(self.sample_ids)))
        base = out.tags if out.tags is not None else [{} for _ in out.sample_ids]
        out.tags = [{**t, **scalars} for t in base]
        return out

    def concat(self, *others: KVBatchMeta) -> KVBatchMeta:
        """This meta followed by ``others`` (same partition required)."""
        metas = [self, *others]
        for m in others:
            if m.partition_id != self.partition_id:
                raise InvalidBatch(
                    f"cannot concat metas of different partitions: "
                    f"{self.partition_id!r} and {m.partition_id!r}"
                )
        ids = [s for m in metas for s in m.sample_ids]
        dups = duplicated(ids)
        if dups:
            raise InvalidBatch("concat would duplicate sample ids", ids=dups)
        lens = None
        if all(m.sequence_lengths is not None for m in metas):
            lens = [x for m in metas for x in m.sequence_lengths]
        tags = None
        if any(m.tags is not None for m in metas):
            tags = [t for m in metas for t in (m.tags or [{} for _ in m.sample_ids])]
        fields = self.fields
        if all(m.fields is not None for m in metas):
            fields = [f for f in self.fields if all(f in m.fields for m in others)]
        extra: dict[str, Any] = {}
        for m in metas:
            extra.update(m.extra_info)
        return KVBatchMeta(
            partition_id=self.partition_id,
            task_name=self.task_name,
            sample_ids=ids,
            fields=fields,
            sequence_lengths=lens,
            extra_info=extra,
            tags=tags,
        )
