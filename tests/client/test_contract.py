"""NeMo-RL's DataPlaneClient contract, on both implementations: every method, every error.

Each test states one point of NeMo-RL's contract (in its docstring; where we differ
on purpose, docs/nemo_rl_contract.md says so and why) and runs on the Ray client (the session's service) and on the in-process twin.
The last test is a NeMo-RL-style trainer loop written only against the ABC.
"""

import asyncio
import threading
import uuid

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from dataplane_client import DataPlaneClient, KVBatchMeta
from dataplane_client.batching.batched_data_dict import BatchedDataDict
from dataplane_client.batching.preshard import shard_meta_for_dp
from dataplane_client.interface import DataPlaneService
from dataplane_client.wire.errors import (
    ClaimTimeout,
    FieldNotProduced,
    NonTensorField,
    SamplesNotFound,
    ServiceUnavailable,
    UnknownPartition,
    UnknownTask,
)
from dataplane_client.wire.messages import ClearResult, PartitionDescription, ServiceInfo
from dataplane_server.core.inprocess import InProcessDataPlaneClient

# The Ray case needs the session cluster (`ray` marker: make test-fast skips it).
IMPLS = [pytest.param("ray", marks=pytest.mark.ray), "in_process"]


@pytest.fixture(params=IMPLS)
def make_client(request):
    """A factory of clients of one store (several clients of the Ray service; the twin is
    one store per object, so it hands out itself)."""
    made = []
    if request.param == "ray":
        service = request.getfixturevalue("service")

        def make():
            made.append(service.client())
            return made[-1]
    else:
        twin = InProcessDataPlaneClient()

        def make():
            return twin

    yield make
    for c in made:
        c.close()


@pytest.fixture
def dp(make_client) -> DataPlaneClient:
    return make_client()


def _pid() -> str:
    return f"c-{uuid.uuid4().hex[:8]}"


def _rows(lengths, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g).to(dtype) for n in lengths]


def _fields(n, seed=0):
    lengths = [3 + (i * 5) % 7 for i in range(n)]
    return lengths, {
        "input_ids": torch.nested.nested_tensor(
            [torch.arange(m) + 100 * i for i, m in enumerate(lengths)], layout=torch.jagged
        ),
        "input_lengths": torch.tensor(lengths),
        "sample_mask": torch.rand(n, generator=torch.Generator().manual_seed(seed)),
        "generation_logprobs": _rows(lengths, torch.bfloat16, seed),
    }


def test_both_are_the_abc(dp):
    assert isinstance(dp, DataPlaneClient)


# ---- B. put / get ----------------------------------------------------------------------
def test_a_put_returns_a_meta_covering_the_ids_and_a_get_returns_a_tensordict_in_order(dp):
    """put_samples -> KVBatchMeta covering the ids; get_samples -> TensorDict batch_size=[n]
    in request order; dense stays dense, jagged comes back jagged, dtypes exact."""
    pid = _pid()
    dp.register_partition(pid, ["input_ids"], 6, ["t"])
    lengths, fields = _fields(6)
    ids = [f"s{i}" for i in range(6)]
    meta = dp.put_samples(ids, pid, fields)
    assert isinstance(meta, KVBatchMeta)
    assert (meta.partition_id, meta.sample_ids, meta.size) == (pid, ids, 6)
    assert sorted(meta.fields) == sorted(fields)
    assert meta.sequence_lengths == lengths
    order = [4, 1, 5, 0]
    td = dp.get_samples([ids[i] for i in order], pid, list(fields))
    assert isinstance(td, TensorDict)
    assert td.batch_size == torch.Size([4])
    assert not td["sample_mask"].is_nested
    assert torch.equal(td["sample_mask"], fields["sample_mask"][order])
    assert td["input_ids"].is_nested
    assert td["input_ids"].layout == torch.jagged
    assert [r.tolist() for r in td["input_ids"].unbind()] == [
        fields["input_ids"].unbind()[i].tolist() for i in order
    ]
    got_lp = td["generation_logprobs"].unbind()
    assert got_lp[0].dtype == torch.bfloat16
    assert all(
        torch.equal(got_lp[j], fields["generation_logprobs"][i]) for j, i in enumerate(order)
    )


@pytest.mark.parametrize("container", ["tensordict", "dict", "batched_data_dict"])
def test_put_accepts_a_tensordict_a_dict_or_a_batched_data_dict(dp, container):
    """fields is a TensorDict (accept plain dicts and BatchedDataDict too)."""
    pid = _pid()
    dp.register_partition(pid, ["x"], None, [])
    plain = {
        "x": torch.arange(6.0).reshape(3, 2),
        "j": [torch.ones(2), torch.ones(1), torch.ones(3)],
    }
    given = {
        "tensordict": lambda: TensorDict(
            {"x": plain["x"], "j": torch.nested.nested_tensor(plain["j"], layout=torch.jagged)},
            batch_size=[3],
        ),
        "dict": lambda: plain,
        "batched_data_dict": lambda: BatchedDataDict(plain),
    }[container]()
    dp.put_samples(["a", "b", "c"], pid, given)
    td = dp.get_samples(["c", "a"], pid, ["x", "j"])
    assert td["x"].tolist() == [[4.0, 5.0], [0.0, 1.0]]
    assert [len(r) for r in td["j"].unbind()] == [3, 2]


def test_a_non_tensor_leaf_is_a_type_error_saying_non_tensor_and_strings_go_through_enums(dp):
    """Non-tensor leaves -> TypeError whose message contains "non-tensor"; strings go
    through enums: the vocabulary is declared once, gets return the strings."""
    pid = _pid()
    dp.register_partition(pid, ["x"], None, [], enums={"env": ["math", "code"]})
    with pytest.raises(TypeError, match="non-tensor") as e:
        dp.put_samples(["a", "b"], pid, {"x": torch.zeros(2), "prompt": ["p", "q"]})
    assert isinstance(e.value, NonTensorField)
    assert e.value.fields == ["prompt"]
    with pytest.raises(SamplesNotFound):  # the refused put wrote nothing
        dp.get_samples(["a"], pid, ["x"])
    dp.put_samples(["a", "b", "c"], pid, {"x": torch.zeros(3), "env": ["code", "math", "code"]})
    assert dp.get_samples(["c", "b"], pid, ["env"]).get("env").tolist() == ["code", "math"]
    with pytest.raises(ValueError, match="'chess'"):
        dp.put_samples(["d"], pid, {"x": torch.zeros(1), "env": ["chess"]})
    with pytest.raises(ValueError, match="repeats"):
        dp.register_partition(_pid(), ["x"], None, [], enums={"env": ["a", "a"]})


def test_enums_and_object_fields_travel_with_the_partition_to_every_client(make_client):
    """A worker that did not register the partition gets the strings back (not codes) and can
    put enum strings and objects: the vocabulary is stored with the partition, not the client."""
    pid = _pid()
    make_client().register_partition(
        pid, ["x"], None, [], enums={"env": ["math", "code"]}, object_fields=["info"]
    )
    worker = make_client()
    worker.put_samples(
        ["a", "b"], pid, {"x": torch.zeros(2), "env": ["code", "math"], "info": [{"k": 1}, None]}
    )
    reader = make_client()
    got = reader.get_samples(["b", "a"], pid, ["env", "info"])
    assert got.get("env").tolist() == ["math", "code"]
    assert got.get("info").tolist() == [None, {"k": 1}]
    with pytest.raises(ValueError, match="'chess'"):
        reader.put_samples(["c"], pid, {"x": torch.zeros(1), "env": ["chess"]})


def test_declared_object_fields_carry_msgpack_values(dp):
    """Ours, opt-in: objects only in fields declared at registration (msgpack, never pickle)."""
    pid = _pid()
    dp.register_partition(pid, ["x"], None, [], object_fields=["info"])
    info = [{"k": [1, 2]}, None, "s"]
    dp.put_samples(["a", "b", "c"], pid, {"x": torch.zeros(3), "info": info})
    assert dp.get_samples(["c", "a"], pid, ["info"]).get("info").tolist() == ["s", {"k": [1, 2]}]
    with pytest.raises(ValueError, match="msgpack"):
        dp.put_samples(["d"], pid, {"info": [object()]})


def test_get_samples_touches_no_cursor(dp):
    """get_samples ... does not touch any consumption cursor."""
    pid = _pid()
    dp.register_partition(pid, ["x"], 2, ["t"])
    dp.put_samples(["a", "b"], pid, {"x": torch.zeros(2)})
    dp.get_samples(["a", "b"], pid, ["x"])
    assert not dp.check_consumption_status(pid, ["t"])
    assert sorted(dp.claim_meta(pid, "t", ["x"], 2).sample_ids) == ["a", "b"]


def test_get_samples_of_unknown_cleared_or_unproduced_is_a_key_error(dp):
    """Unknown or cleared ids -> KeyError; a field not produced -> KeyError."""
    pid = _pid()
    dp.register_partition(pid, ["x"], None, [])
    dp.put_samples(["a", "b"], pid, {"x": torch.zeros(2)})
    with pytest.raises(KeyError) as e:
        dp.get_samples(["a", "zz"], pid, ["x"])
    assert isinstance(e.value, SamplesNotFound)
    assert e.value.ids == ["zz"]
    dp.clear_samples(["a"], pid)
    with pytest.raises(KeyError):
        dp.get_samples(["a"], pid, ["x"])
    with pytest.raises(KeyError) as e:
        dp.get_samples(["b"], pid, ["y"])
    assert isinstance(e.value, FieldNotProduced)
    assert e.value.fields == ["y"]
    with pytest.raises(KeyError) as e:
        dp.get_samples(["b"], _pid(), ["x"])
    assert isinstance(e.value, UnknownPartition)
    with pytest.raises(ValueError, match="select_fields"):
        dp.get_samples(["b"], pid, [])


def test_a_bad_batch_is_a_value_error_that_writes_nothing(dp):
    """invalid argument or batch -> ValueError."""
    pid = _pid()
    dp.register_partition(pid, ["x"], None, [])
    with pytest.raises(ValueError, match="rows"):
        dp.put_samples(["a", "b"], pid, {"x": torch.zeros(3)})
    with pytest.raises(ValueError, match="duplicate"):
        dp.put_samples(["a", "a"], pid, {"x": torch.zeros(2)})
    with pytest.raises(KeyError):
        dp.get_samples(["a"], pid, ["x"])


# ---- A. claims, get_data, consumption -----------------------------------------------------
def test_a_claim_needs_every_required_field_produced(dp):
    """claim_meta claims samples whose required_fields are all produced; each write flips the
    produced bit of (sample, field): that is the stage-done signal."""
    pid = _pid()
    dp.register_partition(pid, ["x", "lp"], None, ["train"])
    dp.put_samples(["a", "b"], pid, {"x": torch.zeros(2)})
    assert not dp.claim_meta(pid, "train", ["x", "lp"], 1, blocking=False)
    dp.put_samples(["b"], pid, {"lp": [torch.ones(2)]})  # the write-back of one stage
    meta = dp.claim_meta(pid, "train", ["x", "lp"], 2, blocking=False)
    assert meta.sample_ids == ["b"]
    assert meta.task_name == "train"
    assert sorted(meta.fields) == ["lp", "x"]


def test_a_claim_advances_only_its_own_tasks_cursor(dp):
    """A claim advances that task's cursor: a claimed id is not returned to that task again."""
    pid = _pid()
    dp.register_partition(pid, ["x"], None, ["a", "b"])
    dp.put_samples([f"s{i}" for i in range(4)], pid, {"x": torch.arange(4.0)})
    first = dp.claim_meta(pid, "a", ["x"], 3)
    second = dp.claim_meta(pid, "a", ["x"], 3, blocking=False)
    assert len(first.sample_ids) == 3
    assert second.sample_ids == sorted(set(f"s{i}" for i in range(4)) - set(first.sample_ids))
    assert not dp.claim_meta(pid, "a", ["x"], 1, blocking=False)
    assert len(dp.claim_meta(pid, "b", ["x"], 4).sample_ids) == 4


def test_a_non_blocking_claim_with_nothing_ready_is_an_empty_meta_not_none(dp):
    """The ABC says claim_meta returns a KVBatchMeta; with nothing ready NeMo-RL returns an
    empty one (falsy), so ``while meta := claim(...)`` and ``meta.sample_ids`` both work."""
    pid = _pid()
    dp.register_partition(pid, ["x"], None, ["train"])
    for meta in (
        dp.claim_meta(pid, "train", ["x"], 2, blocking=False),
        asyncio.run(dp.claim_meta_async(pid, "train", ["x"], 2, blocking=False)),
    ):
        assert isinstance(meta, KVBatchMeta)
        assert (meta.partition_id, meta.task_name, meta.sample_ids) == (pid, "train", [])
        assert meta.fields == ["x"]
        assert len(meta) == 0
        assert not meta


def test_an_unknown_task_is_a_key_error_mentioning_it(dp):
    """A task name not registered for the partition -> KeyError mentioning the task."""
    pid = _pid()
    dp.register_partition(pid, ["x"], None, ["train"])
    dp.put_samples(["a"], pid, {"x": torch.zeros(1)})
    with pytest.raises(KeyError, match="trian") as e:
        dp.claim_meta(pid, "trian", ["x"], 1, blocking=False)
    assert isinstance(e.value, UnknownTask)
    with pytest.raises(KeyError, match="trian"):
        dp.check_consumption_status(pid, ["trian"])


def test_a_claim_that_runs_out_of_time_is_a_timeout_error(dp):
    """Timeout -> an error (ours: typed, also a TimeoutError)."""
    pid = _pid()
    dp.register_partition(pid, ["x"], None, ["t"])
    dp.put_samples(["a"], pid, {"x": torch.zeros(1)})
    with pytest.raises(TimeoutError, match="1 of 2") as e:
        dp.claim_meta(pid, "t", ["x"], 2, timeout_s=0.2)
    assert isinstance(e.value, ClaimTimeout)


def test_a_blocking_claim_is_served_by_a_later_put(make_client):
    """A blocking claim waits for the samples (here written by another client meanwhile)."""
    consumer, producer = make_client(), make_client()
    pid = _pid()
    consumer.register_partition(pid, ["x"], None, ["t"])
    got = {}
    waiter = threading.Thread(target=lambda: got.update(m=consumer.claim_meta(pid, "t", ["x"], 2)))
    waiter.start()
    producer.put_samples(["a", "b"], pid, {"x": torch.zeros(2)})
    waiter.join(timeout=60)
    assert not waiter.is_alive()
    assert sorted(got["m"].sample_ids) == ["a", "b"]


def test_get_data_reads_select_fields_else_meta_fields_else_raises(dp):
    """get_data: field set = select_fields, else meta.fields, else ValueError mentioning
    fields; a TensorDict with batch_size=[len] in meta.sample_ids order."""
    pid = _pid()
    dp.register_partition(pid, ["x", "y"], None, ["t"])
    dp.put_samples(["a", "b", "c"], pid, {"x": torch.arange(3.0), "y": torch.arange(3) * 10})
    meta = KVBatchMeta(partition_id=pid, task_name="t", sample_ids=["c", "a"], fields=["x"])
    td = dp.get_data(meta)
    assert list(td.keys()) == ["x"]
    assert td.batch_size == torch.Size([2])
    assert td["x"].tolist() == [2.0, 0.0]
    assert list(dp.get_data(meta, ["y"]).keys()) == ["y"]
    with pytest.raises(ValueError, match="fields"):
        dp.get_data(KVBatchMeta(partition_id=pid, task_name="t", sample_ids=["a"]))


def test_consumption_status_is_a_bool_true_once_every_task_consumed_every_sample(dp):
    """check_consumption_status -> bool: True iff every named task consumed every sample."""
    pid = _pid()
    dp.register_partition(pid, ["x"], 2, ["a", "b"])
    dp.put_samples(["s0", "s1"], pid, {"x": torch.zeros(2)})
    assert dp.check_consumption_status(pid, ["a", "b"]) is False
    dp.claim_meta(pid, "a", ["x"], 2)
    assert dp.check_consumption_status(pid, ["a"]) is True
    assert dp.check_consumption_status(pid, ["a", "b"]) is False
    dp.claim_meta(pid, "b", ["x"], 2)
    assert dp.check_consumption_status(pid, ["a", "b"]) is True


# ---- registration and clearing ----------------------------------------------------------
def test_registering_again_overwrites_the_partition_cleanly(dp):
    """Registering an existing id again overwrites it cleanly (retries re-register)."""
    pid = _pid()
    dp.register_partition(pid, ["x"], 2, ["t"])
    dp.put_samples(["a", "b"], pid, {"x": torch.zeros(2)})
    dp.claim_meta(pid, "t", ["x"], 2)
    dp.register_partition(pid, ["x"], 2, ["t", "u"])
    with pytest.raises(KeyError):
        dp.get_samples(["a"], pid, ["x"])
    dp.put_samples(["a"], pid, {"x": torch.ones(1)})  # not FieldAlreadyProduced: a clean slate
    assert dp.claim_meta(pid, "u", ["x"], 1).sample_ids == ["a"]
    assert dp.claim_meta(pid, "t", ["x"], 1, blocking=False).sample_ids == ["a"]


def test_clear_samples_drops_those_ids_and_none_drops_the_partition(dp):
    """clear_samples: explicit ids drop those; None drops the partition entirely, so the next
    register_partition of the same id starts clean."""
    pid = _pid()
    dp.register_partition(pid, ["x"], None, ["t"])
    dp.put_samples(["a", "b"], pid, {"x": torch.arange(2.0)})
    assert dp.clear_samples(["a"], pid) is not False
    assert dp.get_samples(["b"], pid, ["x"])["x"].tolist() == [1.0]
    dp.clear_samples(None, pid)
    with pytest.raises(KeyError) as e:
        dp.get_samples(["b"], pid, ["x"])
    assert isinstance(e.value, UnknownPartition)
    with pytest.raises(KeyError):
        dp.claim_meta(pid, "t", ["x"], 1, blocking=False)
    dp.register_partition(pid, ["x"], None, ["t"])
    dp.put_samples(["b"], pid, {"x": torch.ones(1)})
    assert dp.claim_meta(pid, "t", ["x"], 1).sample_ids == ["b"]


# ---- C. lifecycle --------------------------------------------------------------------
def test_close_is_idempotent_and_a_closed_client_says_so(dp):
    """close(): releases handles; idempotent."""
    c = dp
    c.close()
    c.close()
    with pytest.raises(ServiceUnavailable, match="closed") as e:
        c.claim_meta("p", "t", ["x"], 1)
    assert isinstance(e.value, ConnectionError)


# ---- our extras, the same on both -----------------------------------------------------
def test_async_twins_and_leases_with_ack(dp):
    """Ours, opt-in: *_async twins; a leased task's claims come back until acknowledged."""
    pid = _pid()

    async def run():
        await dp.register_partition_async(pid, ["x"], 2, ["t"], task_leases={"t": 60.0})
        await dp.put_samples_async(["a", "b"], pid, {"x": torch.arange(2.0)})
        meta = await dp.claim_meta_async(pid, "t", ["x"], 2)
        td = await dp.get_data_async(meta)
        before = await dp.check_consumption_status_async(pid, ["t"])
        done = dp.ack(meta)
        return sorted(meta.sample_ids), td["x"].sum().item(), before, done

    ids, total, before, done = asyncio.run(run())
    assert (ids, total, before, done) == (["a", "b"], 1.0, False, 2)
    assert dp.check_consumption_status(pid, ["t"]) is True
    dp.delete_partition(pid)
    with pytest.raises(KeyError):
        dp.claim_meta(pid, "t", ["x"], 1, blocking=False)


def test_every_typed_extra_and_its_async_twin(dp):
    """Ours, typed by DataPlaneService: delete_partition, ack, reset_consumption,
    consumption_detail, describe_partition, service_info, each sync and awaited."""
    assert isinstance(dp, DataPlaneService)
    pid, other = _pid(), _pid()
    before = dp.service_info()
    dp.register_partition(pid, ["x"], 3, ["t", "u"], task_leases={"t": 60.0})
    dp.put_samples(["a", "b", "c"], pid, {"x": torch.arange(3.0)})

    info = dp.service_info()
    assert isinstance(info, ServiceInfo)
    assert info.num_samples - before.num_samples == 3
    assert info.num_partitions - before.num_partitions == 1
    assert sum(u.samples for u in info.units) - sum(u.samples for u in before.units) >= 3
    assert all(u.alive for u in info.units)
    assert info.capacity_bytes > 0
    if isinstance(dp, InProcessDataPlaneClient):  # one unit, this process: exact figures
        assert len(info.units) == 1
        assert (info.units[0].samples, info.bytes) == (3, 3 * 4)  # three float32 rows

    desc = dp.describe_partition(pid)
    assert isinstance(desc, PartitionDescription)
    assert (desc.partition_id, desc.num_samples, desc.expected_samples) == (pid, 3, 3)
    assert [(f.name, f.produced) for f in desc.fields] == [("x", 3)]
    assert [c.task for c in desc.consumption] == ["t", "u"]

    first = dp.claim_meta(pid, "t", ["x"], 2)
    assert dp.ack(first) == 2
    detail = dp.consumption_detail(pid, ["t", "u"])
    assert [(c.task, c.consumed, c.leased) for c in detail] == [("t", 2, 0), ("u", 0, 0)]
    dp.reset_consumption(pid, "t")
    assert dp.consumption_detail(pid, ["t"])[0].consumed == 0

    dp.register_partition(other, ["x"], 1, ["t"])
    dp.put_samples(["z"], other, {"x": torch.zeros(1)})
    gone = dp.delete_partition(other)
    assert isinstance(gone, ClearResult)
    assert gone.cleared == 1
    with pytest.raises(KeyError):
        dp.describe_partition(other)

    async def run():
        meta = await dp.claim_meta_async(pid, "t", ["x"], 3)
        acked = await dp.ack_async(meta)
        detail = await dp.consumption_detail_async(pid, ["t", "u"])
        await dp.reset_consumption_async(pid, "t")
        after_reset = await dp.consumption_detail_async(pid, ["t"])
        desc = await dp.describe_partition_async(pid)
        info = await dp.service_info_async()
        gone = await dp.delete_partition_async(pid)
        return acked, detail, after_reset, desc, info, gone

    acked, detail, after_reset, desc, info, gone = asyncio.run(run())
    assert acked == 3
    assert [(c.task, c.consumed, c.done) for c in detail] == [("t", 3, True), ("u", 0, False)]
    assert after_reset[0].consumed == 0
    assert (desc.num_samples, [c.task for c in desc.consumption]) == (3, ["t", "u"])
    assert info.num_samples - before.num_samples == 3
    assert isinstance(gone, ClearResult)
    assert gone.cleared == 3
    with pytest.raises(KeyError):
        dp.consumption_detail(pid, ["t"])


# ---- a trainer loop written only against the ABC -----------------------------------------
def _trainer_step(dp: DataPlaneClient, pid: str, dp_world: int, n: int) -> dict[str, float]:
    """NeMo-RL-style: register -> put -> claim -> shard_meta_for_dp -> worker fetch ->
    write-back -> clear. Uses nothing but the eight contract methods."""
    dp.register_partition(pid, ["input_ids"], n, ["logprob", "train"], enums={"env": ["a", "b"]})
    lengths = [2 + (i * 3) % 5 for i in range(n)]
    ids = [f"{pid}-{i}" for i in range(n)]
    rollouts = TensorDict(
        {
            "input_ids": torch.nested.nested_tensor(
                [torch.arange(m) + i for i, m in enumerate(lengths)], layout=torch.jagged
            ),
            "input_lengths": torch.tensor(lengths),
        },
        batch_size=[n],
    )
    dp.put_samples(ids, pid, rollouts)
    dp.put_samples(ids, pid, {"env": ["a" if i % 3 else "b" for i in range(n)]})

    # Stage 1: the driver claims and shards metas; each DP rank fetches its own rows.
    meta = dp.claim_meta(pid, "logprob", ["input_ids", "env"], n)
    shards, _ = shard_meta_for_dp(meta, dp_world=dp_world)
    for shard in shards:
        data = dp.get_data(shard, ["input_ids", "env"])
        assert data.batch_size == torch.Size([shard.size])
        logprobs = [-(row.float() / 10) for row in data["input_ids"].unbind()]
        dp.put_samples(shard.sample_ids, pid, {"prev_logprobs": logprobs})

    # Stage 2: training claims what stage 1 wrote back.
    train = dp.claim_meta(pid, "train", ["input_ids", "prev_logprobs"], n)
    batch = dp.get_data(train.with_fields(["prev_logprobs", "env"]))
    loss = float(sum(r.sum() for r in batch["prev_logprobs"].unbind()))
    envs = batch.get("env").tolist()
    done = dp.check_consumption_status(pid, ["logprob", "train"])
    dp.clear_samples(None, pid)
    return {"loss": loss, "done": done, "rows": len(batch), "b": envs.count("b")}


def test_a_trainer_loop_runs_unchanged_on_both(dp):
    n = 12
    want_loss = -sum(float((np.arange(2 + (i * 3) % 5) + i).sum()) / 10 for i in range(n))
    for step in range(2):
        out = _trainer_step(dp, f"{_pid()}-step{step}", dp_world=3, n=n)
        assert out["rows"] == n
        assert out["done"] is True
        assert out["b"] == 4
        assert out["loss"] == pytest.approx(want_loss, rel=1e-6)
