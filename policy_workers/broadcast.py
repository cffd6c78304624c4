"""Two-phase broadcast of a BatchedDataDict inside a replica group.

Phase 1 ships a small descriptor with ``broadcast_object_list``: for every key
its kind and, for tensors, dtype and shape. Plain Python values (str, int,
float, bool, None, and lists / tuples / dicts of them: per-sample strings,
scalars a host stored) ride in the descriptor itself; they are small. Phase 2
ships each tensor's bytes with ``dist.broadcast`` on the communication device
(CPU for gloo, the current GPU for NCCL). Tensor payloads are never pickled:
a tensor inside a list is refused, not smuggled through the descriptor.

Every tensor travels as its raw bytes (a flat ``uint8`` view), so any dtype
(bf16, bool, int64, ...) arrives bit-identical on every backend without
per-dtype special cases. Jagged (``torch.nested``) tensors travel as their
values and offsets.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dataplane_client.batching.batched_data_dict import BatchedDataDict
from dataplane_client.wire.errors import InvalidBatch, NonTensorField

# BatchedDataDict attributes that travel with the data (small python values).
_ATTRS = ("micro_batch_indices", "micro_batch_lengths", "elem_counts_per_gb")
_SCALARS = (str, int, float, bool, type(None))


def _is_plain(value: Any) -> bool:
    """A value that may travel pickled in the descriptor: scalars and containers of them."""
    if isinstance(value, _SCALARS):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, _SCALARS) and _is_plain(v) for k, v in value.items())
    return False


def comm_device(group: Any) -> torch.device:
    """The device ``dist.broadcast`` needs for ``group``'s backend."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _send_or_recv_bytes(
    tensor: torch.Tensor | None,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    *,
    src: int,
    group: Any,
    device: torch.device,
) -> torch.Tensor:
    """Broadcast one dense tensor's bytes; the leader passes it, the others pass None."""
    if tensor is None:
        tensor = torch.empty(shape, dtype=dtype, device=device)
    else:
        tensor = tensor.to(device).contiguous()
    if tensor.numel() > 0:
        dist.broadcast(tensor.reshape(-1).view(torch.uint8), src=src, group=group)
    return tensor


def _describe(data: BatchedDataDict) -> dict[str, Any]:
    # (key, "nested", (dtype, shape), (dtype, shape)) | (key, "tensor", dtype, shape)
    # | (key, "plain", value)
    entries: list[tuple[Any, ...]] = []
    for key, value in data.items():
        if isinstance(value, torch.Tensor) and value.is_nested:
            # offsets(): jagged nested tensors only, absent from torch's Tensor stubs
            values, offsets = value.values(), value.offsets()  # type: ignore[attr-defined]
            entries.append(
                (
                    key,
                    "nested",
                    (values.dtype, tuple(values.shape)),
                    (offsets.dtype, tuple(offsets.shape)),
                )
            )
        elif isinstance(value, torch.Tensor):
            entries.append((key, "tensor", value.dtype, tuple(value.shape)))
        elif _is_plain(value):
            entries.append((key, "plain", value))
        else:
            raise NonTensorField(
                f"cannot broadcast a value of type {type(value).__name__}: a field holds a "
                "tensor, a jagged nested tensor, or plain Python values (str, int, float, "
                "bool, None, and lists / tuples / dicts of them; a tensor inside a list "
                "must become a nested tensor first)",
                fields=[key],
            )
    attrs = {a: getattr(data, a, None) for a in _ATTRS}
    return {"entries": entries, "attrs": attrs}


def broadcast_batched_data_dict(
    data: BatchedDataDict | None, *, is_leader: bool, src: int, group: Any
) -> BatchedDataDict:
    """Broadcast ``data`` from global rank ``src`` to every rank of ``group``.

    The leader passes its BatchedDataDict; the others pass ``None``. Every rank
    (leader included) returns a BatchedDataDict whose tensors live on the
    communication device and are byte-identical across the group.
    """
    if is_leader and data is None:
        raise InvalidBatch("the leader must pass the data to broadcast")
    if not is_leader and data is not None:
        raise InvalidBatch("non-leaders must pass data=None (they receive it)")
    # From here on ``data is not None`` exactly on the leader (checked above).
    holder: list[Any] = [None]
    if data is not None:
        try:
            holder[0] = _describe(data)
        except NonTensorField as e:
            # Ship the error instead: the siblings are already waiting in the collective
            # below, and raising here alone would leave them hanging until its timeout.
            holder[0] = {"error": e}
    dist.broadcast_object_list(holder, src=src, group=group)
    descriptor: dict[str, Any] = holder[0]
    if "error" in descriptor:
        raise descriptor["error"]
    device = comm_device(group)

    out: BatchedDataDict[Any] = BatchedDataDict()
    for entry in descriptor["entries"]:
        key, kind = entry[0], entry[1]
        if kind == "plain":
            out[key] = data[key] if data is not None else entry[2]
        elif kind == "tensor":
            mine = data[key] if data is not None else None
            out[key] = _send_or_recv_bytes(
                mine, entry[2], entry[3], src=src, group=group, device=device
            )
        else:  # nested
            (v_dtype, v_shape), (o_dtype, o_shape) = entry[2], entry[3]
            mine_v = data[key].values() if data is not None else None
            mine_o = data[key].offsets() if data is not None else None
            values = _send_or_recv_bytes(
                mine_v, v_dtype, v_shape, src=src, group=group, device=device
            )
            offsets = _send_or_recv_bytes(
                mine_o, o_dtype, o_shape, src=src, group=group, device=device
            )
            out[key] = torch.nested.nested_tensor_from_jagged(values, offsets)
    for name, value in descriptor["attrs"].items():
        if value is not None:
            setattr(out, name, value)
    return out
