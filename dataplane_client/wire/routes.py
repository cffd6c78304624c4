"""Route hints: which unit holds a sample's bytes, and which generation of them.

A generation is the seq of the commit that last wrote a sample's bytes (the
controller numbers commits; each unit stamps the rows it publishes with it). A
reader that knows a sample's (unit, generation) may read it straight from the
unit, skipping the controller's ``locate``: the unit serves the rows only while
it holds each at the generation named (``RouteChanged`` otherwise), and the
reader then falls back to ``locate``. Hints come from a claim's answer (in
``meta.extra_info[ROUTES_KEY]``, so they travel with the meta to whichever
process reads it) and from the client's own puts and gets (its route cache).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dataplane_client.wire.errors import InvalidBatch

ROUTES_KEY = "dataplane_routes"  # the meta's extra_info key a claim's hints ride under


def route_hints(
    codecs_key: str, sample_ids: Sequence[str], units: np.ndarray, generations: np.ndarray
) -> dict[str, Any]:
    """A claim's hints: per sample (unit, generation), and the codecs its rows were written
    with. Rows of unknown generation (-1: rebuilt after a controller restart) get none."""
    known = np.asarray(generations) >= 0
    rows = zip(
        (s for s, k in zip(sample_ids, known.tolist()) if k),
        zip(np.asarray(units)[known].tolist(), np.asarray(generations)[known].tolist()),
    )
    return {"codecs_key": codecs_key, "rows": dict(rows)}


def hinted(
    extra_info: Mapping[str, Any], sample_ids: Sequence[str]
) -> tuple[str, np.ndarray, np.ndarray] | None:
    """(codecs key, unit per sample, generation per sample) from a meta's hints when they
    name every sample; None when there are none or some sample has none (a meta built by
    hand, subset and concatenated with others, or from rows rebuilt after a restart).
    InvalidBatch when the key holds something that is not hints."""
    hints = extra_info.get(ROUTES_KEY)
    if hints is None:
        return None
    rows = hints.get("rows") if isinstance(hints, Mapping) else None
    key = hints.get("codecs_key") if isinstance(hints, Mapping) else None
    if not isinstance(rows, Mapping) or not isinstance(key, str):
        raise InvalidBatch(
            f"meta.extra_info[{ROUTES_KEY!r}] holds route hints made by claim_meta "
            f"({{'codecs_key': str, 'rows': {{sample_id: (unit, generation)}}}}), "
            f"got {type(hints).__name__}; drop the key to read through the controller"
        )
    found = [rows.get(s) for s in sample_ids]
    if any(f is None for f in found):
        return None
    try:
        pairs = np.asarray(found, dtype=np.int64).reshape(len(found), 2)
    except (TypeError, ValueError):
        raise InvalidBatch(
            f"meta.extra_info[{ROUTES_KEY!r}]['rows'] must map each sample id to "
            "(unit, generation) integers"
        ) from None
    return key, pairs[:, 0], pairs[:, 1]


class DirectReadBackoff:
    """Per partition, how many of a client's next gets skip direct reads by cached routes.

    A reader that re-reads ids other processes keep rewriting finds its cached routes
    stale every time, and each such get is a refused direct read, then ``locate``, then
    the read: three round trips where ``locate`` and the read alone are two. After a
    refusal the partition's next gets go to ``locate`` at once: 1, then 2, 4 ... up to
    ``MAX_SKIPPED`` of them, doubling with each refusal in a row; a direct read served
    resets it. Only cached routes are skipped: a claim's hints are fresh, always tried.
    Shared by a client's threads without a lock: a lost update only moves when the next
    direct read is tried, never what a read returns.
    """

    MAX_SKIPPED = 64

    def __init__(self) -> None:
        self._left: dict[str, int] = {}  # partition -> gets still to skip direct reads
        self._next: dict[str, int] = {}  # partition -> how many the next refusal skips

    def try_direct(self, partition_id: str) -> bool:
        """Whether this get may try its cached routes (counts a skipped one)."""
        left = self._left.get(partition_id, 0)
        if left <= 0:
            return True
        self._left[partition_id] = left - 1
        return False

    def refused(self, partition_id: str) -> None:
        skip = self._next.get(partition_id, 1)
        self._left[partition_id] = skip
        self._next[partition_id] = min(2 * skip, self.MAX_SKIPPED)

    def served(self, partition_id: str) -> None:
        self._left.pop(partition_id, None)
        self._next.pop(partition_id, None)
