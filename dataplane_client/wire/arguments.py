"""Argument checks shared by the client (before anything is staged) and the controller.

Each check raises the typed error a caller should see (``InvalidBatch`` is a
``ValueError``), naming what was wrong, and returns the value in the form the
rest of the code relies on (a list, an int, a float).
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack

from dataplane_client.wire import enum_codes, tag_filters
from dataplane_client.wire.errors import InvalidBatch
from dataplane_client.wire.messages import (
    ClaimRequest,
    FieldCodecs,
    PartitionSpec,
    RolloutGrant,
    StalenessSpec,
)
from dataplane_client.wire.meta import KVBatchMeta, duplicated

MAX_ID_BYTES = 1024
# The dtypes a declared numeric tag is kept as (one typed column per tag).
NUMERIC_TAG_TYPES = ("int64", "int32", "float64", "float32")


def _shown(value: str) -> str:
    """``value``'s repr, cut short (a message never carries a 5,000-char name)."""
    return repr(value) if len(value) <= 60 else repr(value[:60]) + "..."


def _utf8(value: str) -> bool:
    """True when ``value`` encodes as UTF-8: no lone surrogate (``"\\ud800"``, as
    ``json.loads`` or ``os.fsdecode`` may produce), which msgpack, the journal and the
    wire cannot carry."""
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def text(value: str, what: str) -> str:
    """A str that encodes as UTF-8, or InvalidBatch naming ``what``."""
    if not _utf8(value):
        raise InvalidBatch(
            f"{what} must be valid UTF-8 text (no lone surrogate), got {_shown(value)}"
        )
    return value


def name(value: Any, what: str) -> str:
    """One name (a task, a field): a non-empty str of UTF-8 text."""
    if not isinstance(value, str) or not value:
        raise InvalidBatch(
            f"{what} must be a non-empty str, got {type(value).__name__} {value!r:.60}"
        )
    return text(value, what)


def plainly_good_ids(ids: Any) -> bool:
    """True when ``ids`` is a non-empty list of distinct non-empty str short enough, decided
    by loops that run in C (types, lengths, distinctness). False says only "look closer":
    ``id_list`` then finds and names what is wrong, if anything."""
    return (
        type(ids) is list
        and len(ids) > 0
        and set(map(type, ids)) == {str}
        and min(map(len, ids)) > 0
        and max(map(len, ids)) * 4 <= MAX_ID_BYTES  # 4: UTF-8's widest char
        and len(set(ids)) == len(ids)
        and _utf8("".join(ids))  # one C pass: plain ASCII ids cost a join
    )


def id_list(ids: Any, what: str = "sample_ids", *, partition_id: str | None = None) -> list[str]:
    """A non-empty list/tuple of distinct non-empty str, each at most MAX_ID_BYTES long."""
    if plainly_good_ids(ids):
        return list(ids)
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)):
        raise InvalidBatch(
            f"{what} must be a list or tuple of str, got {type(ids).__name__}",
            partition_id=partition_id,
        )
    ids = list(ids)
    if not ids:
        raise InvalidBatch(f"{what}: at least one is needed", partition_id=partition_id)
    bad = [s for s in ids if not isinstance(s, str) or not s]
    if bad:
        raise InvalidBatch(f"{what} must be non-empty str", ids=bad, partition_id=partition_id)
    if not _utf8("".join(ids)):
        raise InvalidBatch(
            f"{what} must be valid UTF-8 text (no lone surrogate)",
            ids=[s for s in ids if not _utf8(s)],
            partition_id=partition_id,
        )
    long = [s[:40] + "..." for s in ids if len(s.encode()) > MAX_ID_BYTES]
    if long:
        raise InvalidBatch(
            f"{what} must be at most {MAX_ID_BYTES} bytes", ids=long, partition_id=partition_id
        )
    dups = duplicated(ids)
    if dups:
        raise InvalidBatch(f"duplicate {what}", ids=dups, partition_id=partition_id)
    return ids


def partition_name(partition_id: Any) -> str:
    if not isinstance(partition_id, str) or not partition_id:
        raise InvalidBatch(f"partition_id must be a non-empty str, got {partition_id!r:.80}")
    text(partition_id, "partition_id")
    if len(partition_id.encode()) > MAX_ID_BYTES:
        raise InvalidBatch(f"partition_id must be at most {MAX_ID_BYTES} bytes")
    return partition_id


def name_list(names: Any, what: str, *, allow_empty: bool = False) -> list[str]:
    """Field or task names: a list/tuple of non-empty str (a bare str is rejected)."""
    if isinstance(names, (str, bytes)) or not isinstance(names, (list, tuple)):
        raise InvalidBatch(f"{what} must be a list or tuple of str, got {type(names).__name__}")
    names = list(names)
    if not names and not allow_empty:
        raise InvalidBatch(f"{what} must name at least one", fields=[])
    bad = [n for n in names if not isinstance(n, str) or not n]
    if bad:
        raise InvalidBatch(f"{what} must be non-empty str, got {bad!r:.200}")
    for n in names:
        text(n, what)
    return names


def count(value: Any, what: str, *, minimum: int) -> int:
    """An int (bool and float rejected) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidBatch(f"{what} must be an int, got {value!r}")
    if value < minimum:
        raise InvalidBatch(f"{what} must be >= {minimum}, got {value}")
    return int(value)


def optional_count(value: Any, what: str, *, minimum: int) -> int | None:
    return None if value is None else count(value, what, minimum=minimum)


def flag(value: Any, what: str) -> bool:
    """A bool (an int, None or a str is refused: ``"no"`` would read as True)."""
    if not isinstance(value, bool):
        raise InvalidBatch(f"{what} must be a bool, got {type(value).__name__} {value!r:.60}")
    return value


def directory(path: Any, what: str = "directory") -> str:
    """A directory name: a non-empty str or os.PathLike the file system can encode."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str) or not path:
        raise InvalidBatch(
            f"{what} must be a non-empty str or os.PathLike, got {type(path).__name__} {path!r:.60}"
        )
    if "\x00" in path:
        raise InvalidBatch(f"{what} must not hold a NUL character, got {_shown(path)}")
    try:
        os.fsencode(path)  # a surrogate os.fsdecode made is a file name's byte: it encodes
    except UnicodeEncodeError:
        raise InvalidBatch(
            f"{what} is no file name this system can encode: {_shown(path)}"
        ) from None
    return path


def seconds(value: Any, what: str) -> float:
    """A finite, non-negative number of seconds (NaN and inf rejected)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidBatch(f"{what} must be a number of seconds, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise InvalidBatch(f"{what} must be finite and >= 0, got {value}")
    return value


def lease_map(task_leases: Any) -> dict[str, float]:
    """``task_leases``: a mapping of consumer task -> lease seconds (> 0); None is no leases."""
    if task_leases is None:
        return {}
    if not isinstance(task_leases, Mapping):
        raise InvalidBatch(
            f"task_leases must map task names to seconds, got {type(task_leases).__name__}"
        )
    leases = {}
    for task, value in task_leases.items():
        if not isinstance(task, str):
            raise InvalidBatch(f"task_leases keys are task names (str), got {task!r:.60}")
        text(task, "task_leases keys")
        leases[task] = seconds(value, f"lease of {task!r}")
        if leases[task] <= 0:
            raise InvalidBatch(f"the lease of {task!r} must be longer than 0 s")
    return leases


def batch_meta(meta: Any, verb: str) -> KVBatchMeta:
    """The ``KVBatchMeta`` a verb was handed (a claim's or a put's result), or InvalidBatch."""
    if not isinstance(meta, KVBatchMeta):
        raise InvalidBatch(f"{verb} takes a KVBatchMeta as meta, got {type(meta).__name__}")
    return meta


def lease_ack(meta: Any) -> tuple[str, str, list[str], int]:
    """An ``ack``'s meta, checked: (partition_id, task_name, sample_ids, lease_id)."""
    meta = batch_meta(meta, "ack")
    lease_id = meta.extra_info.get("lease_id")
    if lease_id is None or meta.task_name is None:
        raise InvalidBatch(
            "this meta holds no lease: only claims of a leased task are acknowledged",
            partition_id=meta.partition_id,
        )
    partition_id = partition_name(meta.partition_id)
    task = name(meta.task_name, "meta.task_name")
    ids = id_list(meta.sample_ids, "meta.sample_ids", partition_id=partition_id)
    return partition_id, task, ids, count(lease_id, "meta.extra_info['lease_id']", minimum=1)


def version_list(version: Any, n: int, *, partition_id: str | None = None) -> list[int] | None:
    """A put's ``version=``: one int for every sample, or a sequence of one per sample."""
    if version is None:
        return None
    one = isinstance(version, numbers.Integral) and not isinstance(version, bool)
    versions = [version] * n if one else version
    if isinstance(versions, (str, bytes)) or not isinstance(versions, Sequence):
        raise InvalidBatch(
            f"version must be an int or a list of one int per sample, got {version!r}",
            partition_id=partition_id,
        )
    if len(versions) != n:
        raise InvalidBatch(
            f"{len(versions)} versions for {n} sample ids", partition_id=partition_id
        )
    out = []
    for i, v in enumerate(versions):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise InvalidBatch(
                f"version[{i}] must be an int (a policy version), got {v!r}",
                partition_id=partition_id,
            )
        out.append(int(v))
    return out


def tag_list(tags: Any, n: int, *, partition_id: str | None = None) -> list[dict] | None:
    """One dict of msgpack-able values per sample; a group_id must be hashable."""
    if tags is None:
        return None
    if isinstance(tags, (str, bytes, dict)) or not isinstance(tags, Sequence):
        raise InvalidBatch(
            "tags must be a list of dicts, one per sample", partition_id=partition_id
        )
    if len(tags) != n:
        raise InvalidBatch(f"{len(tags)} tags for {n} sample ids", partition_id=partition_id)
    out = []
    for i, t in enumerate(tags):
        if t is not None and not isinstance(t, dict):
            raise InvalidBatch(f"tags[{i}] must be a dict, got {type(t).__name__}")
        t = dict(t or {})
        if "group_id" in t:
            try:
                hash(t["group_id"])
            except TypeError:
                raise InvalidBatch(
                    f"tags[{i}]['group_id'] must be hashable, got {type(t['group_id']).__name__}",
                    partition_id=partition_id,
                ) from None
        try:
            msgpack.packb(t)
        except (TypeError, ValueError, OverflowError) as e:
            raise InvalidBatch(
                f"tags[{i}] must hold msgpack-able values (str, numbers, lists, dicts): {e}",
                partition_id=partition_id,
            ) from None
        out.append(t)
    return out


def field_codecs(enums: Any, object_fields: Any) -> FieldCodecs:
    """A registration's ``enums`` and ``object_fields``, checked: each vocabulary a
    non-empty list of distinct str, and no field both an enum and an object field."""
    if enums is not None and not isinstance(enums, Mapping):
        raise InvalidBatch(f"enums must map field -> list of str, got {type(enums).__name__}")
    enums = dict(enums or {})
    name_list(list(enums), "enums' field names", allow_empty=True)
    vocabularies = {name: enum_codes.vocabulary(name, words) for name, words in enums.items()}
    for field, words in vocabularies.items():
        if not _utf8("".join(words)):
            raise InvalidBatch(
                "enum vocabulary words must be valid UTF-8 text (no lone surrogate)",
                fields=[field],
            )
    if object_fields is None:  # as for enums and task_leases: none
        object_fields = ()
    objects = frozenset(name_list(object_fields, "object_fields", allow_empty=True))
    both = sorted(objects & set(vocabularies))
    if both:
        raise InvalidBatch("a field is either an enum or an object field, not both", fields=both)
    return FieldCodecs(enums=vocabularies, object_fields=objects)


def request_id(value: Any) -> str | None:
    """A claim's request id: None, or a short ASCII string (the client makes a uuid hex)."""
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= 128 or not value.isascii():
        raise InvalidBatch(f"request_id must be a short ASCII string, got {value!r}")
    return value


def policy_name(value: Any) -> str | None:
    """A claim policy's name, or None (the default); which names exist only the service knows."""
    return None if value is None else name(value, "claim_policy")


def policy_options(value: Any) -> dict[str, Any]:
    """A claim policy's options: a mapping of option name -> msgpack-able value (None: none).
    What each policy takes is checked by the policy, in the service."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidBatch(
            f"policy_options must map option names to values, got {type(value).__name__}"
        )
    options = dict(value)
    name_list(list(options), "policy_options' names", allow_empty=True)
    try:
        msgpack.packb(options)
    except (TypeError, ValueError, OverflowError) as e:
        raise InvalidBatch(f"policy_options must hold msgpack-able values: {e}") from None
    return options


def numeric_tag_types(value: Any) -> dict[str, str]:
    """``numeric_tags``: tag name -> one of NUMERIC_TAG_TYPES (None: none)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidBatch(
            f"numeric_tags must map tag names to a dtype name, got {type(value).__name__}"
        )
    types = dict(value)
    name_list(list(types), "numeric_tags' names", allow_empty=True)
    bad = {tag: t for tag, t in types.items() if t not in NUMERIC_TAG_TYPES}
    if bad:
        raise InvalidBatch(
            f"numeric_tags {bad!r:.200}: each dtype must be one of {NUMERIC_TAG_TYPES}"
        )
    return types


def rollout_grant(grant: Any) -> RolloutGrant:
    if not isinstance(grant, RolloutGrant):
        raise InvalidBatch(
            f"a grant is the RolloutGrant admit_rollouts returned, got {grant!r:.80}"
        )
    return grant


STALE_SAMPLES = ("drop", "keep")


def staleness_spec(value: Any) -> StalenessSpec | None:
    """A partition's async-RL options checked (None: none); which tasks a per-task bound may
    name is checked with the whole declaration, in the key space."""
    if value is None:
        return None
    if not isinstance(value, StalenessSpec):
        raise InvalidBatch(f"staleness must be a StalenessSpec, got {type(value).__name__}")
    bound = value.max_staleness
    if isinstance(bound, Mapping):
        name_list(list(bound), "max_staleness' tasks")
        bound = {task: count(n, f"max_staleness[{task!r}]", minimum=0) for task, n in bound.items()}
    else:
        bound = optional_count(bound, "max_staleness", minimum=0)
    if value.stale_samples not in STALE_SAMPLES:
        raise InvalidBatch(
            f"stale_samples must be one of {STALE_SAMPLES}, got {value.stale_samples!r:.40}"
        )
    ratio = value.oversample_ratio
    if ratio is not None and (
        isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not ratio >= 1.0
    ):
        raise InvalidBatch(f"oversample_ratio must be a number >= 1, got {ratio!r:.40}")
    admission_batch = optional_count(value.admission_batch, "admission_batch", minimum=1)
    if admission_batch is not None and bound is None:
        raise InvalidBatch("admission_batch needs max_staleness: the bound is (N + 1) x batch")
    if ratio is not None and admission_batch is None:
        raise InvalidBatch("oversample_ratio needs admission_batch")
    pace = flag(value.pace, "pace")
    if pace and admission_batch is None:
        raise InvalidBatch("pace needs admission_batch: the trainer's samples per version")
    return StalenessSpec(
        version_tag=name(value.version_tag, "version_tag"),
        max_staleness=bound,
        stale_samples=value.stale_samples,
        admission_batch=admission_batch,
        oversample_ratio=None if ratio is None else float(ratio),
        evict_stale=flag(value.evict_stale, "evict_stale"),
        pace=pace,
    )


def partition_spec(spec: Any) -> PartitionSpec:
    """A registration checked in full (each error names its argument), as plain lists and
    dicts. The one check both clients run before anything is forgotten or sent, and the
    key space runs again on what arrives; a claim policy's own checks follow there."""
    if not isinstance(spec, PartitionSpec):
        raise InvalidBatch(f"a registration is a PartitionSpec, got {type(spec).__name__}")
    partition_name(spec.partition_id)
    leases = lease_map(spec.task_leases)
    codecs = field_codecs(spec.enums, spec.object_fields)
    return PartitionSpec(
        partition_id=spec.partition_id,
        fields=name_list(spec.fields, "fields", allow_empty=True),
        num_samples=optional_count(spec.num_samples, "num_samples", minimum=0),
        consumer_tasks=list(
            dict.fromkeys(name_list(spec.consumer_tasks, "consumer_tasks", allow_empty=True))
        ),
        grpo_group_size=optional_count(spec.grpo_group_size, "grpo_group_size", minimum=1),
        task_leases=leases,
        enums={name: list(words) for name, words in codecs.enums.items()},
        object_fields=sorted(codecs.object_fields),
        claim_policy=policy_name(spec.claim_policy),
        policy_options=policy_options(spec.policy_options),
        numeric_tags=numeric_tag_types(spec.numeric_tags),
        staleness=staleness_spec(spec.staleness),
        group_fields=group_field_names(spec.group_fields, spec.grpo_group_size),
        group_deadline_s=group_deadline(spec.group_deadline_s, spec.grpo_group_size),
    )


def group_deadline(value: Any, group_size: Any) -> float | None:
    """``group_deadline_s``: seconds (finite, > 0) from a group's first member after which
    a group still short of members stops being waited for (None: waited for forever)."""
    if value is None:
        return None
    if group_size is None:
        raise InvalidBatch(
            f"group_deadline_s={value!r:.40} needs grpo_group_size: a deadline is a group's"
        )
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidBatch(f"group_deadline_s must be a number of seconds, got {value!r:.40}")
    if not math.isfinite(value) or value <= 0:
        raise InvalidBatch(f"group_deadline_s must be finite and > 0, got {value!r}")
    return float(value)


def group_field_names(value: Any, group_size: Any) -> list[str]:
    """``group_fields``: names of fields whose value is one per GRPO group. A sample's group
    is its ``group_id`` tag, which only a partition with ``grpo_group_size`` requires."""
    if value is None:
        return []
    names = list(dict.fromkeys(name_list(value, "group_fields", allow_empty=True)))
    if names and group_size is None:
        raise InvalidBatch(
            "group_fields needs grpo_group_size: a sample's group is its group_id tag, "
            "which only a grouped partition requires",
            fields=names,
        )
    return names


def claim_request(request: Any) -> ClaimRequest:
    """A claim checked in full (each error names its argument): what both clients send and
    the controller checks again on arrival."""
    if not isinstance(request, ClaimRequest):
        raise InvalidBatch(f"not a ClaimRequest: {type(request).__name__}")
    return ClaimRequest(
        partition_id=partition_name(request.partition_id),
        task_name=name(request.task_name, "task_name"),
        required_fields=name_list(request.required_fields, "required_fields", allow_empty=True),
        batch_size=count(request.batch_size, "batch_size", minimum=1),
        dp_rank=optional_count(request.dp_rank, "dp_rank", minimum=0),
        blocking=flag(request.blocking, "blocking"),
        request_id=request_id(request.request_id),
        timeout_s=seconds(request.timeout_s, "timeout_s"),
        claim_policy=policy_name(request.claim_policy),
        policy_options=policy_options(request.policy_options),
        where=tag_filters.parse(request.where),
        max_staleness=optional_count(request.max_staleness, "max_staleness", minimum=0),
    )
