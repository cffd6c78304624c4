"""Enum fields: a column of strings from a fixed vocabulary travels as int32 codes.

The vocabulary is declared once, at registration; every put maps strings to
their positions in it and every read maps positions back. On the wire and in
the units an enum field is an ordinary dense ``int32`` field. Both directions
are one pass over the column (a dict lookup per row; numpy indexing back).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from dataplane_client.wire.errors import CorruptPayload, InvalidBatch

if TYPE_CHECKING:  # torch is imported where a column is made: the controller checks
    import torch  # vocabularies only, and starts (and restarts) without torch


def vocabulary(name: str, words: Any) -> tuple[str, ...]:
    """``words`` checked as an enum vocabulary: a non-empty sequence of distinct str."""
    if isinstance(words, (str, bytes)) or not isinstance(words, Sequence) or not words:
        raise InvalidBatch(
            f"enum vocabulary must be a non-empty list of str, got {words!r}", fields=[name]
        )
    bad = [w for w in words if not isinstance(w, str)]
    if bad:
        raise InvalidBatch(f"enum vocabulary holds non-str entries {bad[:5]!r}", fields=[name])
    if len(set(words)) != len(words):
        raise InvalidBatch("enum vocabulary repeats entries", fields=[name])
    return tuple(words)


def to_codes(name: str, values: Sequence[Any], vocab: Sequence[str]) -> torch.Tensor:
    """int32 positions of ``values`` in ``vocab``; a value outside it is InvalidBatch naming it."""
    strays = [v for v in values if not isinstance(v, str)]
    if strays:
        raise InvalidBatch(
            f"enum field takes str values, got {type(strays[0]).__name__} {strays[0]!r}",
            fields=[name],
        )
    index = {w: i for i, w in enumerate(vocab)}
    codes = np.array([index.get(v, -1) for v in values], dtype=np.int32)
    unknown = np.nonzero(codes < 0)[0]
    if len(unknown):
        raise InvalidBatch(
            f"enum value {values[int(unknown[0])]!r} is not in the vocabulary {list(vocab)[:20]}",
            fields=[name],
        )
    import torch

    return torch.from_numpy(codes)


def to_strings(name: str, codes: torch.Tensor, vocab: Sequence[str]) -> list[str]:
    """The vocabulary entries at ``codes`` (CorruptPayload when a code is out of range)."""
    positions = codes.reshape(-1).cpu().numpy().astype(np.int64)  # codes read to a GPU too
    if len(positions) and (positions.min() < 0 or positions.max() >= len(vocab)):
        raise CorruptPayload(
            f"enum codes outside a vocabulary of {len(vocab)} entries", fields=[name]
        )
    return np.asarray(vocab, dtype=object)[positions].tolist()
