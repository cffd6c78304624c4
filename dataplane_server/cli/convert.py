"""Protobuf messages of the admin API as JSON-able builtins (what ``--json`` prints).

Generic over the descriptor, so a field added to the proto shows up without
touching the CLI: int64 stays a number, enums become lower-case names without
their prefix ("jagged", "ready"), unset optional scalars and messages become None.
"""

from __future__ import annotations

import re
from typing import Any

from google.protobuf import json_format


def _enum_prefix(enum_name: str) -> str:
    # SampleStatus -> "SAMPLE_STATUS_": the proto style guide prefixes values with it.
    return re.sub(r"(?<!^)(?=[A-Z])", "_", enum_name).upper() + "_"


def _plain_number(x: Any) -> Any:
    # Struct / ListValue store every number as a double; show 3 rather than 3.0.
    if isinstance(x, float) and x.is_integer() and abs(x) < 2**53:
        return int(x)
    if isinstance(x, list):
        return [_plain_number(v) for v in x]
    if isinstance(x, dict):
        return {k: _plain_number(v) for k, v in x.items()}
    return x


def _enum_name(fd, number: int) -> str:
    return (
        fd.enum_type.values_by_number[number]
        .name.removeprefix(_enum_prefix(fd.enum_type.name))
        .lower()
    )


def to_builtin(message) -> dict[str, Any]:
    """One message as a dict of builtins, field by field in declaration order."""
    out: dict[str, Any] = {}
    for fd in message.DESCRIPTOR.fields:
        value = getattr(message, fd.name)
        message_type = fd.message_type
        # An unset optional scalar, or an unset (non-repeated) message, is None.
        if fd.has_presence and not fd.is_repeated and not message.HasField(fd.name):
            out[fd.name] = None
        elif message_type is not None and message_type.GetOptions().map_entry:
            nested = message_type.fields_by_name["value"].message_type is not None
            out[fd.name] = {k: to_builtin(v) if nested else v for k, v in value.items()}
        elif message_type is not None and message_type.full_name.startswith("google.protobuf."):
            # Well-known types (Struct, ListValue) have a canonical JSON form.
            convert = json_format.MessageToDict
            out[fd.name] = _plain_number(
                [convert(v) for v in value] if fd.is_repeated else convert(value)
            )
        elif message_type is not None:
            out[fd.name] = [to_builtin(v) for v in value] if fd.is_repeated else to_builtin(value)
        elif fd.enum_type is not None:
            out[fd.name] = (
                [_enum_name(fd, v) for v in value] if fd.is_repeated else _enum_name(fd, value)
            )
        else:
            out[fd.name] = list(value) if fd.is_repeated else value
    return out
