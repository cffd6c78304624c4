"""NamedSharding: names for the axes of a rank layout.

A worker group of ``PP x DP x CP x TP`` processes is laid out as an integer
array ``layout`` of global ranks whose axes carry names. Everything that
dispatches or groups workers asks this object, never recomputes index math:

>>> import numpy as np
>>> s = NamedSharding(np.arange(8).reshape(1, 2, 1, 4), PARALLEL_AXES)
>>> s.get_axis_size("data_parallel"), s.get_axis_size("tensor_parallel")
(2, 4)
>>> s.get_worker_coords(5)
{'pipeline_parallel': 0, 'data_parallel': 1, 'context_parallel': 0, 'tensor_parallel': 1}
>>> s.get_ranks_by_coord(data_parallel=1)
[4, 5, 6, 7]
>>> s.is_axis_zero(s.get_worker_coords(4), ["tensor_parallel"])
True
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

PIPELINE_PARALLEL = "pipeline_parallel"
DATA_PARALLEL = "data_parallel"
CONTEXT_PARALLEL = "context_parallel"
TENSOR_PARALLEL = "tensor_parallel"
# Axis order of every policy worker group (outermost first).
PARALLEL_AXES: list[str] = [PIPELINE_PARALLEL, DATA_PARALLEL, CONTEXT_PARALLEL, TENSOR_PARALLEL]
# The axes whose members hold the same data inside one DP rank.
REPLICA_AXES: list[str] = [PIPELINE_PARALLEL, CONTEXT_PARALLEL, TENSOR_PARALLEL]


class NamedSharding:
    """An n-d array of global ranks plus one name per axis."""

    def __init__(self, layout: np.ndarray | Sequence, names: Sequence[str]):
        layout = np.asarray(layout)
        names = list(names)
        if layout.ndim != len(names):
            raise ValueError(f"layout has {layout.ndim} axes but {len(names)} names: {names}")
        if len(set(names)) != len(names):
            raise ValueError(f"axis names must be unique, got {names}")
        if not np.issubdtype(layout.dtype, np.integer):
            raise ValueError(f"layout must hold integer ranks, got dtype {layout.dtype}")
        flat = np.sort(layout.reshape(-1))
        if not np.array_equal(flat, np.arange(layout.size)):
            raise ValueError("layout must hold each rank 0..size-1 exactly once")
        self._layout = layout
        self._names = names
        # rank -> coordinate tuple, precomputed once
        self._coords: dict[int, tuple[int, ...]] = {
            int(layout[idx]): tuple(int(i) for i in idx) for idx in np.ndindex(layout.shape)
        }

    @classmethod
    def for_policy(cls, *, pp: int = 1, dp: int = 1, cp: int = 1, tp: int = 1) -> NamedSharding:
        """The standard (PP, DP, CP, TP) layout with ranks in row-major order."""
        for name, v in (("pp", pp), ("dp", dp), ("cp", cp), ("tp", tp)):
            if int(v) < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        return cls(np.arange(pp * dp * cp * tp).reshape(pp, dp, cp, tp), PARALLEL_AXES)

    # ---- shape ---------------------------------------------------------------
    @property
    def layout(self) -> np.ndarray:
        return self._layout

    @property
    def names(self) -> list[str]:
        return list(self._names)

    @property
    def ndim(self) -> int:
        return self._layout.ndim

    @property
    def shape(self) -> dict[str, int]:
        return dict(zip(self._names, self._layout.shape))

    @property
    def size(self) -> int:
        return int(self._layout.size)

    def _axis(self, name: str) -> int:
        try:
            return self._names.index(name)
        except ValueError:
            raise ValueError(f"unknown axis {name!r}; axes are {self._names}") from None

    def get_axis_size(self, name: str) -> int:
        return int(self._layout.shape[self._axis(name)])

    # ---- rank <-> coordinates ---------------------------------------------------
    def get_worker_coords(self, rank: int) -> dict[str, int]:
        """Axis name -> index of ``rank`` along that axis."""
        try:
            coords = self._coords[int(rank)]
        except KeyError:
            raise ValueError(f"rank {rank} is not in a layout of size {self.size}") from None
        return dict(zip(self._names, coords))

    def get_ranks_by_coord(self, **coords: int) -> list[int]:
        """Ranks whose coordinates match every given ``axis=index`` (free axes vary), sorted."""
        index: list[int | slice] = [slice(None)] * self.ndim
        for name, value in coords.items():
            axis = self._axis(name)
            size = self._layout.shape[axis]
            if not 0 <= int(value) < size:
                raise ValueError(f"{name}={value} is out of range for an axis of size {size}")
            index[axis] = int(value)
        return sorted(int(r) for r in np.asarray(self._layout[tuple(index)]).reshape(-1))

    def get_rank(self, **coords: int) -> int:
        """The single rank at fully specified coordinates."""
        missing = [n for n in self._names if n not in coords]
        if missing:
            raise ValueError(f"get_rank needs every axis; missing {missing}")
        (rank,) = self.get_ranks_by_coord(**coords)
        return rank

    def groups_along(self, axes: Iterable[str]) -> list[list[int]]:
        """Partition all ranks into groups that differ only along ``axes``.

        Returned in a deterministic order (by the fixed coordinates of the other
        axes, row-major), so every process can create the same groups in the same
        order, as ``torch.distributed.new_group`` requires.
        """
        axes = list(axes)
        for a in axes:
            self._axis(a)
        fixed = [n for n in self._names if n not in axes]
        fixed_shape = [self.get_axis_size(n) for n in fixed]
        groups = []
        for idx in np.ndindex(*fixed_shape) if fixed_shape else [()]:
            groups.append(self.get_ranks_by_coord(**dict(zip(fixed, idx))))
        return groups

    @staticmethod
    def is_axis_zero(coords: dict[str, int], axes: Iterable[str]) -> bool:
        """True iff ``coords`` sits at index 0 along every axis in ``axes``."""
        return all(coords.get(a, 0) == 0 for a in axes)

    def __repr__(self) -> str:
        dims = ", ".join(f"{n}={s}" for n, s in zip(self._names, self._layout.shape))
        return f"NamedSharding({dims})"
