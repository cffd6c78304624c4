"""What every implementation of the client checks and prepares before touching a store.

The Ray client and the in-process twin (``dataplane_server.core.inprocess``) share
these, so the same bad input raises the same typed error on both, and a write
reaches either store in the same encoded form.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dataplane_client.codec.fields import decode_field, encode_fields
from dataplane_client.codec.tensordict_io import as_field_mapping
from dataplane_client.wire import arguments, group_fields
from dataplane_client.wire.encoded import DENSE, JAGGED, EncodedField
from dataplane_client.wire.errors import InvalidBatch
from dataplane_client.wire.messages import DEFAULT_VERSION_TAG, FieldCodecs
from dataplane_client.wire.meta import KVBatchMeta


@dataclass(frozen=True)
class Write:
    """A put, checked and encoded: nothing of it is stored yet."""

    sample_ids: list[str]
    encoded: dict[str, EncodedField]
    sequence_lengths: list[int] | None
    tags: list[dict] | None
    overwrite: bool
    # Group fields (``group_fields``): ``encoded`` holds one row per group of the put, and
    # ``shared[field][i]`` is sample i's row in it; ``groups``: each sample's group_id.
    shared: dict[str, np.ndarray] = field(default_factory=dict)
    groups: list | None = None

    @property
    def schemas(self) -> dict[str, tuple]:
        return {name: enc.schema for name, enc in self.encoded.items()}


def sequence_lengths(encoded: Mapping[str, EncodedField]) -> list[int] | None:
    """A sample's sequence length: ``input_lengths`` if given, else its first jagged field."""
    lengths = encoded.get("input_lengths")
    if lengths is not None and lengths.kind == DENSE and lengths.shape == ():
        return [int(x) for x in decode_field(lengths).tolist()]
    for enc in encoded.values():
        if enc.kind == JAGGED:
            return enc.require_lengths().tolist()
    return None


@dataclass(frozen=True)
class PutArguments:
    """A put's arguments, checked: what ``write`` encodes once the partition's codecs are
    known (its fields as a mapping of names to values, not encoded yet)."""

    sample_ids: list[str]
    partition_id: str
    fields: Mapping[str, Any]
    tags: list[dict] | None
    overwrite: bool
    versions: list[int] | None = None  # the policy version of each sample (``version=``)


def put_arguments(
    sample_ids: Any,
    partition_id: Any,
    fields: Any,
    tags: Any,
    overwrite: Any,
    version: Any = None,
) -> PutArguments:
    """A put's arguments checked, each error naming its argument (the fields a TensorDict,
    dict or BatchedDataDict): all that is checked before the partition's codecs are known."""
    partition_id = arguments.partition_name(partition_id)
    ids = arguments.id_list(sample_ids, partition_id=partition_id)
    tag_list = arguments.tag_list(tags, len(ids), partition_id=partition_id)
    if not isinstance(overwrite, bool):
        raise InvalidBatch(f"overwrite must be a bool, got {overwrite!r}")
    versions = arguments.version_list(version, len(ids), partition_id=partition_id)
    mapping = as_field_mapping(fields)
    arguments.name_list(list(mapping), "fields", allow_empty=True)  # names: non-empty UTF-8 str
    return PutArguments(ids, partition_id, mapping, tag_list, overwrite, versions)


def versioned_tags(put: PutArguments, version_tag: str | None) -> list[dict] | None:
    """The put's tags with each sample's ``version=`` under the partition's version tag
    (``DEFAULT_VERSION_TAG`` for a partition without a StalenessSpec, where it is a plain
    tag): the form the key space keeps (a versioned partition's typed column) and the
    units keep for rebuilds."""
    if put.versions is None:
        return put.tags
    version_tag = version_tag or DEFAULT_VERSION_TAG
    tags = put.tags or [{} for _ in put.versions]
    out = []
    for sid, tag, version in zip(put.sample_ids, tags, put.versions):
        given = tag.get(version_tag, version)
        if given != version or isinstance(given, bool):
            raise InvalidBatch(
                f"sample {sid!r}: version={version} but its tags say "
                f"{version_tag}={given!r}; give the version once",
                partition_id=put.partition_id,
            )
        out.append({**tag, version_tag: version})
    return out


def write(put: PutArguments, codecs: FieldCodecs) -> Write:
    """A checked put's fields encoded with the partition's codecs (``encode_fields``)."""
    ids, partition_id = put.sample_ids, put.partition_id
    tags = versioned_tags(put, codecs.version_tag)
    encoded = encode_fields(
        put.fields,
        num_rows=len(ids),
        enums=codecs.enums,
        object_fields=codecs.object_fields,
    )
    lengths = sequence_lengths(encoded)  # per sample, before group fields are shared
    shared = group_fields.share(ids, tags, encoded, codecs.group_fields, partition_id)
    return Write(ids, shared.encoded, lengths, tags, put.overwrite, shared.index, shared.groups)


def read_fields(meta: KVBatchMeta, select_fields: Sequence[str] | None) -> list[str]:
    """The fields a ``get_data`` reads: ``select_fields``, else ``meta.fields``, else an error
    (NeMo-RL's contract: never every field silently)."""
    fields = select_fields if select_fields is not None else meta.fields
    if not fields:
        raise InvalidBatch(
            "get_data needs select_fields or meta.fields: say which fields to fetch",
            partition_id=meta.partition_id,
        )
    return arguments.name_list(fields, "select_fields")
