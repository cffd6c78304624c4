"""Turn a fetched batch (the data-plane wire layout) into a BatchedDataDict.

The client returns dense fields as tensors ``[N, ...]``, jagged fields as
``torch.nested`` jagged tensors (or lists of tensors whose first dim varies),
and small non-tensor fields as Python lists. A model wants rectangles:

- ``layout="padded"``: each jagged field becomes a right-padded dense tensor
  ``[N, L, ...]`` with ``L = max(longest row, pad_to_seqlen)``, padded with
  ``pad_value_dict.get(field, 0)``, dtype and device preserved. ``pad_to_seqlen``
  is a lower bound (the driver's global forward pad length, so every DP rank
  pads to the same shape); a value below the longest row never truncates,
  the longest row wins.
- ``layout="jagged"``: jagged fields stay (or become) ``torch.nested`` jagged
  tensors; ``pad_to_seqlen`` does not apply.

Dense tensors and lists of non-tensors pass through unchanged in both layouts.
The batch may be a TensorDict (what ``get_data`` returns), a dict or a
BatchedDataDict; a TensorDict's string and object columns arrive as lists.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dataplane_client.batching.batched_data_dict import BatchedDataDict, jagged_values_offsets
from dataplane_client.batching.padded_rows import pad_rows
from dataplane_client.codec.tensordict_io import as_field_mapping
from dataplane_client.wire.errors import InvalidBatch

LAYOUTS = ("padded", "jagged")


def _jagged_from_list(name: str, rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, offsets) of a list of tensors that differ only in their first dim."""
    if not rows:
        raise InvalidBatch("an empty list of tensors has no dtype", fields=[name])
    first = rows[0]
    for i, r in enumerate(rows):
        if r.dim() == 0:
            raise InvalidBatch(f"row {i} is a 0-d tensor; jagged rows need a length", fields=[name])
        if r.dtype != first.dtype or r.shape[1:] != first.shape[1:]:
            raise InvalidBatch(
                f"row {i} has dtype {r.dtype} and trailing shape {tuple(r.shape[1:])}, row 0 has "
                f"{first.dtype} and {tuple(first.shape[1:])}; only the first dim may vary",
                fields=[name],
            )
    lengths = torch.tensor([r.size(0) for r in rows], dtype=torch.long)
    offsets = torch.zeros(len(rows) + 1, dtype=torch.long)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return torch.cat(rows), offsets


def _pad(values: torch.Tensor, offsets: torch.Tensor, pad_value: Any, min_len: int) -> torch.Tensor:
    """Scatter jagged rows into a right-padded ``[N, L, ...]`` tensor."""
    offsets = offsets.to(dtype=torch.long).cpu()
    lengths = offsets[1:] - offsets[:-1]
    longest = int(lengths.max()) if lengths.numel() else 0
    rows = values[int(offsets[0]) : int(offsets[-1])] if lengths.numel() else values[:0]
    return pad_rows(rows, lengths, max(longest, min_len), pad_value)


def materialize(
    batch: Any,
    layout: str = "padded",
    pad_value_dict: Mapping[str, Any] | None = None,
    pad_to_seqlen: int = 0,
) -> BatchedDataDict:
    """A BatchedDataDict of ``batch`` in the requested ``layout`` (see the module docstring).

    Every field must hold the same number of samples. Raises InvalidBatch for
    an unknown layout, a negative ``pad_to_seqlen``, mismatched sample counts,
    or a list mixing tensors and other values.

    >>> import torch
    >>> ids = torch.nested.nested_tensor([torch.tensor([1, 2, 3]), torch.tensor([4])],
    ...                                  layout=torch.jagged)
    >>> out = materialize({"input_ids": ids, "input_lengths": torch.tensor([3, 1])},
    ...                   pad_value_dict={"input_ids": -1}, pad_to_seqlen=4)
    >>> out["input_ids"]
    tensor([[ 1,  2,  3, -1],
            [ 4, -1, -1, -1]])
    """
    if layout not in LAYOUTS:
        raise InvalidBatch(f"unknown layout {layout!r}; expected one of {list(LAYOUTS)}")
    if isinstance(pad_to_seqlen, bool) or not isinstance(pad_to_seqlen, int) or pad_to_seqlen < 0:
        raise InvalidBatch(f"pad_to_seqlen must be an int >= 0, got {pad_to_seqlen!r}")
    batch = as_field_mapping(batch)
    pad_value_dict = dict(pad_value_dict or {})

    out: BatchedDataDict[dict[str, Any]] = BatchedDataDict()
    sizes: dict[str, int] = {}
    for name, value in batch.items():
        if isinstance(value, torch.Tensor) and value.is_nested:
            sizes[name] = value.size(0)
            if layout == "jagged":
                out[name] = value
            else:
                values, offsets = jagged_values_offsets(value)
                out[name] = _pad(values, offsets, pad_value_dict.get(name, 0), pad_to_seqlen)
        elif isinstance(value, torch.Tensor):
            if value.dim() == 0:
                raise InvalidBatch("a 0-d tensor has no sample dimension", fields=[name])
            sizes[name] = value.size(0)
            out[name] = value
        elif isinstance(value, (list, tuple)):
            sizes[name] = len(value)
            n_tensors = sum(isinstance(x, torch.Tensor) for x in value)
            if n_tensors == 0:
                out[name] = list(value)
                continue
            if n_tensors != len(value):
                raise InvalidBatch("a list mixes tensors and other values", fields=[name])
            values, offsets = _jagged_from_list(name, list(value))
            if layout == "jagged":
                out[name] = torch.nested.nested_tensor_from_jagged(values, offsets)
            else:
                out[name] = _pad(values, offsets, pad_value_dict.get(name, 0), pad_to_seqlen)
        else:
            raise InvalidBatch(
                f"unsupported field type {type(value).__name__}; expected a tensor, a nested "
                "tensor or a list",
                fields=[name],
            )
    if len(set(sizes.values())) > 1:
        raise InvalidBatch(f"fields hold different numbers of samples: {sizes}", fields=list(sizes))
    return out
