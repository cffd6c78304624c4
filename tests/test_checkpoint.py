"""Checkpoint and restore of the whole store: a checkpoint restored into a fresh service
gives back every sample bit for bit and every cursor and lease; a damaged or half-written
checkpoint never loads."""

from __future__ import annotations

import json
import os
import uuid

import pytest
import torch

from dataplane_client.config import DataPlaneConfig
from dataplane_client.errors import CorruptPayload, InvalidBatch
from dataplane_server import start


@pytest.fixture
def two_services(ray_session):
    handles = [
        start(
            DataPlaneConfig(
                name=f"ckpt-{uuid.uuid4().hex[:6]}",
                num_storage_units=2,
                admin_enabled=False,
                unit_warm_reserve_bytes=0,
            )
        )
        for _ in range(2)
    ]
    yield handles
    for h in handles:
        h.shutdown()


def _fields(n: int) -> dict:
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(1, 9, (n,), generator=g)
    return {
        "input_ids": [torch.randint(0, 50_000, (int(k),), generator=g) for k in lengths],
        "logprobs": torch.randn(n, 3, generator=g).to(torch.bfloat16),
        "mask": torch.rand(n, generator=g) > 0.5,
    }


def test_restore_into_a_fresh_service_gives_back_every_sample_and_cursor(two_services, tmp_path):
    src, dst = (h.client() for h in two_services)
    ids = [f"s{i}" for i in range(30)]
    src.register_partition(
        "p", ["input_ids", "logprobs", "mask"], 30, ["t", "u"], task_leases={"u": 600.0}
    )
    fields = _fields(30)
    src.put_samples(ids, "p", fields, tags=[{"step": i % 3} for i in range(30)])
    taken = src.claim_meta("p", "t", ["input_ids"], 7).sample_ids
    held = src.claim_meta("p", "u", ["input_ids"], 4)
    path = src.checkpoint(str(tmp_path / "ck"))
    assert sorted(os.listdir(path)) == [
        "manifest.json",
        "state.msgpack",
        "unit-0.bin",
        "unit-1.bin",
    ]
    assert dst.restore(path) == 30
    got = dst.get_samples(ids, "p", ["input_ids", "logprobs", "mask"])
    for i, row in enumerate(got["input_ids"].unbind()):
        assert torch.equal(row, fields["input_ids"][i])
    assert torch.equal(got["logprobs"].view(torch.int16), fields["logprobs"].view(torch.int16))
    assert torch.equal(got["mask"], fields["mask"])
    rest = dst.claim_meta("p", "t", ["input_ids"], 100, blocking=False)
    assert sorted(rest.sample_ids) == sorted(set(ids) - set(taken))  # cursor kept
    assert rest.tags[0]["step"] == int(rest.sample_ids[0][1:]) % 3  # tags kept
    again = dst.claim_meta("p", "u", ["input_ids"], 100, blocking=False)
    assert set(again.sample_ids) == set(ids) - set(held.sample_ids)  # leases kept
    assert dst.ack(held) == 4  # the restored lease is the same lease
    with pytest.raises(InvalidBatch, match="empty service"):
        dst.restore(path)  # never over live data


def test_a_damaged_or_half_written_checkpoint_never_loads(two_services, tmp_path):
    src, dst = (h.client() for h in two_services)
    src.register_partition("p", ["x"], None, ["t"])
    src.put_samples(["a", "b"], "p", {"x": torch.arange(2.0)})
    path = src.checkpoint(str(tmp_path / "ck"))
    with pytest.raises(InvalidBatch, match="exists"):
        src.checkpoint(path)  # never overwritten in place
    with open(os.path.join(path, "unit-0.bin"), "r+b") as f:  # one flipped byte
        f.seek(10)
        byte = f.read(1)
        f.seek(10)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(CorruptPayload, match="does not match"):
        dst.restore(path)
    assert dst.service_info().num_samples == 0  # nothing of it was kept
    half = tmp_path / "half.tmp-0000"  # what a crash mid-save leaves: no manifest
    half.mkdir()
    with pytest.raises(CorruptPayload, match="manifest"):
        dst.restore(str(half))
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert {u["name"] for u in manifest["units"]} == {"unit-0.bin", "unit-1.bin"}
