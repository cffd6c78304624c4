"""Partial rollouts, the client's half: an ``append_tokens`` checked, then made a put.

A partial rollout is a sample whose per-token fields (token ids, generation
logprobs, masks: jagged rows) grow by segments, each generated under one policy
version. An append reads what the store holds of its samples (their segments, then
the rows of those in progress), joins the new tokens to the rows, and writes them
back whole with ``overwrite``, tagged with every segment so far, the fields they
cover and whether the sample is still generating (``wire.messages``' segment tags).
Both clients run these steps; the key space checks at commit that the segments it
holds are the ones the append read (``AppendConflict`` otherwise, and the client
reads again), so two appends never interleave (``dataplane_server.core.partial_rollouts``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dataplane_client.codec.prepare import PutArguments
from dataplane_client.codec.tensordict_io import as_field_mapping
from dataplane_client.wire import arguments
from dataplane_client.wire.errors import (
    FieldAlreadyProduced,
    InvalidBatch,
    SamplesNotFound,
    SchemaConflict,
    VersionRegression,
)
from dataplane_client.wire.messages import (
    IN_PROGRESS_TAG,
    PARTIAL_NOT_STORED,
    SEGMENTS_TAG,
    TOKEN_FIELDS_TAG,
)

# Reads of a sample raced by another append before one lands: then AppendConflict stands.
MAX_APPEND_TRIES = 8

_RESERVED_TAGS = (SEGMENTS_TAG, TOKEN_FIELDS_TAG, IN_PROGRESS_TAG)


@dataclass(frozen=True)
class AppendArguments:
    """An ``append_tokens`` call, checked: the new tokens' row of each field per sample."""

    sample_ids: list[str]
    partition_id: str
    rows: dict[str, list[torch.Tensor]]
    lengths: list[int]  # new tokens per sample (every field's row has as many)
    version: int
    tags: list[dict] | None
    finish: bool
    start: bool  # the samples' first segment: none of them may be stored yet


def _jagged_rows(name: str, value: Any, n: int, pid: str) -> list[torch.Tensor]:
    """A field's value as one >= 1-D tensor per sample; InvalidBatch naming the field when
    it is no jagged per-token field (a dense tensor, a non-tensor) or has another count."""
    if isinstance(value, torch.Tensor) and value.is_nested:
        rows = list(value.unbind())
    elif isinstance(value, (list, tuple)) and all(isinstance(r, torch.Tensor) for r in value):
        rows = list(value)
    else:
        raise InvalidBatch(
            f"append_tokens appends to jagged per-token fields (a torch.nested jagged tensor "
            f"or a list of 1-D tensors), got {type(value).__name__}",
            fields=[name],
            partition_id=pid,
        )
    if len(rows) != n or any(r.ndim < 1 for r in rows):
        raise InvalidBatch(
            f"append_tokens needs one >= 1-D row per sample ({n}), got {len(rows)} rows",
            fields=[name],
            partition_id=pid,
        )
    return rows


def append_arguments(
    sample_ids: Any,
    partition_id: Any,
    fields: Any,
    version: Any,
    tags: Any,
    finish: Any,
    start: Any,
) -> AppendArguments:
    """An append's arguments checked, each error naming its argument."""
    pid = arguments.partition_name(partition_id)
    ids = arguments.id_list(sample_ids, partition_id=pid)
    version = arguments.count(version, "version", minimum=0)
    finish = arguments.flag(finish, "finish")
    start = arguments.flag(start, "start")
    tag_list = arguments.tag_list(tags, len(ids), partition_id=pid)
    reserved = sorted({k for t in tag_list or () for k in t if k in _RESERVED_TAGS})
    if reserved:
        raise InvalidBatch(f"tags {reserved} are the store's (append_tokens writes them)")
    mapping = as_field_mapping(fields)
    names = arguments.name_list(list(mapping), "fields")
    rows = {name: _jagged_rows(name, mapping[name], len(ids), pid) for name in names}
    per_field = {name: [int(r.shape[0]) for r in got] for name, got in rows.items()}
    lengths = per_field[names[0]]
    uneven = sorted(name for name, n in per_field.items() if n != lengths)
    if uneven:
        raise InvalidBatch(
            f"per-token fields must have as many tokens per sample as {names[0]!r}",
            fields=uneven,
            partition_id=pid,
        )
    return AppendArguments(ids, pid, rows, lengths, version, tag_list, finish, start)


def stored_ids(args: AppendArguments, held: Sequence[list | None]) -> list[str]:
    """The samples whose rows the append joins to: every one (the store holds them in
    progress), or none when the append starts them. SamplesNotFound naming the samples a
    later segment finds gone (never started, or cleared, dropped as stale or evicted);
    FieldAlreadyProduced naming those a start finds stored."""
    stored = [sid for sid, h in zip(args.sample_ids, held) if h is not None]
    if args.start and stored:
        raise FieldAlreadyProduced(
            "a partial rollout of these samples is stored already (start=True begins one)",
            ids=stored,
            partition_id=args.partition_id,
        )
    gone = [sid for sid, h in zip(args.sample_ids, held) if h is None]
    if not args.start and gone:
        raise SamplesNotFound(PARTIAL_NOT_STORED, ids=gone, partition_id=args.partition_id)
    return stored


def appended_put(args: AppendArguments, held: Sequence[list | None], stored: Any) -> PutArguments:
    """The put that makes the append. ``held``: per sample, [segments, token fields] the
    store holds (None: the append starts the sample); ``stored``: the rows of the held
    samples (a TensorDict or mapping of jagged fields, in ``stored_ids`` order)."""
    pid = args.partition_id
    joined: dict[str, list[torch.Tensor]] = {name: [] for name in args.rows}
    before = (
        {name: list(stored[name].unbind()) for name in args.rows} if stored_ids(args, held) else {}
    )
    tags, versions = [], []
    k = 0  # the sample's index among the held ones
    for i, sid in enumerate(args.sample_ids):
        segments, _fields = held[i] or ([], None)
        if segments and args.version < segments[-1][0]:
            raise VersionRegression(
                f"segment version {args.version} is below the sample's last segment's, "
                f"{segments[-1][0]}",
                ids=[sid],
                partition_id=pid,
            )
        for name, rows in args.rows.items():
            new = rows[i]
            if segments:
                old = before[name][k]
                if old.dtype != new.dtype or old.shape[1:] != new.shape[1:]:
                    raise SchemaConflict(
                        f"stored rows are {old.dtype} {tuple(old.shape[1:])}, the append's "
                        f"{new.dtype} {tuple(new.shape[1:])}",
                        ids=[sid],
                        fields=[name],
                        partition_id=pid,
                    )
                new = torch.cat([old, new.to(old.device)])
            joined[name].append(new)
        k += bool(segments)
        segments = [*segments, [args.version, args.lengths[i]]]
        tag = dict(args.tags[i]) if args.tags else {}
        tag.update(
            {
                SEGMENTS_TAG: segments,
                TOKEN_FIELDS_TAG: sorted(args.rows),
                IN_PROGRESS_TAG: not args.finish,
            }
        )
        tags.append(tag)
        versions.append(segments[0][0])  # its staleness: its oldest segment's version
    return PutArguments(args.sample_ids, pid, joined, tags, True, versions)
