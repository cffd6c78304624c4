"""KVBatchMeta: the key list the driver ships instead of tensors.

A meta names samples of one partition (``sample_ids``), optionally the fields
they carry, their sequence lengths and per-sample tags. It is small: no tensor
ever rides in a meta. Its fields and method semantics are NeMo-RL's contract
(``docs/nemo_rl_contract.md`` lists where we differ, and why): the views
(``subset``, ``slice``, ``drop``, ``concat``, ``with_fields``) return new metas whose ``extra_info`` is a shallow
copy, so editing one meta's extra_info never edits another's; ``stamp_tags``
alone edits the meta in place.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeGuard, TypeVar

import numpy as np

from dataplane_client.wire.errors import InvalidBatch

if TYPE_CHECKING:
    import torch


def _is_array(values: Any) -> TypeGuard[np.ndarray | torch.Tensor]:
    """A numpy array or a torch tensor. torch is looked up, not imported: the controller
    imports metas, never sees a tensor, and starts (and restarts) 2-3 s sooner without it."""
    torch_module = sys.modules.get("torch")
    return isinstance(values, np.ndarray) or (
        torch_module is not None and isinstance(values, torch_module.Tensor)
    )


def duplicated(ids: Sequence[str]) -> list[str]:
    """The ids that occur more than once, each listed once, in first-repeat order."""
    seen: set[str] = set()
    dups: dict[str, None] = {}
    for s in ids:
        if s in seen:
            dups[s] = None
        seen.add(s)
    return list(dups)


_T = TypeVar("_T")


def _all_given(parts: Sequence[list[_T] | None]) -> list[list[_T]] | None:
    """``parts`` when every one is given, else None."""
    given = [p for p in parts if p is not None]
    return given if len(given) == len(parts) else None


def _per_row_values(name: str, values: Any, size: int) -> list:
    """``values`` (list, tuple, tensor or ndarray of one entry per row) as Python values."""
    if _is_array(values):
        if values.ndim != 1:
            raise InvalidBatch(
                f"tag {name!r}: a per-row tensor must be 1-D, got shape {tuple(values.shape)}"
            )
        values = values.tolist()
    elif isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise InvalidBatch(
            f"tag {name!r}: expected a per-row sequence (list, tensor or ndarray) of "
            f"{size} values, got {type(values).__name__}"
        )
    if len(values) != size:
        raise InvalidBatch(f"tag {name!r} has {len(values)} values for {size} sample ids")
    return list(values)


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
        if not set(map(type, self.sample_ids)) <= {str}:  # a C-level pass; names the first
            for sid in self.sample_ids:
                if not isinstance(sid, str):
                    raise InvalidBatch(
                        f"sample ids must be str, got {type(sid).__name__}", ids=[sid]
                    )
        n = len(self.sample_ids)
        if self.fields is not None:
            self.fields = list(self.fields)
        if self.sequence_lengths is not None:
            self.sequence_lengths = list(map(int, self.sequence_lengths))
            if len(self.sequence_lengths) != n:
                raise InvalidBatch(
                    f"sequence_lengths has {len(self.sequence_lengths)} entries for {n} sample_ids",
                    partition_id=self.partition_id,
                )
        if self.tags is not None:
            # Copied per row, so stamping one meta's tags never edits a meta it came from.
            self.tags = list(map(dict, self.tags))
            if len(self.tags) != n:
                raise InvalidBatch(
                    f"tags must align 1:1 with sample_ids: {len(self.tags)} tags for "
                    f"{n} sample ids",
                    partition_id=self.partition_id,
                )
        if not isinstance(self.extra_info, dict):
            raise InvalidBatch(f"extra_info must be a dict, got {type(self.extra_info).__name__}")
        self.extra_info = dict(self.extra_info)

    @property
    def size(self) -> int:
        """Number of samples."""
        return len(self.sample_ids)

    def __len__(self) -> int:
        return len(self.sample_ids)

    # ---- in place ----------------------------------------------------------
    def stamp_tags(self, scalars: Mapping[str, Any]) -> None:
        """Write per-row values into the tags, in place: ``tags[i][name] = values[i]``.

        Each value is a sequence of ``size`` entries (list, tensor, ndarray).
        Tags are initialised to empty dicts when there were none. Every value
        is checked before any tag changes, so a rejected call changes nothing.
        """
        if not isinstance(scalars, Mapping):
            raise InvalidBatch(
                f"stamp_tags takes a mapping name -> per-row values, got {type(scalars).__name__}"
            )
        columns = {name: _per_row_values(name, v, self.size) for name, v in scalars.items()}
        if self.tags is None:
            self.tags = [{} for _ in self.sample_ids]
        for name, values in columns.items():
            for tag, value in zip(self.tags, values):
                tag[name] = value

    # ---- views -------------------------------------------------------------
    def _positions(self, indices: Iterable[int] | torch.Tensor | np.ndarray) -> list[int]:
        if _is_array(indices):
            indices = indices.tolist()
        out = [int(i) for i in indices]
        n = self.size
        bad = [i for i in out if not -n <= i < n]
        if bad:
            raise InvalidBatch(f"indices {bad[:10]} out of range for a meta of {n} samples")
        return [i % n for i in out]

    def _pick(self, rows: list[int]) -> KVBatchMeta:
        lengths, tags = self.sequence_lengths, self.tags
        return KVBatchMeta(
            partition_id=self.partition_id,
            task_name=self.task_name,
            sample_ids=[self.sample_ids[i] for i in rows],
            fields=self.fields,
            sequence_lengths=None if lengths is None else [lengths[i] for i in rows],
            extra_info=self.extra_info,
            tags=None if tags is None else [tags[i] for i in rows],
        )

    def subset(self, indices: Iterable[int] | torch.Tensor | np.ndarray) -> KVBatchMeta:
        """The samples at positions ``indices``, in that order."""
        return self._pick(self._positions(indices))

    def slice(self, start: int, stop: int) -> KVBatchMeta:
        """Samples ``[start, stop)`` (Python slice rules)."""
        return self._pick(list(range(*slice(start, stop).indices(self.size))))

    def drop(self, indices: Iterable[int] | torch.Tensor | np.ndarray) -> KVBatchMeta | None:
        """Every sample except those at ``indices``; None when nothing is left."""
        gone = set(self._positions(indices))
        kept = [i for i in range(self.size) if i not in gone]
        return self._pick(kept) if kept else None

    def with_fields(self, names: Iterable[str] | None) -> KVBatchMeta:
        """A copy whose ``fields`` are this meta's merged with ``names`` (order kept, no repeats)."""
        out = self._pick(list(range(self.size)))
        out.fields = list(dict.fromkeys([*(self.fields or []), *(names or [])]))
        return out

    def concat(self, *others: KVBatchMeta) -> KVBatchMeta:
        """This meta followed by ``others``, all of the same partition.

        Lengths, tags and fields survive only when every part has them (fields:
        those every part has); anything else would invent values for some rows.
        """
        metas = [self, *others]
        for m in others:
            if m.partition_id != self.partition_id:
                raise InvalidBatch(
                    f"partition_ids must match to concat metas: "
                    f"{self.partition_id!r} and {m.partition_id!r}"
                )
        ids = [s for m in metas for s in m.sample_ids]
        dups = duplicated(ids)
        if dups:
            raise InvalidBatch("concat would duplicate sample ids", ids=dups)
        lengths = tags = fields = None
        all_lengths = _all_given([m.sequence_lengths for m in metas])
        if all_lengths is not None:
            lengths = [x for part in all_lengths for x in part]
        all_tags = _all_given([m.tags for m in metas])
        if all_tags is not None:
            tags = [t for part in all_tags for t in part]
        all_fields = _all_given([m.fields for m in metas])
        if all_fields is not None:
            first, *rest = all_fields
            fields = [f for f in first if all(f in part for part in rest)]
        extra: dict[str, Any] = {}
        for m in metas:
            extra.update(m.extra_info)
        return KVBatchMeta(
            partition_id=self.partition_id,
            task_name=self.task_name,
            sample_ids=ids,
            fields=fields,
            sequence_lengths=lengths,
            extra_info=extra,
            tags=tags,
        )
