"""Bad input to every public client verb, on the Ray client and the in-process client.

Each example starts from a well-formed call and replaces one or more arguments with a
malformed value (wrong type, NaN/inf/negative numbers, huge or duplicate ids,
unhashable tags, empty field lists, mismatched lengths, non-tensor leaves, meta-device
tensors, object arrays, unknown names, lone surrogates). What must hold: the call returns
or raises a typed error from ``dataplane_client.wire.errors`` that is also the matching built-in,
never anything else; it never hangs (pytest-timeout); and the store is unchanged afterwards
(partition description, consumption, every sample's bytes, the partitions that exist).

A second test goes through every argument of every verb (sync and awaited) with wrong
types and strings UTF-8 cannot carry: each must be InvalidBatch naming the argument, on
both clients alike, and change nothing.

The bugs this file found (raw errors for a non-meta, non-mapping leases,
unhashable partition ids, sparse tensors, lone surrogates; a dp_rank of any type
accepted) are fixed; their regression tests are at the end.
Inputs tried per surface are printed at the end of the module.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataplane_client import KVBatchMeta
from dataplane_client.wire.errors import DataPlaneError, InvalidBatch
from dataplane_server.core.inprocess import InProcessDataPlaneClient

# Fuzzing runs many examples against both clients: the full suite, not make test-fast.
pytestmark = pytest.mark.slow

TASKS = ["train", "ref"]
IDS = [f"s{i}" for i in range(6)]
FIELDS = ["tokens", "score", "env", "obj"]
BUILTINS = (KeyError, ValueError, TypeError, TimeoutError)
TRIED: Counter = Counter()
SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@pytest.fixture(autouse=True, scope="module")
def _report_counts():
    yield
    print(f"\nclient fuzz inputs tried per verb and client: {dict(sorted(TRIED.items()))}")


# ---- the store every example starts from ------------------------------------------------


def _fill(c) -> dict:
    """A partition with 6 samples every task is done with (nothing left to claim), so a
    well-formed claim, read or status call changes nothing either."""
    pid = f"fuzz-{uuid.uuid4().hex[:8]}"
    c.register_partition(
        pid,
        ["tokens", "score"],
        len(IDS),
        TASKS,
        enums={"env": ["math", "code"]},
        object_fields=["obj"],
        task_leases={"ref": 600.0},
    )
    c.put_samples(
        IDS,
        pid,
        {
            "tokens": [torch.arange(i + 1, dtype=torch.int64) for i in range(len(IDS))],
            "score": torch.arange(len(IDS), dtype=torch.float32),
            "env": ["math", "code"] * (len(IDS) // 2),
            "obj": [{"i": i} for i in range(len(IDS))],
        },
        tags=[{"group_id": i // 2} for i in range(len(IDS))],
    )
    train = c.claim_meta(pid, "train", ["tokens"], len(IDS), blocking=False)
    ref = c.claim_meta(pid, "ref", ["tokens"], len(IDS), blocking=False)
    assert train.size == ref.size == len(IDS)
    assert c.ack(ref) == len(IDS)
    return {"pid": pid, "train": train, "ref": ref}


def _snapshot(c, pid: str) -> tuple:
    data = c.get_samples(IDS, pid, FIELDS)
    samples = (
        [t.tolist() for t in data["tokens"].unbind()],
        data["score"].tolist(),
        list(data["env"]),
        list(data["obj"]),
    )
    detail = c.consumption_detail(pid, TASKS)
    if isinstance(c, InProcessDataPlaneClient):
        keys = c._keys
        assert keys is not None
        where = (sorted(map(repr, keys.partitions)), len(c._store[pid]))
    else:
        info = c.service_info()
        where = (
            c.describe_partition(pid),
            info.num_partitions,
            info.num_samples,
            sorted(p.partition_id for p in _partitions(c)),
        )
    return samples, detail, where


def _partitions(c) -> list:
    import ray

    return ray.get(c._controller.list_partitions.remote())


@pytest.fixture(params=["ray", "in_process"])
def store(request):
    if request.param == "ray":
        c = request.getfixturevalue("client")
    else:
        c = InProcessDataPlaneClient()
    state = _fill(c)
    state["client"], state["kind"] = c, request.param
    state["before"] = _snapshot(c, state["pid"])
    yield state
    if request.param == "ray":
        c.delete_partition(state["pid"])
    else:
        c.close()


# ---- malformed values, by argument -----------------------------------------------------
# Each pool maps a label to a factory (tensors are built fresh for every call).


def _same(value):
    return lambda s: value


NAN, INF = float("nan"), float("inf")
# A lone surrogate (json.loads('"\\ud800"') makes one): no UTF-8 for it, so no msgpack either.
SURROGATE = "\ud800"
# os.fsdecode's stand-in for a byte that is no UTF-8 ("s\udcff"): no UTF-8 for it either.
FSDECODED = os.fsdecode(b"s\xff")

PARTITION_BAD = {
    "int": _same(5),
    "none": _same(None),
    "empty": _same(""),
    "huge": _same("p" * 5000),
    "list": _same(["p"]),
    "bytes": _same(b"p"),
    "float-nan": _same(NAN),
    "tensor": lambda s: torch.tensor(1),
    "set": _same({"p"}),
    "dict": _same({"p": 1}),
    "bool": _same(True),
    "surrogate": _same("p" + SURROGATE),
    "fsdecoded": _same(FSDECODED),
}
PARTITION_UNKNOWN = {"unknown": _same("no-such-partition")}

IDS_BAD = {
    "bare-str": _same("s0"),
    "bytes": _same(b"s0"),
    "empty": _same([]),
    "ints": _same([1, 2]),
    "empty-id": _same([""]),
    "duplicate": _same(["s0", "s0"]),
    "huge-id": _same(["x" * 5000]),
    "unhashable-id": _same([["u"]]),
    "none": _same(None),
    "int": _same(5),
    "set": _same({"s0"}),
    "object-array": _same(np.array(["s0"], dtype=object)),
    "tensor": lambda s: torch.tensor([1]),
    "none-in-list": _same(("s0", None)),
    "nan-id": _same([NAN]),
    "many-huge": _same([f"{i}" * 1100 for i in range(1, 9)]),
    "surrogate-id": _same(["s0", "s" + SURROGATE]),
    "fsdecoded-id": _same([FSDECODED]),
    "dict": _same({"s0": 1}),
    "float-nan": _same(NAN),
}
IDS_UNKNOWN = {"unknown": _same(["never-written"]), "part-unknown": _same(["s0", "never-written"])}

NAMES_BAD = {
    "bare-str": _same("score"),
    "empty": _same([]),
    "ints": _same([1]),
    "empty-name": _same([""]),
    "none": _same(None),
    "int": _same(5),
    "nested": _same([["score"]]),
    "set": _same({"score"}),
    "surrogate": _same(["score" + SURROGATE]),
    "bytes-name": _same([b"score"]),
    "dict": _same({"score": 1}),
}

FIELDS_BAD = {
    "int": _same(5),
    "str": _same("score"),
    "list": _same(["score"]),
    "list-of-floats": _same({"score": [1.0, 2.0]}),
    "mismatched-rows": lambda s: {"score": torch.ones(3)},
    "meta-device": lambda s: {"score": torch.empty(2, device="meta")},
    "object-array": _same({"score": np.array([object(), object()], dtype=object)}),
    "none-leaf": _same({"score": None}),
    "str-leaf": _same({"score": "ab"}),
    "empty-name": lambda s: {"": torch.ones(2)},
    "int-key": lambda s: {1: torch.ones(2)},
    "dtype-conflict": lambda s: {"score": torch.ones(2, dtype=torch.float64)},
    "shape-conflict": lambda s: {"tokens": [torch.ones(2, 2), torch.ones(1, 2)]},
    "complex": lambda s: {"c": torch.ones(2, dtype=torch.complex64)},
    "nested-dict": lambda s: {"score": {"a": torch.ones(2)}},
    "enum-unknown-word": _same({"env": ["math", "poetry"]}),
    "enum-not-str": _same({"env": [1, 2]}),
    "object-unpackable": _same({"obj": [object(), object()]}),
    "scalar-tensor": lambda s: {"score": torch.tensor(1.0)},
    "jagged-mismatched": lambda s: {"tokens": [torch.arange(3)]},
    "jagged-not-tensors": _same({"tokens": [[1, 2], [3]]}),
    "sparse": lambda s: {"score": torch.ones(2).to_sparse()},
    "surrogate-name": lambda s: {"sc" + SURROGATE: torch.ones(2)},
    "surrogate-enum-word": _same({"env": ["math", SURROGATE]}),
}

TAGS_BAD = {
    "str": _same("x"),
    "dict": _same({"a": 1}),
    "ints": _same([1, 2]),
    "too-many": _same([{}, {}, {}]),
    "unhashable-group": _same([{"group_id": []}, {"group_id": []}]),
    "set-value": _same([{"k": {1}}, {"k": {2}}]),
    "object-value": _same([{"k": object()}, {}]),
    "surrogate-value": _same([{"k": SURROGATE}, {}]),
    "surrogate-key": _same([{SURROGATE: 1}, {}]),
}

COUNT_BAD = {
    "zero": _same(0),
    "negative": _same(-1),
    "float": _same(1.5),
    "nan": _same(NAN),
    "inf": _same(INF),
    "bool": _same(True),
    "str": _same("8"),
    "list": _same([2]),
}

SECONDS_BAD = {
    "nan": _same(NAN),
    "inf": _same(INF),
    "-inf": _same(-INF),
    "negative": _same(-1.0),
    "str": _same("1"),
    "bool": _same(True),
    "list": _same([1.0]),
    "complex": _same(1j),
}

TASK_BAD = {
    "unknown": _same("nope"),
    "int": _same(5),
    "empty": _same(""),
    "list": _same(["train"]),
    "huge": _same("t" * 5000),
    "none": _same(None),
    "bytes": _same(b"train"),
    "dict": _same({"train": 1}),
    "bool": _same(True),
    "surrogate": _same("train" + SURROGATE),
}

DP_RANK_BAD = {
    "str": _same("x"),
    "negative": _same(-1),
    "bool": _same(True),
    "float": _same(1.0),
    "nan": _same(NAN),
    "list": _same([0]),
}


def _meta_bad(s) -> dict:
    pid = s["pid"]
    return {
        "none": _same(None),
        "str": _same("meta"),
        "dict": _same({"partition_id": pid, "sample_ids": ["s0"]}),
        "unknown-ids": _same(KVBatchMeta(pid, None, ["never-written"], fields=["score"])),
        "unknown-partition": _same(KVBatchMeta("no-such-partition", None, ["s0"], ["score"])),
        "no-fields": _same(KVBatchMeta(pid, None, ["s0"])),
        "unknown-field": _same(KVBatchMeta(pid, None, ["s0"], ["nope"])),
        "surrogate-partition": _same(KVBatchMeta("p" + SURROGATE, None, ["s0"], ["score"])),
        "surrogate-id": _same(KVBatchMeta(pid, None, ["s" + SURROGATE], ["score"])),
        "surrogate-field": _same(KVBatchMeta(pid, None, ["s0"], ["sc" + SURROGATE])),
    }


def _lease_meta_bad(s) -> dict:
    pid, ref = s["pid"], s["ref"]
    return {
        "no-lease": _same(s["train"]),
        "task-none": _same(KVBatchMeta(pid, None, ["s0"], extra_info={"lease_id": 1})),
        "task-unknown": _same(KVBatchMeta(pid, "nope", ["s0"], extra_info=dict(ref.extra_info))),
        "task-without-lease": _same(
            KVBatchMeta(pid, "train", ["s0"], extra_info=dict(ref.extra_info))
        ),
        "unknown-ids": _same(KVBatchMeta(pid, "ref", ["never"], extra_info=dict(ref.extra_info))),
        "unknown-partition": _same(
            KVBatchMeta("no-such-partition", "ref", ["s0"], extra_info=dict(ref.extra_info))
        ),
        "lease-id-str": _same(KVBatchMeta(pid, "ref", ["s0"], extra_info={"lease_id": "x"})),
        "lease-id-nan": _same(KVBatchMeta(pid, "ref", ["s0"], extra_info={"lease_id": NAN})),
        "lease-id-zero": _same(KVBatchMeta(pid, "ref", ["s0"], extra_info={"lease_id": 0})),
        "lease-id-bool": _same(KVBatchMeta(pid, "ref", ["s0"], extra_info={"lease_id": True})),
        "task-int": _same(KVBatchMeta(pid, 5, ["s0"], extra_info=dict(ref.extra_info))),
        "surrogate-task": _same(
            KVBatchMeta(pid, "ref" + SURROGATE, ["s0"], extra_info=dict(ref.extra_info))
        ),
        "surrogate-id": _same(
            KVBatchMeta(pid, "ref", ["s" + SURROGATE], extra_info=dict(ref.extra_info))
        ),
        "surrogate-partition": _same(
            KVBatchMeta("p" + SURROGATE, "ref", ["s0"], extra_info=dict(ref.extra_info))
        ),
    }


def _register_args(pid: str) -> dict:
    """Well-formed keyword arguments of register_partition: every one given."""
    return {
        "partition_id": pid,
        "fields": ["a"],
        "num_samples": None,
        "consumer_tasks": ["t"],
        "grpo_group_size": None,
        "enums": None,
        "object_fields": (),
        "task_leases": None,
    }


def _claim_args(pid: str, *, blocking: bool) -> dict:
    """Well-formed keyword arguments of claim_meta: every one given."""
    return {
        "partition_id": pid,
        "task_name": "train",
        "required_fields": ["tokens"],
        "batch_size": 2,
        "dp_rank": None,
        "blocking": blocking,
        "timeout_s": 0.2,
    }


def _without(pool: dict, *labels: str) -> dict:
    return {k: v for k, v in pool.items() if k not in labels}


def _put_fields(s) -> dict:
    return {"score": torch.ones(2), "tokens": [torch.arange(2), torch.arange(3)]}


# verb -> (well-formed keyword arguments, {argument: pool of malformed values}). A
# verb whose well-formed call would change the store (put, clear, delete, reset,
# register) always gets at least one of its must-break arguments replaced.
def _verbs(s) -> dict:
    pid = s["pid"]
    fresh = f"fresh-{uuid.uuid4().hex[:6]}"
    return {
        "register_partition": (
            _register_args(fresh),
            {
                "partition_id": PARTITION_BAD,
                "fields": _without(NAMES_BAD, "empty"),  # no fields: well-formed
                "num_samples": _without(COUNT_BAD, "zero"),  # a size of 0: well-formed
                "consumer_tasks": _without(NAMES_BAD, "empty"),
                "grpo_group_size": COUNT_BAD,
                "enums": {
                    "str": _same("x"),
                    "word-str": _same({"f": "abc"}),
                    "empty-vocabulary": _same({"f": []}),
                    "duplicate-words": _same({"f": ["a", "a"]}),
                    "int-words": _same({"f": [1]}),
                    "int-key": _same({1: ["a"]}),
                    "list": _same(["f"]),
                    "none-vocabulary": _same({"f": None}),
                    "surrogate-word": _same({"f": ["a", "b" + SURROGATE]}),
                    "surrogate-field": _same({"f" + SURROGATE: ["a"]}),
                },
                "object_fields": {
                    "bare-str": _same("x"),
                    "ints": _same([1]),
                    "empty-name": _same([""]),
                    "int": _same(5),
                    "surrogate": _same(["o" + SURROGATE]),
                },
                "task_leases": {
                    "negative": _same({"t": -1.0}),
                    "nan": _same({"t": NAN}),
                    "inf": _same({"t": INF}),
                    "unknown-task": _same({"u": 1.0}),
                    "str-lease": _same({"t": "1"}),
                    "none-lease": _same({"t": None}),
                    "int-key": _same({1: 1.0}),
                    "surrogate-key": _same({"t" + SURROGATE: 1.0}),
                },
            },
            # The existing partition too: a refused re-register must leave it intact.
            {"partition_id": {"existing": _same(pid)}},
        ),
        "put_samples": (
            {
                "sample_ids": ["new-a", "new-b"],
                "partition_id": pid,
                "fields": _put_fields(s),
                "tags": None,
            },
            {
                "sample_ids": IDS_BAD | {"existing": _same(["s0", "s1"])},
                "partition_id": PARTITION_BAD | PARTITION_UNKNOWN,
                "fields": FIELDS_BAD,
                "tags": TAGS_BAD,
            },
            {},
        ),
        "get_samples": (
            {"sample_ids": ["s0", "s1"], "partition_id": pid, "select_fields": ["score"]},
            {
                "sample_ids": IDS_BAD | IDS_UNKNOWN,
                "partition_id": PARTITION_BAD | PARTITION_UNKNOWN,
                "select_fields": NAMES_BAD | {"unknown": _same(["nope"])},
            },
            {},
        ),
        "get_data": (
            {"meta": KVBatchMeta(pid, None, ["s0", "s1"], ["score"]), "select_fields": None},
            {
                "meta": _meta_bad(s),
                "select_fields": NAMES_BAD
                | {"unknown": _same(["nope"])}
                | {"none": _same(None)},  # with a meta that has fields: well-formed
            },
            {},
        ),
        "claim_meta": (
            _claim_args(pid, blocking=True),
            {
                "partition_id": PARTITION_BAD | PARTITION_UNKNOWN,
                "task_name": TASK_BAD,
                "required_fields": NAMES_BAD | {"unknown": _same(["nope"]), "empty": _same([])},
                "batch_size": COUNT_BAD | {"huge": _same(2**80)},
                "timeout_s": SECONDS_BAD,
                "dp_rank": DP_RANK_BAD,
                "blocking": {
                    "false": _same(False),
                    "str": _same("no"),
                    "none": _same(None),
                    "int": _same(1),
                },
            },
            {},
        ),
        "ack": ({"meta": s["ref"]}, {"meta": _lease_meta_bad(s)}, {}),
        "consumption_detail": (
            {"partition_id": pid, "task_names": TASKS},
            {
                "partition_id": PARTITION_BAD | PARTITION_UNKNOWN,
                "task_names": NAMES_BAD | {"unknown": _same(["nope"])},
            },
            {},
        ),
        "check_consumption_status": (
            {"partition_id": pid, "task_names": ["train"]},
            {
                "partition_id": PARTITION_BAD | PARTITION_UNKNOWN,
                "task_names": NAMES_BAD | {"unknown": _same(["nope"])},
            },
            {},
        ),
        "clear_samples": (
            {"sample_ids": ["s0"], "partition_id": pid},
            {
                "sample_ids": {k: v for k, v in (IDS_BAD | IDS_UNKNOWN).items() if k != "none"},
                "partition_id": PARTITION_BAD | PARTITION_UNKNOWN,
            },
            {},
        ),
        "delete_partition": (
            {"partition_id": pid},
            {"partition_id": PARTITION_BAD | PARTITION_UNKNOWN},
            {},
        ),
        "reset_consumption": (
            {"partition_id": pid, "task_name": "train"},
            {"partition_id": PARTITION_BAD | PARTITION_UNKNOWN, "task_name": TASK_BAD},
            {},
        ),
        "commit_step": (
            {"partition_id": pid, "task_name": "train", "step": 0},
            {
                "partition_id": PARTITION_BAD | PARTITION_UNKNOWN,
                "task_name": TASK_BAD,
                "step": _without(COUNT_BAD, "zero"),  # step 0 is a step
            },
            {},
        ),
        "rewind_to_step": (  # None: before the first step, well-formed
            {"partition_id": pid, "task_name": "train", "step": None},
            {
                "partition_id": PARTITION_BAD | PARTITION_UNKNOWN,
                "task_name": TASK_BAD,
                "step": _without(COUNT_BAD, "zero") | {"uncommitted": _same(10**6)},
            },
            {},
        ),
    }


# Well-formed calls that would change the store: at least one argument must break them.
MUTATING = {"register_partition", "put_samples", "clear_samples", "delete_partition",
            "reset_consumption", "commit_step", "rewind_to_step"}  # fmt: skip


def _untyped(exc: BaseException | None) -> bool:
    return exc is not None and not (isinstance(exc, DataPlaneError) and isinstance(exc, BUILTINS))


# The verbs both clients have.
VERBS = [
    "register_partition",
    "put_samples",
    "get_samples",
    "get_data",
    "claim_meta",
    "ack",
    "reset_consumption",
    "commit_step",
    "rewind_to_step",
    "check_consumption_status",
    "consumption_detail",
    "clear_samples",
    "delete_partition",
]


@pytest.mark.parametrize("verb", VERBS)
@SETTINGS
@given(data=st.data())
def test_malformed_arguments_get_typed_errors_and_leave_the_store_unchanged(store, verb, data):
    c = store["client"]
    base, pools, extra = _verbs(store)[verb]
    broken = data.draw(st.sets(st.sampled_from(sorted(pools)), min_size=1), label="broken")
    kwargs = dict(base)
    chosen = {}
    for arg in sorted(broken):
        label = data.draw(st.sampled_from(sorted(pools[arg])), label=arg)
        kwargs[arg] = pools[arg][label](store)
        chosen[arg] = label
    if (
        verb == "register_partition"
        and "partition_id" not in broken
        and data.draw(st.booleans(), label="existing")
    ):
        kwargs["partition_id"] = extra["partition_id"]["existing"](store)
        chosen["partition_id"] = "existing"
    TRIED[f"{store['kind']}.{verb}"] += 1
    try:
        getattr(c, verb)(**kwargs)
    except Exception as e:  # noqa: BLE001 - judged below
        raised: BaseException | None = e
    else:
        raised = None
    assert not _untyped(raised), f"{verb}({chosen}) raised {raised!r}"
    if verb in MUTATING:
        assert raised is not None, f"{verb}({chosen}) was accepted"
    assert _snapshot(c, store["pid"]) == store["before"], f"{verb}({chosen}) changed the store"


def test_the_fuzzed_store_still_serves_well_formed_calls(store):
    """After the malformed calls, the same store answers a well-formed read bit for bit."""
    c, pid = store["client"], store["pid"]
    got = c.get_samples(["s2", "s3"], pid, ["tokens", "score"])
    assert [t.tolist() for t in got["tokens"].unbind()] == [[0, 1, 2], [0, 1, 2, 3]]
    assert got["score"].tolist() == [2.0, 3.0]
    assert c.check_consumption_status(pid, TASKS)


# ---- wrong types and strings UTF-8 cannot carry: InvalidBatch naming the argument -----------
# Every argument of every verb, one at a time, sync and awaited: each value must be refused
# as InvalidBatch (the same class on both clients), the message must name what was wrong,
# and the store must be as it was. A label's value is the value itself, or _Named(value,
# needle) when the message names something more precise than the argument.


class _Named:
    def __init__(self, value, needle: str):
        self.value, self.needle = value, needle


def _mapping_wrong(needle: str, key: str, entries: dict) -> dict:
    """Wrong values for a mapping argument keyed like `key`, each named by `needle`: not a
    mapping at all (int, str, bytes, NaN, bool, list), then `entries`' wrong contents."""
    not_a_mapping = {
        "int": 5,
        "str": key,
        "bytes": key.encode(),
        "float-nan": NAN,
        "bool": True,
        "list": [key],
    }
    return {k: _Named(v, needle) for k, v in {**not_a_mapping, **entries}.items()}


STR_WRONG = {
    "none": None,
    "int": 5,
    "bytes": b"train",
    "float-nan": NAN,
    "list": ["train"],
    "dict": {"train": 1},
    "bool": True,
    "empty": "",
    "surrogate": "train" + SURROGATE,
    "fsdecoded": FSDECODED,
}
PARTITION_WRONG = STR_WRONG | {"huge": "p" * 5000}
NAMES_WRONG = {
    "none": None,
    "int": 5,
    "bytes": b"score",
    "float-nan": NAN,
    "str": "score",
    "dict": {"score": 1},
    "bool": True,
    "none-in-list": ["score", None],
    "int-in-list": [5],
    "bytes-in-list": [b"score"],
    "nan-in-list": [NAN],
    "empty-name": [""],
    "nested": [["score"]],
    "surrogate": ["score", "sc" + SURROGATE],
    "fsdecoded": [FSDECODED],
}
IDS_WRONG = NAMES_WRONG | {
    "duplicate": ["s0", "s0"],
    "huge-id": ["x" * 5000],
    # Many plain ids and one that is no UTF-8: the large-list fast path must not miss it.
    "many-one-surrogate": [f"n{i}" for i in range(5000)] + ["n" + SURROGATE],
}
INT_WRONG = {
    "none": None,
    "str": "1",
    "bytes": b"1",
    "float": 1.0,
    "float-nan": NAN,
    "list": [1],
    "dict": {"a": 1},
    "bool": True,
    "negative": -1,
}
SECONDS_WRONG = {
    "none": None,
    "str": "1",
    "bytes": b"1",
    "float-nan": NAN,
    "inf": INF,
    "negative": -1.0,
    "list": [1.0],
    "dict": {"a": 1.0},
    "bool": True,
}
BOOL_WRONG = {
    "none": None,
    "int": 1,
    "str": "no",
    "bytes": b"",
    "float-nan": NAN,
    "list": [True],
    "dict": {},
}
DIRECTORY_WRONG = {
    "none": None,
    "int": 5,
    "bytes": b"/tmp/x",
    "float-nan": NAN,
    "list": ["/tmp/x"],
    "dict": {"/tmp/x": 1},
    "bool": True,
    "empty": "",
    "surrogate": "/tmp/x" + SURROGATE,
    "nul": "/tmp/x\x00y",
}


def _wrong(s) -> dict:
    """verb -> (well-formed keyword arguments, {argument: {label: wrong value}})."""
    pid, ref = s["pid"], s["ref"]
    lease = dict(ref.extra_info)

    def meta(**kw):
        return KVBatchMeta(**{"partition_id": pid, "sample_ids": ["s0"], **kw})

    not_a_meta = {k: _Named(v, "meta") for k, v in STR_WRONG.items()}
    return {
        "register_partition": (
            # The existing partition: a refused re-register must leave it as it was.
            _register_args(pid),
            {
                "partition_id": PARTITION_WRONG,
                "fields": NAMES_WRONG,
                "num_samples": _without(INT_WRONG, "none"),
                "consumer_tasks": NAMES_WRONG,
                "grpo_group_size": _without(INT_WRONG, "none"),
                "enums": _mapping_wrong(
                    "enum",
                    "f",
                    {
                        "word-str": {"f": "abc"},
                        "words-none": {"f": None},
                        "word-int": {"f": ["a", 1]},
                        "word-none": {"f": ["a", None]},
                        "field-int": {1: ["a"]},
                        "surrogate-word": {"f": ["a", "b" + SURROGATE]},
                        "surrogate-field": {"f" + SURROGATE: ["a"]},
                    },
                ),
                "object_fields": _without(NAMES_WRONG, "none"),  # None: no object fields
                "task_leases": _mapping_wrong(
                    "lease",
                    "t",
                    {
                        "lease-str": {"t": "1"},
                        "lease-none": {"t": None},
                        "lease-nan": {"t": NAN},
                        "lease-bool": {"t": True},
                        "key-int": {1: 1.0},
                        "key-bytes": {b"t": 1.0},
                        "surrogate-key": {"t" + SURROGATE: 1.0},
                    },
                ),
            },
        ),
        "put_samples": (
            {
                "sample_ids": ["new-a", "new-b"],
                "partition_id": pid,
                "fields": _put_fields(s),
                "tags": None,
                "overwrite": False,
            },
            {
                "sample_ids": IDS_WRONG,
                "partition_id": PARTITION_WRONG,
                "fields": {
                    "none": None,
                    "int": 5,
                    "str": "score",
                    "bytes": b"score",
                    "float-nan": NAN,
                    "list": ["score"],
                    "bool": True,
                    "name-int": {1: torch.ones(2)},
                    "name-empty": {"": torch.ones(2)},
                    "name-surrogate": {"sc" + SURROGATE: torch.ones(2)},
                    "name-fsdecoded": {FSDECODED: torch.ones(2)},
                },
                "tags": {
                    "str": "x",
                    "int": 5,
                    "bool": True,
                    "float-nan": NAN,
                    "dict": {"a": 1},
                    "ints": [1, 2],
                    "surrogate-value": [{"k": SURROGATE}, {}],
                    "surrogate-key": [{SURROGATE: 1}, {}],
                },
                "overwrite": BOOL_WRONG,
            },
        ),
        "get_samples": (
            {"sample_ids": ["s0", "s1"], "partition_id": pid, "select_fields": ["score"]},
            {
                "sample_ids": IDS_WRONG,
                "partition_id": PARTITION_WRONG,
                "select_fields": NAMES_WRONG,
            },
        ),
        "get_data": (
            {"meta": meta(fields=["score"]), "select_fields": None},
            {
                "meta": not_a_meta
                | {
                    "surrogate-partition": _Named(
                        KVBatchMeta("p" + SURROGATE, None, ["s0"], ["score"]), "partition_id"
                    ),
                    "surrogate-id": _Named(
                        meta(sample_ids=["s" + SURROGATE], fields=["score"]), "sample_ids"
                    ),
                    "surrogate-field": _Named(meta(fields=["sc" + SURROGATE]), "select_fields"),
                },
                "select_fields": _without(NAMES_WRONG, "none"),  # None: the meta's fields
            },
        ),
        "claim_meta": (
            _claim_args(pid, blocking=False),
            {
                "partition_id": PARTITION_WRONG,
                "task_name": STR_WRONG,
                "required_fields": NAMES_WRONG,
                "batch_size": INT_WRONG | {"zero": 0},
                "dp_rank": _without(INT_WRONG, "none"),
                "blocking": BOOL_WRONG,
                "timeout_s": SECONDS_WRONG,
            },
        ),
        "ack": (
            {"meta": ref},
            {
                "meta": not_a_meta
                | {
                    "no-lease": _Named(meta(task_name="ref"), "lease"),
                    "task-int": _Named(meta(task_name=5, extra_info=lease), "meta.task_name"),
                    "task-empty": _Named(meta(task_name="", extra_info=lease), "meta.task_name"),
                    "task-surrogate": _Named(
                        meta(task_name="ref" + SURROGATE, extra_info=lease), "meta.task_name"
                    ),
                    "ids-empty": _Named(
                        meta(task_name="ref", sample_ids=[], extra_info=lease), "meta.sample_ids"
                    ),
                    "id-surrogate": _Named(
                        meta(task_name="ref", sample_ids=["s" + SURROGATE], extra_info=lease),
                        "meta.sample_ids",
                    ),
                    "partition-surrogate": _Named(
                        KVBatchMeta("p" + SURROGATE, "ref", ["s0"], extra_info=lease),
                        "partition_id",
                    ),
                }
                | {
                    f"lease-id-{k}": _Named(
                        meta(task_name="ref", extra_info={"lease_id": v}), "lease_id"
                    )
                    for k, v in {
                        "str": "1",
                        "float": 1.0,
                        "float-nan": NAN,
                        "bool": True,
                        "zero": 0,
                        "list": [1],
                    }.items()
                },
            },
        ),
        "reset_consumption": (
            {"partition_id": pid, "task_name": "train"},
            {"partition_id": PARTITION_WRONG, "task_name": STR_WRONG},
        ),
        "commit_step": (
            {"partition_id": pid, "task_name": "train", "step": 0},
            {"partition_id": PARTITION_WRONG, "task_name": STR_WRONG, "step": INT_WRONG},
        ),
        "rewind_to_step": (
            {"partition_id": pid, "task_name": "train", "step": 0},
            {
                "partition_id": PARTITION_WRONG,
                "task_name": STR_WRONG,
                "step": _without(INT_WRONG, "none"),  # None: before the first step
            },
        ),
        "check_consumption_status": (
            {"partition_id": pid, "task_names": TASKS},
            {"partition_id": PARTITION_WRONG, "task_names": NAMES_WRONG},
        ),
        "consumption_detail": (
            {"partition_id": pid, "task_names": TASKS},
            {"partition_id": PARTITION_WRONG, "task_names": NAMES_WRONG},
        ),
        "clear_samples": (
            {"sample_ids": ["s0"], "partition_id": pid},
            # sample_ids=None deletes the partition: well-formed, not tried here.
            {"sample_ids": _without(IDS_WRONG, "none"), "partition_id": PARTITION_WRONG},
        ),
        "delete_partition": ({"partition_id": pid}, {"partition_id": PARTITION_WRONG}),
        # Ray client only (the in-process one has no such verbs).
        "describe_partition": ({"partition_id": pid}, {"partition_id": PARTITION_WRONG}),
        "checkpoint": ({"directory": "unused"}, {"directory": DIRECTORY_WRONG}),
        "restore": ({"directory": "unused"}, {"directory": DIRECTORY_WRONG}),
    }


WRONG_VERBS = [*VERBS, "describe_partition", "checkpoint", "restore"]


def _call(c, verb: str, awaited: bool, kwargs: dict) -> BaseException | None:
    try:
        if awaited:
            asyncio.run(getattr(c, f"{verb}_async")(**kwargs))
        else:
            getattr(c, verb)(**kwargs)
    except Exception as e:  # noqa: BLE001 - judged by the caller
        return e
    return None


@pytest.mark.parametrize("verb", WRONG_VERBS)
def test_wrong_types_and_unencodable_strings_are_invalid_batch_naming_the_argument(store, verb):
    c = store["client"]
    if not hasattr(c, verb):
        pytest.skip(f"the {store['kind']} client has no {verb}")
    base, pools = _wrong(store)[verb]
    assert set(pools) <= set(base), "every argument tried is one the verb takes"
    wrong = []
    for arg, pool in pools.items():
        for label, value in pool.items():
            needle = value.needle if isinstance(value, _Named) else arg
            kwargs = {**base, arg: value.value if isinstance(value, _Named) else value}
            for awaited in (False, True):
                TRIED[f"{store['kind']}.{verb}.wrong"] += 1
                raised = _call(c, verb, awaited, kwargs)
                call = f"{verb}{'_async' if awaited else ''}({arg}={label})"
                if not isinstance(raised, InvalidBatch):
                    wrong.append(f"{call} raised {raised!r:.300}, not InvalidBatch")
                elif needle not in str(raised):
                    wrong.append(f"{call}: {str(raised)[:200]!r} does not name {needle!r}")
            if _snapshot(c, store["pid"]) != store["before"]:
                wrong.append(f"{verb}({arg}={label}) changed the store")
                store["before"] = _snapshot(c, store["pid"])  # judge the next one on its own
    assert wrong == []


# ---- regressions: raw exceptions where a typed error was due (fixed) -----------------------------


def _kinds():
    return pytest.mark.parametrize("kind", ["ray", "in_process"])


def _client(request, kind):
    return request.getfixturevalue("client") if kind == "ray" else InProcessDataPlaneClient()


def _raises_typed(call) -> BaseException | None:
    try:
        call()
    except Exception as e:  # noqa: BLE001 - judged by the caller
        return e
    return None


@_kinds()
@pytest.mark.parametrize("meta", [None, "meta", {"partition_id": "p"}], ids=["none", "str", "dict"])
def test_a_meta_that_is_not_a_kvbatchmeta_is_invalid_batch(request, kind, meta):
    c = _client(request, kind)
    for call in (lambda: c.ack(meta), lambda: c.get_data(meta, ["x"])):
        raised = _raises_typed(call)
        assert isinstance(raised, InvalidBatch), repr(raised)
        assert "KVBatchMeta as meta" in str(raised)


@_kinds()
def test_task_leases_that_is_not_a_mapping_is_invalid_batch(request, kind):
    c = _client(request, kind)
    raised = _raises_typed(
        lambda: c.register_partition(f"tl-{uuid.uuid4().hex[:6]}", [], None, ["t"], task_leases="t")
    )
    assert isinstance(raised, InvalidBatch), repr(raised)
    assert "task_leases" in str(raised)


@_kinds()
@pytest.mark.parametrize("partition_id", [["p"], {"p"}, {"p": 1}], ids=["list", "set", "dict"])
def test_an_unhashable_partition_id_is_invalid_batch_naming_it_on_every_verb(
    request, kind, partition_id
):
    c = _client(request, kind)
    calls = [
        lambda: c.get_samples(["s0"], partition_id, ["x"]),
        lambda: c.claim_meta(partition_id, "t", [], 1, blocking=False),
        lambda: c.check_consumption_status(partition_id, ["t"]),
        lambda: c.clear_samples(["s0"], partition_id),
        lambda: c.delete_partition(partition_id),
        lambda: c.reset_consumption(partition_id, "t"),
    ]
    raised = [_raises_typed(call) for call in calls]
    assert [r for r in raised if r is None or _untyped(r)] == []  # nothing raw, first
    assert [r for r in raised if not isinstance(r, InvalidBatch)] == []
    assert [r for r in raised if "partition_id" not in str(r)] == []


@_kinds()
def test_a_sparse_tensor_field_is_invalid_batch(request, kind):
    c = _client(request, kind)
    pid = f"sp-{uuid.uuid4().hex[:6]}"
    c.register_partition(pid, ["x"], None, [])
    raised = _raises_typed(lambda: c.put_samples(["a", "b"], pid, {"x": torch.ones(2).to_sparse()}))
    assert isinstance(raised, InvalidBatch), repr(raised)
    assert isinstance(_raises_typed(lambda: c.get_samples(["a"], pid, ["x"])), KeyError)


def _kept(c, pid: str) -> None:
    """The partition ``_registered`` made is there as it was: its samples, its task."""
    got = c.get_samples(["a", "b"], pid, ["x"])
    assert got["x"].tolist() == [0.0, 1.0]
    assert [t.task for t in c.consumption_detail(pid, ["t"])] == ["t"]
    meta = c.claim_meta(pid, "t", ["x"], 2, blocking=False)
    assert sorted(meta.sample_ids) == ["a", "b"]


def _registered(c) -> str:
    pid = f"sur-{uuid.uuid4().hex[:6]}"
    c.register_partition(pid, ["x"], None, ["t"])
    c.put_samples(["a", "b"], pid, {"x": torch.arange(2.0)})
    return pid


@_kinds()
def test_registering_again_with_a_lone_surrogate_task_name_keeps_the_partition(request, kind):
    """It passed the checks; the controller deleted the old partition and then failed to
    journal the new one (a raw UnicodeEncodeError); the in-process client took it."""
    c = _client(request, kind)
    pid = _registered(c)
    with pytest.raises(InvalidBatch, match="consumer_tasks"):
        c.register_partition(pid, ["x"], None, ["t" + SURROGATE])
    with pytest.raises(InvalidBatch, match="task_leases"):
        c.register_partition(pid, ["x"], None, ["t"], task_leases={"t" + SURROGATE: 1.0})
    with pytest.raises(InvalidBatch, match="enum"):
        c.register_partition(pid, ["x"], None, ["t"], enums={"e": ["a" + SURROGATE]})
    _kept(c, pid)


@_kinds()
def test_a_lone_surrogate_sample_id_is_invalid_batch(request, kind):
    """A raw UnicodeEncodeError on the Ray client; stored by the in-process one."""
    c = _client(request, kind)
    pid = _registered(c)
    for ids in (["c" + SURROGATE], ["c", FSDECODED], [f"c{i}" for i in range(8192)] + [SURROGATE]):
        n = len(ids)
        with pytest.raises(InvalidBatch, match="sample_ids") as e:
            c.put_samples(ids, pid, {"x": torch.zeros(n)})
        assert e.value.ids == [s for s in ids if not s.isascii()]
    _kept(c, pid)


@_kinds()
@pytest.mark.parametrize("dp_rank", ["x", -1, True, 1.0, [0]], ids=str)
def test_a_dp_rank_that_is_not_an_int_of_at_least_0_is_invalid_batch(request, kind, dp_rank):
    c = _client(request, kind)
    pid = _registered(c)
    with pytest.raises(InvalidBatch, match="dp_rank"):
        c.claim_meta(pid, "t", ["x"], 2, dp_rank=dp_rank, blocking=False)
    _kept(c, pid)
    c.reset_consumption(pid, "t")
    assert c.claim_meta(pid, "t", ["x"], 2, dp_rank=3, blocking=False).extra_info["dp_rank"] == 3
