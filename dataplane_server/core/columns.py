"""Small helpers shared by the controller's and the units' columnar metadata."""

from __future__ import annotations

import functools
import inspect

import numpy as np

from dataplane_client.errors import DataPlaneError

GROWTH = 1.5


def grown(arr: np.ndarray, n: int, fill) -> np.ndarray:
    """``arr`` with room for at least ``n`` entries (geometric growth, new slots = ``fill``)."""
    if len(arr) >= n:
        return arr
    new = np.full(max(n, int(len(arr) * GROWTH) + 64), fill, dtype=arr.dtype)
    new[: len(arr)] = arr
    return new


def counts_errors(method):
    """Count every typed error a method raises in ``self.stats`` (by class), then re-raise."""
    if inspect.iscoroutinefunction(method):

        @functools.wraps(method)
        async def async_wrapper(self, *args, **kwargs):
            try:
                return await method(self, *args, **kwargs)
            except DataPlaneError as e:
                self.stats.error(e)
                raise

        return async_wrapper

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except DataPlaneError as e:
            self.stats.error(e)
            raise

    return wrapper
