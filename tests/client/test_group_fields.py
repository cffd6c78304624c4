"""Group fields (``register_partition(..., group_fields=[...])``): a GRPO group's value is
stored once and read back by every member bit for bit, on both clients; a member whose
value differs is ``GroupValueConflict``; the value's bytes live while any member does;
a unit's dump and load and an undone publish keep the sharing and the counts right."""

from __future__ import annotations

import asyncio
import uuid

import numpy as np
import pytest
import torch

from dataplane_client.codec.fields import encode_field
from dataplane_client.wire import group_fields
from dataplane_client.wire.errors import GroupValueConflict, InvalidBatch, SamplesNotFound
from dataplane_server.core.recovery_messages import SampleMeta
from dataplane_server.core.unit.store import UnitStore

GROUP = 4
PROMPT_TOKENS = 300  # int64: 2,400 bytes per group's prompt


def _partition(dp) -> str:
    pid = f"g-{uuid.uuid4().hex[:8]}"
    dp.register_partition(
        pid,
        fields=["prompt_ids", "responses"],
        consumer_tasks=["train"],
        grpo_group_size=GROUP,
        group_fields=["prompt_ids"],
    )
    return pid


def _prompt(group: int, tokens: int = PROMPT_TOKENS) -> torch.Tensor:
    return torch.arange(tokens, dtype=torch.int64) * 7 + group


def _response(sample: int) -> torch.Tensor:
    return torch.full((5 + sample % 3,), float(sample), dtype=torch.float32)


def _put(dp, pid, groups, members=range(GROUP), prompt=_prompt):
    """Put ``members`` of each group in ``groups``; the samples' ids, in put order."""
    ids, prompts, responses, tags = [], [], [], []
    for g in groups:
        for m in members:
            n = g * GROUP + m
            ids.append(f"s{n}")
            prompts.append(prompt(g))
            responses.append(_response(n))
            tags.append({"group_id": g})
    dp.put_samples(ids, pid, {"prompt_ids": prompts, "responses": responses}, tags=tags)
    return ids


def _stored_bytes(dp, pid) -> int:
    return sum(dp.describe_partition(pid).bytes_per_unit)


def _responses_bytes(samples) -> int:
    return sum(_response(n).nbytes for n in samples)


def _check_read(dp, pid, samples):
    out = dp.get_samples([f"s{n}" for n in samples], pid, ["prompt_ids", "responses"])
    for row, n in enumerate(samples):
        assert torch.equal(out["prompt_ids"][row], _prompt(n // GROUP))
        assert torch.equal(out["responses"][row], _response(n))


def test_a_group_put_at_once_reads_back_bit_for_bit_and_holds_its_prompt_once(dp):
    pid = _partition(dp)
    _put(dp, pid, groups=[0, 1, 2])
    samples = list(range(3 * GROUP))
    _check_read(dp, pid, samples)
    _check_read(dp, pid, [9, 1, 6])  # a subset, members of several groups, any order
    meta = dp.claim_meta(pid, "train", ["prompt_ids"], batch_size=2 * GROUP)
    got = dp.get_data(meta, ["prompt_ids"])
    for row, sid in enumerate(meta.sample_ids):
        assert torch.equal(got["prompt_ids"][row], _prompt(int(sid[1:]) // GROUP))
    prompt_bytes = _prompt(0).nbytes
    assert _stored_bytes(dp, pid) == 3 * prompt_bytes + _responses_bytes(samples)


def test_a_group_put_in_several_puts_shares_the_first_value(dp):
    pid = _partition(dp)
    _put(dp, pid, groups=[0, 1], members=[0, 1])
    _put(dp, pid, groups=[0, 1], members=[2, 3])
    _check_read(dp, pid, list(range(2 * GROUP)))
    samples = list(range(2 * GROUP))
    assert _stored_bytes(dp, pid) == 2 * _prompt(0).nbytes + _responses_bytes(samples)


def test_a_member_whose_value_differs_is_refused_by_field_and_group(dp):
    pid = _partition(dp)

    def odd_one_out(group):
        p = _prompt(group)
        return p if group != 1 else p + 1

    # In one put: member 2 of group 5 differs from the group's first member.
    prompts = [_prompt(5)] * 4
    prompts[2] = _prompt(5) + 1
    with pytest.raises(GroupValueConflict) as err:
        dp.put_samples(
            [f"x{i}" for i in range(4)],
            pid,
            {"prompt_ids": prompts, "responses": [_response(i) for i in range(4)]},
            tags=[{"group_id": 5}] * 4,
        )
    assert err.value.fields == ["prompt_ids"]
    assert err.value.ids == ["x2"]
    assert "group 5" in str(err.value)
    # Across puts: group 1's later members bring another prompt than the stored one.
    _put(dp, pid, groups=[0, 1], members=[0, 1])
    with pytest.raises(GroupValueConflict) as err:
        _put(dp, pid, groups=[1], members=[2, 3], prompt=odd_one_out)
    assert err.value.fields == ["prompt_ids"]
    assert "group 1" in str(err.value)
    with pytest.raises(SamplesNotFound):  # nothing of a refused put is stored
        dp.get_samples(["s6", "x0"], pid, ["prompt_ids"])
    _check_read(dp, pid, [0, 1, 4, 5])


def test_a_groups_bytes_are_freed_with_its_last_member(dp):
    pid = _partition(dp)
    _put(dp, pid, groups=[0])
    prompt_bytes = _prompt(0).nbytes
    first = dp.clear_samples(["s0", "s1", "s2"], pid)
    assert first.bytes_freed == _responses_bytes([0, 1, 2])  # the prompt stays for s3
    assert _stored_bytes(dp, pid) == prompt_bytes + _responses_bytes([3])
    _check_read(dp, pid, [3])
    last = dp.clear_samples(["s3"], pid)
    assert last.bytes_freed == prompt_bytes + _responses_bytes([3])
    assert _stored_bytes(dp, pid) == 0


def test_group_fields_need_a_grouped_partition_and_group_tags(dp):
    with pytest.raises(InvalidBatch, match="grpo_group_size"):
        dp.register_partition("g-bad", fields=["p"], group_fields=["p"])
    pid = _partition(dp)
    _put(dp, pid, groups=[0], members=[0])
    with pytest.raises(InvalidBatch, match="group_id") as err:  # adding it to an existing sample
        dp.put_samples(["s0"], pid, {"prompt_ids": [_prompt(0)]}, overwrite=True)
    assert err.value.ids == ["s0"]


def test_a_partition_without_group_fields_stores_each_members_copy(dp):
    pid = f"g-{uuid.uuid4().hex[:8]}"
    dp.register_partition(pid, fields=["prompt_ids", "responses"], grpo_group_size=GROUP)
    _put(dp, pid, groups=[0])
    _check_read(dp, pid, list(range(GROUP)))
    assert _stored_bytes(dp, pid) == GROUP * _prompt(0).nbytes + _responses_bytes(range(GROUP))


# ---- the unit's side, without Ray -------------------------------------------------------


def _unit_store() -> UnitStore:
    """A unit's store alone: 64 MiB in process memory, no waits, no warm reserve."""
    return UnitStore(
        index=0,
        capacity_bytes=64 << 20,
        use_shm=False,
        put_wait_timeout_s=0.0,
        warm_reserve_bytes=0,
        stage_ttl_s=30.0,
    )


@pytest.fixture
def store():
    s = _unit_store()
    yield s
    s.close()


def _stage_group(store, wid, ids, groups, prompts, responses):
    """Stage as the client does: one prompt row per group, each sample naming its own."""
    tags = [{"group_id": g} for g in groups]
    encoded = {
        "prompt_ids": encode_field("prompt_ids", prompts),
        "responses": encode_field("responses", responses),
    }
    put = group_fields.share(ids, tags, encoded, frozenset({"prompt_ids"}), "p")
    asyncio.run(store.stage("p", wid, ids, put.encoded, None, group_rows=put.index))
    return SampleMeta(seq=1, tags=dict(zip(ids, tags)))


def test_a_unit_checkpoint_and_load_keep_one_copy_per_group(store, tmp_path):
    ids = [f"s{i}" for i in range(8)]
    groups = [i // 4 for i in range(8)]
    meta = _stage_group(
        store, "w1", ids, groups, [_prompt(g) for g in groups], [_response(i) for i in range(8)]
    )
    assert store.publish("w1", meta)
    held = store.partition_bytes()["p"]
    assert held == 2 * _prompt(0).nbytes + _responses_bytes(range(8))
    store.pin_checkpoint("c1")
    dumped = asyncio.run(store.write_checkpoint("c1", str(tmp_path), {"p": ids}))
    assert dumped.written - dumped.files[0].nbytes == held  # each group's prompt once
    fresh = _unit_store()
    try:
        assert fresh.load(str(tmp_path), dumped.files) == 8
        assert fresh.partition_bytes()["p"] == held
        out = fresh.read("p", ids, ["prompt_ids"])["prompt_ids"]
        expected = np.concatenate([_prompt(g).numpy().view(np.uint8) for g in groups])
        assert np.array_equal(out.values, expected)
        # A later member of group 1 finds the loaded value: shared, so nothing more held.
        meta = _stage_group(fresh, "w2", ["s8"], [1], [_prompt(1)], [_response(8)])
        assert fresh.publish("w2", meta)
        assert fresh.partition_bytes()["p"] == held + _responses_bytes([8])
        fresh.clear("p", ids)
        assert fresh.partition_bytes()["p"] == _prompt(1).nbytes + _responses_bytes([8])
    finally:
        fresh.close()


def test_an_undone_publish_empties_cells_that_point_at_a_stored_value(store):
    meta = _stage_group(store, "w1", ["a", "b"], [7, 7], [_prompt(7)] * 2, [_response(0)] * 2)
    assert store.publish("w1", meta)
    meta = _stage_group(store, "w2", ["c", "d"], [7, 7], [_prompt(7)] * 2, [_response(1)] * 2)
    assert store.publish("w2", meta)
    before = store.partition_bytes()["p"]
    store.unpublish("p", "w2")  # a multi-unit commit refused elsewhere: c and d go
    with pytest.raises(SamplesNotFound):
        store.read("p", ["c"], ["prompt_ids"])
    assert store.partition_bytes()["p"] == before - 2 * _response(1).nbytes
    store.clear("p", ["a", "b"])
    assert store.partition_bytes().get("p", 0) == 0
    assert store.used_bytes == 0  # every reference went back: nothing leaked


def test_a_prepared_value_that_differs_is_refused_before_any_unit_publishes(store):
    meta = _stage_group(store, "w1", ["a"], [3], [_prompt(3)], [_response(0)])
    assert store.publish("w1", meta)
    meta = _stage_group(store, "w2", ["b"], [3], [_prompt(3) + 1], [_response(1)])
    with pytest.raises(GroupValueConflict):
        store.prepare("w2", meta, [0, 1])
    with pytest.raises(GroupValueConflict):
        store.publish("w2", meta)
    assert store.read("p", ["a"], ["prompt_ids"])["prompt_ids"].values.view(np.int64).tolist() == (
        _prompt(3).tolist()
    )
