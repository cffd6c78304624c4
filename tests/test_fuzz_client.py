"""Bad input to every public client verb, on the Ray client and the in-process client.

Each example starts from a well-formed call and replaces one or more arguments with a
malformed value (wrong type, NaN/inf/negative numbers, huge or duplicate ids,
unhashable tags, empty field lists, mismatched lengths, non-tensor leaves, meta-device
tensors, object arrays, unknown names). What must hold: the call returns or raises a
typed error from ``dataplane_client.errors`` that is also the matching built-in, never
anything else; it never hangs (pytest-timeout); and the store is unchanged afterwards
(partition description, consumption, every sample's bytes, the partitions that exist).

The bugs this file found (raw errors for a non-meta, non-mapping leases,
unhashable partition ids, sparse tensors) are fixed; their regression tests
are at the end.
Inputs tried per surface are printed at the end of the module.
"""

from __future__ import annotations

import uuid
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataplane_client import KVBatchMeta
from dataplane_client.errors import DataPlaneError
from dataplane_server.inprocess import InProcessDataPlaneClient

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
}

TAGS_BAD = {
    "str": _same("x"),
    "dict": _same({"a": 1}),
    "ints": _same([1, 2]),
    "too-many": _same([{}, {}, {}]),
    "unhashable-group": _same([{"group_id": []}, {"group_id": []}]),
    "set-value": _same([{"k": {1}}, {"k": {2}}]),
    "object-value": _same([{"k": object()}, {}]),
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
            {
                "partition_id": fresh,
                "fields": ["a"],
                "num_samples": None,
                "consumer_tasks": ["t"],
                "grpo_group_size": None,
                "enums": None,
                "object_fields": (),
                "task_leases": None,
            },
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
                },
                "object_fields": {
                    "bare-str": _same("x"),
                    "ints": _same([1]),
                    "empty-name": _same([""]),
                    "int": _same(5),
                },
                "task_leases": {
                    "negative": _same({"t": -1.0}),
                    "nan": _same({"t": NAN}),
                    "inf": _same({"t": INF}),
                    "unknown-task": _same({"u": 1.0}),
                    "str-lease": _same({"t": "1"}),
                    "none-lease": _same({"t": None}),
                    "int-key": _same({1: 1.0}),
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
            {
                "partition_id": pid,
                "task_name": "train",
                "required_fields": ["tokens"],
                "batch_size": 2,
                "dp_rank": None,
                "blocking": True,
                "timeout_s": 0.2,
            },
            {
                "partition_id": PARTITION_BAD | PARTITION_UNKNOWN,
                "task_name": TASK_BAD,
                "required_fields": NAMES_BAD | {"unknown": _same(["nope"]), "empty": _same([])},
                "batch_size": COUNT_BAD | {"huge": _same(2**80)},
                "timeout_s": SECONDS_BAD,
                "blocking": {"false": _same(False)},
            },
            {},
        ),
        "ack": ({"meta": s["ref"]}, {"meta": _lease_meta_bad(s)}, {}),
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
    }


# Well-formed calls that would change the store: at least one argument must break them.
MUTATING = {"register_partition", "put_samples", "clear_samples", "delete_partition",
            "reset_consumption"}  # fmt: skip


def _untyped(exc: BaseException | None) -> bool:
    return exc is not None and not (isinstance(exc, DataPlaneError) and isinstance(exc, BUILTINS))


@pytest.mark.parametrize(
    "verb",
    [
        "register_partition",
        "put_samples",
        "get_samples",
        "get_data",
        "claim_meta",
        "ack",
        "check_consumption_status",
        "clear_samples",
        "delete_partition",
        "reset_consumption",
    ],
)
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
        assert raised is not None
        assert not _untyped(raised), repr(raised)


@_kinds()
def test_task_leases_that_is_not_a_mapping_is_invalid_batch(request, kind):
    c = _client(request, kind)
    raised = _raises_typed(
        lambda: c.register_partition(f"tl-{uuid.uuid4().hex[:6]}", [], None, ["t"], task_leases="t")
    )
    assert raised is not None
    assert not _untyped(raised), repr(raised)


@_kinds()
@pytest.mark.parametrize("partition_id", [["p"], {"p"}, {"p": 1}], ids=["list", "set", "dict"])
def test_an_unhashable_partition_id_is_a_typed_error_on_every_verb(request, kind, partition_id):
    c = _client(request, kind)
    calls = [
        lambda: c.get_samples(["s0"], partition_id, ["x"]),
        lambda: c.claim_meta(partition_id, "t", [], 1, blocking=False),
        lambda: c.check_consumption_status(partition_id, ["t"]),
        lambda: c.clear_samples(["s0"], partition_id),
        lambda: c.delete_partition(partition_id),
        lambda: c.reset_consumption(partition_id, "t"),
    ]
    raw = [r for r in map(_raises_typed, calls) if r is None or _untyped(r)]
    assert raw == []


@_kinds()
def test_a_sparse_tensor_field_is_invalid_batch(request, kind):
    c = _client(request, kind)
    pid = f"sp-{uuid.uuid4().hex[:6]}"
    c.register_partition(pid, ["x"], None, [])
    raised = _raises_typed(lambda: c.put_samples(["a", "b"], pid, {"x": torch.ones(2).to_sparse()}))
    assert raised is not None
    assert not _untyped(raised), repr(raised)
    assert isinstance(_raises_typed(lambda: c.get_samples(["a"], pid, ["x"])), KeyError)
