"""Growing the columns of the controller's and the units' metadata."""

from __future__ import annotations

import numpy as np

GROWTH = 1.5


def grown(arr: np.ndarray, n: int, fill) -> np.ndarray:
    """``arr`` with room for at least ``n`` entries (geometric growth, new slots = ``fill``)."""
    if len(arr) >= n:
        return arr
    new = np.full(max(n, int(len(arr) * GROWTH) + 64), fill, dtype=arr.dtype)
    new[: len(arr)] = arr
    return new
