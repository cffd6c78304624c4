"""Opt-in bookkeeping of what crossed a boundary, for tests and the demo.

Off by default: with no recorder the data path computes nothing for it (no
digest of the fetched bytes, no list that grows with every step). Switched on,
a recorder keeps only the last ``keep_last`` entries, so a long run cannot grow
it without bound.

- :class:`IORecorder` (a worker rank): one entry per fetch and write-back;
- :class:`DispatchRecorder` (the driver): per dispatch, the per-rank metas it
  shipped and the per-rank results it received.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch


def batch_digest(data: Mapping[str, Any]) -> str:
    """sha256 over every field's name, dtype, shape and bytes (plus microbatch metadata)."""
    h = hashlib.sha256()
    for key in sorted(data):
        value = data[key]
        h.update(key.encode())
        if isinstance(value, torch.Tensor):
            parts = (
                # offsets(): jagged nested tensors only, absent from torch's Tensor stubs
                [value.values(), value.offsets()]  # type: ignore[attr-defined]
                if value.is_nested
                else [value]
            )
            for t in parts:
                t = t.detach().cpu().contiguous()
                h.update(f"{t.dtype}{tuple(t.shape)}".encode())
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(value).encode())
    for attr in ("micro_batch_indices", "micro_batch_lengths", "elem_counts_per_gb"):
        h.update(repr(getattr(data, attr, None)).encode())
    return h.hexdigest()


def tensor_nbytes(data: Mapping[str, Any]) -> int:
    """Bytes held by the tensors of ``data`` (a jagged tensor: its values and offsets)."""
    total = 0
    for value in data.values():
        if isinstance(value, torch.Tensor):
            parts = (
                # offsets(): jagged nested tensors only, absent from torch's Tensor stubs
                [value.values(), value.offsets()]  # type: ignore[attr-defined]
                if value.is_nested
                else [value]
            )
            total += sum(t.numel() * t.element_size() for t in parts)
    return total


def _check_keep_last(keep_last: int) -> int:
    if not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1:
        raise ValueError(f"keep_last must be an int >= 1, got {keep_last!r}")
    return keep_last


class IORecorder:
    """A worker rank's fetches and write-backs, the last ``keep_last`` of them.

    Each entry is a small dict: ``op`` ("fetch" / "write"), ``partition_id``,
    ``sample_ids``, ``fields``, ``nbytes`` (bytes of the tensors fetched, or
    handed to the write-back), and for fetches ``policy`` and, with
    ``digests=True``, ``digest`` (sha256 of the batch; about 2.5 ms per MiB,
    which is why it is a separate switch).
    """

    def __init__(self, keep_last: int = 256, *, digests: bool = True):
        self.digests = bool(digests)
        self._entries: deque[dict[str, Any]] = deque(maxlen=_check_keep_last(keep_last))

    def fetched(self, meta: Any, data: Mapping[str, Any], policy: str) -> None:
        entry = self._entry("fetch", meta, data, policy=policy)
        if self.digests:
            entry["digest"] = batch_digest(data)
        self._entries.append(entry)

    def wrote(self, meta: Any, fields: Mapping[str, Any]) -> None:
        self._entries.append(self._entry("write", meta, fields))

    @staticmethod
    def _entry(op: str, meta: Any, data: Mapping[str, Any], **info: Any) -> dict[str, Any]:
        return {
            "op": op,
            "partition_id": meta.partition_id,
            "sample_ids": list(meta.sample_ids),
            "fields": sorted(data.keys()),
            "nbytes": tensor_nbytes(data),
            **info,
        }

    def entries(self) -> list[dict[str, Any]]:
        return list(self._entries)

    def clear(self) -> None:
        self._entries.clear()


class DispatchRecorder:
    """What a driver shipped and received on the data-plane path, the last ``keep_last`` dispatches.

    ``shipped[i]`` is dispatch i's list of per-rank metas, ``received[i]`` the
    per-rank results it deserialized (oldest first).
    """

    def __init__(self, keep_last: int = 64):
        keep_last = _check_keep_last(keep_last)
        self._shipped: deque[list[Any]] = deque(maxlen=keep_last)
        self._received: deque[list[Any]] = deque(maxlen=keep_last)

    def dispatched(self, metas: list[Any], results: list[Any]) -> None:
        self._shipped.append(list(metas))
        self._received.append(list(results))

    @property
    def shipped(self) -> list[list[Any]]:
        return list(self._shipped)

    @property
    def received(self) -> list[list[Any]]:
        return list(self._received)

    def clear(self) -> None:
        self._shipped.clear()
        self._received.clear()
