"""Commits in flight (checked, being published, not yet applied), indexed by sample.

A commit is checked against every other commit of its partition in flight: a
sample one of them is creating goes to the same unit, and a cell one of them
is writing is refused (``KeySpace.check_commit``). With thousands of writers
committing at once, comparing each commit with every other one costs the
controller time quadratic in the writers; looking its samples up here costs
time linear in its own samples.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any


class SamplesInFlight:
    def __init__(self) -> None:
        # partition -> sample -> plans in flight writing it, oldest first
        self._by_sample: dict[str, dict[str, list[Any]]] = {}

    def add(self, partition_id: str, sample_ids: Sequence[str], plan: Any) -> None:
        index = self._by_sample.setdefault(partition_id, {})
        for s in sample_ids:
            plans = index.get(s)
            if plans is None:
                index[s] = [plan]
            else:
                plans.append(plan)

    def remove(self, partition_id: str, sample_ids: Sequence[str], plan: Any) -> None:
        index = self._by_sample.get(partition_id)
        if index is None:
            return
        for s in sample_ids:
            plans = index.get(s)
            if plans is None or plan not in plans:
                continue
            if len(plans) == 1:
                del index[s]
            else:
                plans.remove(plan)
        if not index:
            del self._by_sample[partition_id]

    def sharing(self, partition_id: str, sample_ids: Sequence[str]) -> Iterator[tuple[int, Any]]:
        """(position in ``sample_ids``, plan) for each plan in flight writing that sample,
        oldest plan first per sample."""
        index = self._by_sample.get(partition_id)
        if not index:
            return
        for i, s in enumerate(sample_ids):
            for plan in index.get(s, ()):
                yield i, plan
