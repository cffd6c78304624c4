"""Partial rollouts (``append_tokens``, ``core/partial_rollouts.py``): a sample's per-token
fields grow by segments, each under one policy version; a sample in progress is not
claimable but counts against admission, ages from its oldest segment, and becomes
claimable when finished. On both clients; across a controller restart and a checkpoint.

The problem: a weight update aborts in-flight generation, and every decoded token of it is
thrown away (miles #2589: ~1.1M tokens per step on Qwen3-4B).
"""

from __future__ import annotations

import threading
import uuid

import pytest
import torch

from dataplane_client.wire.errors import (
    ClaimTimeout,
    FieldAlreadyProduced,
    FieldNotProduced,
    InvalidBatch,
    RolloutFinished,
    SamplesNotFound,
    VersionRegression,
)
from dataplane_client.wire.messages import StalenessSpec

FIELDS = ["input_ids", "generation_logprobs", "token_mask", "reward"]
TOKEN_FIELDS = FIELDS[:3]


def _versioned(c, max_staleness: int = 2, batch: int = 2) -> str:
    pid = f"partial-{uuid.uuid4().hex[:8]}"
    spec = StalenessSpec(max_staleness=max_staleness, admission_batch=batch)
    c.register_partition(pid, FIELDS, None, ["train"], staleness=spec)
    return pid


def _tokens(n: int, seed: int, rows: int = 2) -> dict:
    """``rows`` samples' next ``n`` tokens: ids, logprobs, mask (each row unique to seed)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": [torch.randint(0, 1000, (n,), generator=g) for _ in range(rows)],
        "generation_logprobs": [-torch.rand(n, generator=g) for _ in range(rows)],
        "token_mask": [torch.ones(n, dtype=torch.bool) for _ in range(rows)],
    }


def _joined(*parts: dict) -> dict:
    return {f: [torch.cat(r) for r in zip(*(p[f] for p in parts))] for f in TOKEN_FIELDS}


def _assert_rows(c, pid: str, ids: list[str], want: dict) -> None:
    got = c.get_samples(ids, pid, TOKEN_FIELDS)
    for f in TOKEN_FIELDS:
        rows = list(got[f].unbind())
        assert len(rows) == len(want[f])
        for a, b in zip(rows, want[f]):
            assert a.dtype == b.dtype, f
            assert torch.equal(a, b), f  # bit for bit


def _claimable(c, pid: str) -> list[str]:
    return sorted(c.claim_meta(pid, "train", FIELDS, 8, blocking=False).sample_ids)


def test_segments_grow_and_a_finished_rollout_becomes_claimable(dp):
    pid, ids = _versioned(dp), ["a", "b"]
    first, second, last = _tokens(3, 0), _tokens(2, 1), _tokens(1, 2)
    dp.append_tokens(ids, pid, first, 0, tags=[{"prompt": 0}, {"prompt": 1}], start=True)
    dp.put_samples(ids, pid, {"reward": torch.ones(2)})  # other fields: a plain put, any time
    assert dp.ready_depth(pid, ["train"], FIELDS)["train"] == 0  # in progress: not claimable
    assert _claimable(dp, pid) == []
    info = dp.describe_partition(pid).staleness
    assert (info.partial_in_progress, info.untrained) == (2, 2)  # admission counts them
    dp.set_policy_version(pid, 1)
    dp.append_tokens(ids, pid, second, 1)  # resumed under the new weights
    dp.append_tokens(ids, pid, last, 1, finish=True)
    _assert_rows(dp, pid, ids, _joined(first, second, last))
    assert dp.describe_partition(pid).staleness.partial_in_progress == 0
    meta = dp.claim_meta(pid, "train", FIELDS, 8, blocking=False)
    assert sorted(meta.sample_ids) == ids
    for tag in meta.tags:
        assert tag["token_segments"] == [[0, 3], [1, 2], [1, 1]]
        assert tag["token_fields"] == sorted(TOKEN_FIELDS)
        assert tag["in_progress"] is False
        assert tag["weight_version"] == 0  # its staleness: the oldest segment's version
    assert sorted(t["prompt"] for t in meta.tags) == [0, 1]
    assert meta.sequence_lengths == [6, 6]


def test_bad_appends_get_typed_errors_and_change_nothing(dp):
    pid, ids = _versioned(dp), ["a", "b"]
    first = _tokens(3, 0)
    dp.append_tokens(ids, pid, first, 1, start=True)
    bad = [
        ({**_tokens(2, 1), "token_mask": torch.ones(2, 2)}, 1, InvalidBatch, "jagged"),
        ({**_tokens(2, 1), "token_mask": [torch.ones(3), torch.ones(3)]}, 1, InvalidBatch, "many"),
        ({"input_ids": _tokens(2, 1)["input_ids"]}, 1, InvalidBatch, "first segment did"),
        (_tokens(2, 1), 0, VersionRegression, "below"),
        ({**_tokens(2, 1), "other": [torch.ones(2)] * 2}, 1, FieldNotProduced, "other"),
    ]
    for fields, version, error, message in bad:
        with pytest.raises(error, match=message):
            dp.append_tokens(ids, pid, fields, version)
    with pytest.raises(FieldAlreadyProduced, match="stored already"):
        dp.append_tokens(ids, pid, _tokens(2, 1), 1, start=True)
    with pytest.raises(SamplesNotFound, match="start=True begins one"):
        dp.append_tokens(["x"], pid, _tokens(2, 1, rows=1), 1)
    with pytest.raises(InvalidBatch, match="store's"):
        dp.append_tokens(ids, pid, _tokens(2, 1), 1, tags=[{"in_progress": False}] * 2)
    _assert_rows(dp, pid, ids, first)  # nothing changed
    dp.append_tokens(ids, pid, _tokens(1, 2), 1, finish=True)
    with pytest.raises(RolloutFinished, match="finished"):
        dp.append_tokens(ids, pid, _tokens(1, 3), 1)
    whole = _tokens(4, 4, rows=1)
    dp.put_samples(["c"], pid, {**whole, "reward": torch.ones(1)}, version=1)
    with pytest.raises(RolloutFinished, match="put whole"):
        dp.append_tokens(["c"], pid, _tokens(1, 5, rows=1), 1)
    _assert_rows(dp, pid, ["c"], whole)


def test_a_partial_rollout_ages_from_its_oldest_segment_and_counts_against_admission(dp):
    pid = _versioned(dp, max_staleness=1, batch=1)  # admission: (1 + 1) * 1 samples
    dp.append_tokens(["a", "b"], pid, _tokens(2, 0), 0, start=True)
    assert dp.admit_rollouts(pid, 1) is None  # the two in progress fill the window
    dp.set_policy_version(pid, 1)
    dp.append_tokens(["a", "b"], pid, _tokens(2, 1), 1)  # resumed: still as old as v0
    dp.set_policy_version(pid, 2)  # v0 left the window; in progress, it is not dropped yet
    assert dp.describe_partition(pid).staleness.dropped_stale == {}
    dp.append_tokens(["a", "b"], pid, _tokens(1, 2), 2, finish=True)
    # finished, it is judged as old as v0, though resumed: dropped before a blocking claim
    with pytest.raises(ClaimTimeout):
        dp.claim_meta(pid, "train", FIELDS, 2, timeout_s=0.5)
    assert dp.describe_partition(pid).staleness.dropped_stale == {"train": 2}
    with pytest.raises(SamplesNotFound, match="dropped as stale"):
        dp.append_tokens(["a", "b"], pid, _tokens(1, 3), 2)


def test_concurrent_appends_to_one_sample_lose_no_segment(dp):
    """Two writers append to the same sample at once: every segment lands once, in one
    order, and the rows are those segments joined in that order (a read-join-write without
    the store's prefix check would lose one writer's tokens)."""
    pid = _versioned(dp)
    per_writer, errors = 6, []

    def writer(w: int) -> None:
        try:
            for k in range(per_writer):
                token = torch.tensor([100 * w + k])
                dp.append_tokens(
                    ["s"], pid, {"input_ids": [token], "generation_logprobs": [token * 0.5],
                                 "token_mask": [torch.ones(1, dtype=torch.bool)]}, 0)  # fmt: skip
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    dp.append_tokens(["s"], pid, _tokens(1, 0, rows=1), 0, start=True)
    threads = [threading.Thread(target=writer, args=(w,)) for w in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    got = dp.get_samples(["s"], pid, TOKEN_FIELDS)
    ids = got["input_ids"].unbind()[0][1:].tolist()
    assert sorted(ids) == sorted(100 * w + k for w in (1, 2) for k in range(per_writer))
    for w in (1, 2):  # each writer's tokens in its own order
        assert [i for i in ids if i // 100 == w] == [100 * w + k for k in range(per_writer)]
    assert torch.equal(got["generation_logprobs"].unbind()[0][1:], torch.tensor(ids) * 0.5)


# ---- durable: a partial rollout survives a controller restart and a checkpoint ----------
@pytest.fixture(scope="module")
def partial_service(module_services):
    return module_services("partial", num_storage_units=1, admin_enabled=False)


def _started(c) -> tuple[str, dict]:
    pid, first = _versioned(c), _tokens(3, 0)
    c.append_tokens(["a", "b"], pid, first, 0, start=True)
    c.put_samples(["a", "b"], pid, {"reward": torch.ones(2)})
    return pid, first


def _finished_after(c, pid: str, first: dict) -> None:
    """Still in progress where it was left; resumed under v1 and finished, it is claimable
    with both segments and every token."""
    assert _claimable(c, pid) == []
    assert c.describe_partition(pid).staleness.partial_in_progress == 2
    second = _tokens(2, 1)
    c.set_policy_version(pid, 1)
    c.append_tokens(["a", "b"], pid, second, 1, finish=True)
    _assert_rows(c, pid, ["a", "b"], _joined(first, second))
    meta = c.claim_meta(pid, "train", FIELDS, 8, blocking=False)
    assert [t["token_segments"] for t in meta.tags] == [[[0, 3], [1, 2]]] * 2


@pytest.mark.ray
def test_a_controller_restart_keeps_partial_rollouts_in_progress(partial_service):
    from test_resume_steps import _restart

    c = partial_service.client()
    pid, first = _started(c)
    _restart(partial_service)  # the key space is rebuilt from the unit's tags
    _finished_after(c, pid, first)


@pytest.mark.ray
def test_a_checkpoint_restored_elsewhere_keeps_partial_rollouts(
    partial_service, module_services, tmp_path
):
    c = partial_service.client()
    pid, first = _started(c)
    path = c.checkpoint(str(tmp_path / "ck"))
    other = module_services("partial-restored", num_storage_units=1, admin_enabled=False)
    restored = other.client()
    restored.restore(path)
    _finished_after(restored, pid, first)
