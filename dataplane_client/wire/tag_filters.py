"""A claim's ``where``: comparisons on numeric tag columns, joined by "and".

Declarative on purpose: what crosses the wire is data (``TagFilter`` triples),
never a pickled predicate, so the service evaluates it as vector operations on
its columns and a client cannot run code there. Accepted forms, all equal:

    where="reward_std > 0 and weight_version >= 3"
    where=[("reward_std", ">", 0), ("weight_version", ">=", 3)]
    where=[TagFilter("reward_std", ">", 0.0), ...]

A value is what the column is compared with as float64 (``staleness.matching``):
any real number float64 holds, inf included (it compares exactly). NaN (no row
ever matches it) and a number past float64's range (it would become inf, and
``x == 1e400`` would match an infinite tag) are refused. A string is at most
64 KiB.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Sequence
from typing import Any

from dataplane_client.wire.errors import InvalidBatch
from dataplane_client.wire.messages import TAG_FILTER_OPS, TagFilter

# The string is a client's and may be hostile: it is bounded, and each pattern fails in
# linear time. An "and" is tried only where a whitespace run starts (tried at every
# position inside a run, a split is quadratic in the run's length), and a number has one
# way to match its digits ("\d+\.?\d*" tried every split of a long digit run).
# Far more than any real filter (a few comparisons). A longer string is refused unread, in
# constant time: even parsed linearly, 1 MB takes some 0.2 s.
_MAX_TEXT = 1 << 16
_PAST_RANGE = "is beyond float64's range, as which the tag column compares it"
_AND = re.compile(r"(?<!\s)\s+and\s+")
_COMPARISON = re.compile(
    r"^\s*([A-Za-z_][A-Za-z0-9_.]*)\s*(<=|>=|==|!=|<|>)\s*"
    r"([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)\s*$"
)


def parse(where: Any) -> tuple[TagFilter, ...]:
    """``where`` in any accepted form as checked ``TagFilter``s; InvalidBatch naming the
    part that is wrong."""
    if where is None:
        return ()
    if isinstance(where, str):
        if len(where) > _MAX_TEXT:
            raise InvalidBatch(
                f"where is {len(where)} characters, more than {_MAX_TEXT}: give it as a few "
                "comparisons joined by 'and'"
            )
        return tuple(_parse_text(part) for part in _AND.split(where.strip()))
    if isinstance(where, (TagFilter, tuple)) and not _is_sequence_of_filters(where):
        where = [where]
    if isinstance(where, (bytes, bytearray)) or not isinstance(where, Sequence):
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
    tag, op, literal = match.groups()
    value = float(literal)
    if math.isinf(value):  # a literal never spells inf: float() overflowed
        raise InvalidBatch(f"where: {literal!r:.40} for tag {tag!r} {_PAST_RANGE}")
    return _checked((tag, op, value))


def _checked(item: Any) -> TagFilter:
    if isinstance(item, TagFilter):
        item = (item.tag, item.op, item.value)
    if not isinstance(item, (tuple, list)) or len(item) != 3:
        raise InvalidBatch(f"where: each comparison is (tag, op, value), got {_shown(item, 80)}")
    tag, op, value = item
    if not isinstance(tag, str) or not tag or not tag.isprintable() or not tag.isascii():
        raise InvalidBatch(
            f"where: a tag name must be a non-empty ASCII string, got {_shown(tag, 80)}"
        )
    # isinstance first: "in" compares with ==, which an array answers with an array.
    if not isinstance(op, str) or op not in TAG_FILTER_OPS:
        raise InvalidBatch(
            f"where: op {_shown(op, 20)} for tag {tag!r} is not one of {TAG_FILTER_OPS}"
        )
    return TagFilter(tag, op, _number(tag, value))


def _number(tag: str, value: Any) -> float:
    """``value`` as the float64 the column is compared with (see the module's docstring)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy's too
        raise InvalidBatch(
            f"where: the value for tag {tag!r} must be a number, got {_shown(value, 40)}"
        )
    try:
        number = float(value)
    except OverflowError:  # an int or Fraction past float64's range
        number = math.inf
    if math.isnan(number):
        raise InvalidBatch(f"where: the value for tag {tag!r} must be a number, got nan")
    if math.isinf(number) and number != value:  # inf only by overflow (a long double's too)
        raise InvalidBatch(f"where: the value for tag {tag!r} {_PAST_RANGE}")
    return number


def _shown(value: Any, width: int) -> str:
    """``repr(value)`` cut to ``width`` for a message, which must not fail itself: an int of
    more than 4300 digits has no repr (ValueError), and a user's class may raise anything."""
    try:
        return repr(value)[:width]
    except Exception:  # noqa: BLE001 - any failure to show it: named by its type instead
        return f"a {type(value).__name__}"
