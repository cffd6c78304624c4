"""Partial rollouts, the key space's half: samples whose per-token fields grow by segments.

``append_tokens`` (the client's half is ``dataplane_client.codec.appends``) writes a
sample's jagged per-token fields whole, joined client-side from what the store held
and the new tokens, tagged with every segment so far (``SEGMENTS_TAG``: [[policy
version, tokens], ...], oldest first), the fields the segments cover
(``TOKEN_FIELDS_TAG``) and whether it is still generating (``IN_PROGRESS_TAG``).
The tags travel with the sample to its unit like any tag, so a restarted controller
and a restored checkpoint rebuild a partial rollout from its unit, segments and all.

The rules, checked here when the commit is checked (nothing is published before):

- an append extends exactly the segments the store holds (``AppendConflict``
  otherwise: another append went first; the client reads again), with a version no
  lower than the last segment's (``VersionRegression``), the fields the first
  segment named (``InvalidBatch``), all jagged (``InvalidBatch``);
- a finished sample, or one put whole by ``put_samples``, takes no append
  (``RolloutFinished``); a later segment of a sample the store no longer holds
  (cleared, dropped as stale, evicted) is ``SamplesNotFound``.

A sample in progress is never claimable (``KeySpace._ready``), but is live and
untrained, so admission counts it. Its version for the staleness window is its
oldest segment's (the version tag is that segment's): a rollout resumed across many
updates ages from its first token. In progress it is neither dropped as stale nor
evicted (``KeySpace.stale_rows``, ``evictable_rows``): its producer still appends to
it; finished, it is judged like any sample.
"""

from __future__ import annotations

import numbers
from typing import Any, Protocol

import numpy as np

from dataplane_client.wire.encoded import JAGGED
from dataplane_client.wire.errors import (
    AppendConflict,
    InvalidBatch,
    RolloutFinished,
    SamplesNotFound,
    VersionRegression,
)
from dataplane_client.wire.messages import (
    IN_PROGRESS_TAG,
    PARTIAL_NOT_STORED,
    SEGMENTS_TAG,
    TOKEN_FIELDS_TAG,
    CommitRequest,
)


class Partition(Protocol):
    """What this module reads and writes of a key-space partition (``keyspace.Partition``)."""

    partition_id: str
    tags: list[dict | None]
    live: np.ndarray
    in_progress: np.ndarray
    seq_len: np.ndarray
    n_rows: int

    def rows_of(self, sample_ids: list[str]) -> np.ndarray: ...


FINISHED_MESSAGE = "no partial rollout in progress (finished, or put whole by put_samples)"


def held(part: Partition, sample_ids: list[str]) -> list[list | None]:
    """What an append of these samples reads first: per sample, [its segments, its token
    fields] while it is in progress, None when the partition does not hold it (the
    append starts it); RolloutFinished naming the samples that take no append."""
    rows = part.rows_of(sample_ids)
    finished = [s for s, r in zip(sample_ids, rows.tolist()) if r >= 0 and not part.in_progress[r]]
    if finished:
        raise RolloutFinished(FINISHED_MESSAGE, ids=finished, partition_id=part.partition_id)
    out: list[list | None] = []
    for r in rows.tolist():
        tag = (part.tags[r] or {}) if r >= 0 else None
        out.append(None if tag is None else [tag[SEGMENTS_TAG], tag[TOKEN_FIELDS_TAG]])
    return out


def _count(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) and int(x) >= 0


def _segments(value: Any, sid: str, pid: str) -> list[list[int]]:
    """A commit's segments tag, checked: a non-empty list of [version, tokens] pairs of
    non-negative ints."""
    ok = isinstance(value, list) and bool(value)
    for seg in value if ok else ():
        ok = ok and isinstance(seg, list) and len(seg) == 2 and all(map(_count, seg))
    if not ok:
        raise InvalidBatch(
            f"tag {SEGMENTS_TAG!r} is the store's (append_tokens writes it): a list of "
            f"[version, tokens] pairs, got {value!r:.80}",
            ids=[sid],
            partition_id=pid,
        )
    return value


def check_appends(part: Partition, req: CommitRequest, rows: np.ndarray) -> int:
    """The rules above for the commit's appends (samples tagged with segments); returns
    the tokens it resumes: those already stored of samples whose new segment's version
    is newer than their last one (kept across a weight update, not regenerated)."""
    tags = req.tags or ()
    appends = [i for i, t in enumerate(tags) if t and SEGMENTS_TAG in t]
    if not appends:
        return 0
    pid = part.partition_id
    dense = sorted(name for name, schema in req.schemas.items() if schema[0] != JAGGED)
    if dense:
        raise InvalidBatch(
            "append_tokens appends to jagged per-token fields only", fields=dense, partition_id=pid
        )
    resumed = 0
    for i in appends:
        sid, row, tag = req.sample_ids[i], int(rows[i]), tags[i]
        segments = _segments(tag[SEGMENTS_TAG], sid, pid)
        if row < 0:
            if len(segments) > 1:
                raise SamplesNotFound(PARTIAL_NOT_STORED, ids=[sid], partition_id=pid)
            continue
        now = part.tags[row] or {}
        if not part.in_progress[row]:
            raise RolloutFinished(FINISHED_MESSAGE, ids=[sid], partition_id=pid)
        if segments[:-1] != now[SEGMENTS_TAG]:
            raise AppendConflict(
                "another append to the sample went first", ids=[sid], partition_id=pid
            )
        last, new = now[SEGMENTS_TAG][-1][0], segments[-1][0]
        if new < last:
            raise VersionRegression(
                f"segment version {new} is below the sample's last segment's, {last}",
                ids=[sid],
                partition_id=pid,
            )
        if sorted(req.schemas) != sorted(now[TOKEN_FIELDS_TAG]):
            raise InvalidBatch(
                f"an append writes the fields its first segment did: {now[TOKEN_FIELDS_TAG]}",
                ids=[sid],
                fields=sorted(req.schemas),
                partition_id=pid,
            )
        if new > last:
            resumed += sum(n for _, n in now[SEGMENTS_TAG])
    return resumed


def merge(part: Partition, row: int, tag: dict) -> None:
    """A committed (or rebuilt) tag's partial-rollout state into the row's columns: in
    progress or not, and its sequence length, every segment's tokens."""
    if IN_PROGRESS_TAG in tag:
        part.in_progress[row] = bool(tag[IN_PROGRESS_TAG])
    if SEGMENTS_TAG in tag:
        part.seq_len[row] = sum(n for _, n in tag[SEGMENTS_TAG])


def in_progress(part: Partition) -> int:
    """Live samples of the partition being generated (appended to, not finished)."""
    n = part.n_rows
    return int((part.live[:n] & part.in_progress[:n]).sum())
