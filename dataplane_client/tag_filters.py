"""A claim's ``where``: comparisons on numeric tag columns, joined by "and".

Declarative on purpose: what crosses the wire is data (``TagFilter`` triples),
never a pickled predicate, so the service evaluates it as vector operations on
its columns and a client cannot run code there. Accepted forms, all equal:

    where="reward_std > 0 and weight_version >= 3"
    where=[("reward_std", ">", 0), ("weight_version", ">=", 3)]
    where=[TagFilter("reward_std", ">", 0.0), ...]
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from dataplane_client.errors import InvalidBatch
from dataplane_client.messages import TAG_FILTER_OPS, TagFilter

_COMPARISON = re.compile(
    r"^\s*([A-Za-z_][A-Za-z0-9_.]*)\s*(<=|>=|==|!=|<|>)\s*"
    r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$"
)


def parse(where: Any) -> tuple[TagFilter, ...]:
    """``where`` in any accepted form as checked ``TagFilter``s; InvalidBatch naming the
    part that is wrong."""
    if where is None:
        return ()
    if isinstance(where, str):
        return tuple(_parse_text(part) for part in re.split(r"\s+and\s+", where.strip()))
    if isinstance(where, (TagFilter, tuple)) and not _is_sequence_of_filters(where):
        where = [where]
    if not isinstance(where, Sequence):
        raise InvalidBatch(
            f"where must be a string like 'reward_std > 0' or a list of (tag, op, value), "
            f"got {type(where).__name__}"
        )
    return tuple(_checked(item) for item in where)


def _is_sequence_of_filters(value: Any) -> bool:
    return isinstance(value, tuple) and all(isinstance(v, (tuple, list, TagFilter)) for v in value)


def _parse_text(text: str) -> TagFilter:
    match = _COMPARISON.match(text)
    if match is None:
        raise InvalidBatch(
            f"where: cannot read {text!r:.80}; each comparison is 'tag op number' with op "
            f"one of {' '.join(TAG_FILTER_OPS)}, joined by 'and'"
        )
    tag, op, value = match.groups()
    return _checked((tag, op, float(value)))


def _checked(item: Any) -> TagFilter:
    if isinstance(item, TagFilter):
        item = (item.tag, item.op, item.value)
    if not isinstance(item, (tuple, list)) or len(item) != 3:
        raise InvalidBatch(f"where: each comparison is (tag, op, value), got {item!r:.80}")
    tag, op, value = item
    if not isinstance(tag, str) or not tag or not tag.isprintable() or not tag.isascii():
        raise InvalidBatch(f"where: a tag name must be a non-empty ASCII string, got {tag!r:.80}")
    if op not in TAG_FILTER_OPS:
        raise InvalidBatch(f"where: op {op!r:.20} for tag {tag!r} is not one of {TAG_FILTER_OPS}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise InvalidBatch(f"where: the value for tag {tag!r} must be a number, got {value!r:.40}")
    return TagFilter(tag, op, float(value))
