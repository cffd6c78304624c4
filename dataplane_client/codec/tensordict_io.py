"""Fields in and out of the client as ``tensordict.TensorDict`` (NeMo-RL's convention).

- :func:`as_field_mapping`: what a put accepts (a TensorDict, a dict or a
  BatchedDataDict) as a plain ``{name: value}`` dict the codec encodes;
  non-tensor entries of a TensorDict become lists of their per-row values.
- :func:`to_tensordict`: decoded fields as a TensorDict with ``batch_size=[n]``:
  dense fields dense, jagged fields as ``torch.nested`` jagged tensors (a
  TensorDict holds them; indexing and ``.to`` keep them jagged), enum codes as
  their strings and objects as non-tensor stacks.

tensordict costs about 1.5 s to import, and storage units import the codec
that calls :func:`as_field_mapping`; so it is imported only where a TensorDict
is built, and recognised on input only once a caller has imported it.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from dataplane_client.codec.quiet import drop_torch_fx_tracing_notice
from dataplane_client.wire.enum_codes import to_strings
from dataplane_client.wire.errors import InvalidBatch

if TYPE_CHECKING:
    from tensordict import TensorDict


# Jagged reads reach torch code that logs a notice meant for torch itself.
drop_torch_fx_tracing_notice()


def _from_tensordict(td: Any, tensordict: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in td.keys():  # noqa: SIM118 - iterating a TensorDict walks its rows, not its keys
        value = td.get(key)
        if tensordict.is_non_tensor(value):
            out[key] = value.tolist()
        elif isinstance(value, tensordict.TensorDictBase):
            raise InvalidBatch(
                "a nested TensorDict is not a field; flatten it first "
                "(td.flatten_keys('.')) so each leaf is one field",
                fields=[key],
            )
        else:
            out[key] = value
    return out


def as_field_mapping(fields: Any) -> dict[str, Any]:
    """``{name: value}`` of a TensorDict, dict or BatchedDataDict."""
    tensordict = sys.modules.get("tensordict")  # nobody imported it: no TensorDict exists
    if tensordict is not None and isinstance(fields, tensordict.TensorDictBase):
        return _from_tensordict(fields, tensordict)
    if isinstance(fields, Mapping):
        return dict(fields)
    raise InvalidBatch(
        f"fields must be a mapping (TensorDict, dict or BatchedDataDict), got {type(fields).__name__}"
    )


def _non_tensor_stack(values: list) -> Any:
    from tensordict import NonTensorData, NonTensorStack

    if set(map(type, values)) <= {str, type(None)}:
        # The same stack, built about 3x faster; from_list would stack list rows as a
        # second dim, so it serves string columns only.
        return NonTensorStack.from_list(values)
    return NonTensorStack(*[NonTensorData(data=v, batch_size=[]) for v in values], stack_dim=0)


def to_tensordict(
    decoded: Mapping[str, Any],
    num_rows: int,
    *,
    enums: Mapping[str, tuple[str, ...]] | None = None,
    device: Any = None,
) -> TensorDict:
    """Decoded fields (tensors, jagged tensors, lists) as a TensorDict of ``num_rows`` rows.

    A field named in ``enums`` holds codes and comes back as its strings. ``device``:
    the TensorDict's device (its tensors are there already: ``assembly.assemble_fields``).
    """
    from tensordict import TensorDict

    enums = enums or {}
    out = TensorDict({}, batch_size=[num_rows], device=device)
    for name, value in decoded.items():
        if name in enums:
            value = to_strings(name, value, enums[name])
        out[name] = _non_tensor_stack(value) if isinstance(value, list) else value
    return out
