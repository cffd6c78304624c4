"""Async RL inside the store (issue 24): versions, the staleness window, ``where``,
rollout admission, drops, evictions and introspection, on both clients."""

import asyncio
import threading
import time
import uuid

import pytest
import torch
from polling import wait_until

from dataplane_client import StalenessSpec
from dataplane_client.wire.errors import (
    AdmissionTimeout,
    InvalidBatch,
    UnknownTask,
    VersionRegression,
)


def _pid():
    return f"async-{uuid.uuid4().hex[:8]}"


def _register(dp, *, tasks=("train",), group_size=None, **spec):
    pid = _pid()
    dp.register_partition(
        pid,
        ["x"],
        None,
        list(tasks),
        group_size,
        numeric_tags={"reward_std": "float64"},
        staleness=StalenessSpec(**spec),
    )
    return pid


def _put(dp, pid, ids, version, group=None, reward_std=1.0):
    tags = [{"reward_std": reward_std} for _ in ids]
    if group is not None:
        for t in tags:
            t["group_id"] = group
    x = torch.arange(len(ids), dtype=torch.float32)
    dp.put_samples(ids, pid, {"x": x}, tags=tags, version=version)


# ---- versions -------------------------------------------------------------------------
def test_the_policy_version_moves_forward_only(dp):
    pid = _register(dp, max_staleness=1)
    assert dp.policy_version(pid) == 0
    assert dp.set_policy_version(pid, 3) == 3
    assert dp.set_policy_version(pid, 3) == 3  # the same version again is a no-op
    with pytest.raises(VersionRegression, match="below the current 3"):
        dp.set_policy_version(pid, 2)
    with pytest.raises(InvalidBatch, match="int >= 0"):
        dp.set_policy_version(pid, "4")
    assert dp.policy_version(pid) == 3


def test_a_partition_without_versions_refuses_the_version_verbs(dp):
    pid = _pid()
    dp.register_partition(pid, ["x"], None, ["train"])
    with pytest.raises(InvalidBatch, match="StalenessSpec"):
        dp.set_policy_version(pid, 1)
    with pytest.raises(InvalidBatch, match="StalenessSpec"):
        dp.claim_meta(pid, "train", ["x"], 1, blocking=False, max_staleness=0)


def test_every_put_into_a_versioned_partition_carries_its_version(dp):
    pid = _register(dp)
    with pytest.raises(InvalidBatch, match=r"version=v\); read as tag weight_version"):
        dp.put_samples(["a"], pid, {"x": torch.zeros(1)}, tags=[{"reward_std": 0.0}])
    with pytest.raises(InvalidBatch, match="fits"):
        dp.put_samples(["a"], pid, {"x": torch.zeros(1)}, tags=[{"weight_version": 1.5}])
    _put(dp, pid, ["a"], 7)
    meta = dp.claim_meta(pid, "train", ["x"], 1)
    assert meta.tags[0]["weight_version"] == 7


def test_a_put_says_its_version_as_an_argument_kept_once_as_the_version_column(dp):
    pid = _pid()
    spec = StalenessSpec(max_staleness=0, version_tag="policy_step")
    dp.register_partition(pid, ["x"], None, ["train"], staleness=spec)
    x = {"x": torch.zeros(3)}
    dp.put_samples(["a", "b", "c"], pid, x, version=[2, 2, 3])
    dp.put_samples(["d"], pid, {"x": torch.zeros(1)}, tags=[{"policy_step": 3}], version=3)
    # The version read back under the partition's tag name, and the column drives the window.
    dp.set_policy_version(pid, 3)
    meta = dp.claim_meta(pid, "train", ["x"], 4, blocking=False)
    assert sorted(meta.sample_ids) == ["c", "d"]
    assert [t["policy_step"] for t in meta.tags] == [3, 3]
    assert all(type(t["policy_step"]) is int for t in meta.tags)
    assert dp.describe_partition(pid).staleness.dropped_stale == {"train": 2}


def test_a_bad_version_argument_is_refused_naming_it_and_stores_nothing(dp):
    """...and an unversioned partition keeps a good one as a plain tag."""
    pid = _register(dp)
    plain = _pid()
    dp.register_partition(plain, ["x"], None, ["train"])
    one = {"x": torch.zeros(1)}
    bad = [
        (pid, dict(version=1.5), "version must be an int or a list.*got 1.5"),
        (pid, dict(version=True), "version must be an int or a list.*got True"),
        (pid, dict(version="3"), "version must be an int or a list"),
        (pid, dict(version=[1.5]), r"version\[0\] must be an int"),
        (pid, dict(version=[False]), r"version\[0\] must be an int"),
        (pid, dict(version=[1, 2]), "2 versions for 1 sample ids"),
        (pid, dict(version=2, tags=[{"weight_version": 1}]), "give the version once"),
        (plain, dict(version=2, tags=[{"weight_version": 3}]), "give the version once"),
    ]
    for target, kwargs, message in bad:
        with pytest.raises(InvalidBatch, match=message):
            dp.put_samples(["a"], target, one, **kwargs)
    assert dp.describe_partition(pid).num_samples == 0
    assert dp.describe_partition(plain).num_samples == 0
    # An unversioned partition keeps the version as a plain tag (no window reads it).
    dp.put_samples(["a"], plain, one, tags=[{"k": 1}], version=2)
    assert dp.claim_meta(plain, "train", ["x"], 1).tags == [{"k": 1, "weight_version": 2}]


def test_a_bad_staleness_spec_is_refused_naming_what_is_wrong(dp):
    pid = _pid()
    bad = [
        (StalenessSpec(max_staleness=-1), "max_staleness"),
        (StalenessSpec(stale_samples="lose"), "stale_samples"),
        (StalenessSpec(admission_batch=4), "needs max_staleness"),
        (StalenessSpec(max_staleness=1, admission_batch=4, oversample_ratio=0.5), ">= 1"),
    ]
    for spec, message in bad:
        with pytest.raises(InvalidBatch, match=message):
            dp.register_partition(pid, ["x"], None, ["train"], staleness=spec)
    with pytest.raises(UnknownTask, match="not consumer tasks: \\['nope'\\]"):
        dp.register_partition(
            pid, ["x"], None, ["train"], staleness=StalenessSpec(max_staleness={"nope": 1})
        )


# ---- the window -------------------------------------------------------------------------
def test_a_claim_never_hands_out_a_sample_older_than_the_window_and_drops_count(dp):
    pid = _register(dp, max_staleness=1)
    for v in range(4):
        _put(dp, pid, [f"v{v}-{i}" for i in range(2)], v)
    dp.set_policy_version(pid, 3)
    meta = dp.claim_meta(pid, "train", ["x"], 8, blocking=False)
    assert sorted(meta.sample_ids) == ["v2-0", "v2-1", "v3-0", "v3-1"]
    info = dp.describe_partition(pid).staleness
    assert info.dropped_stale == {"train": 4}
    assert set(info.recently_dropped) == {"v0-0", "v0-1", "v1-0", "v1-1"}
    # A sample put late with an old version is stale on arrival: never handed out.
    _put(dp, pid, ["late"], 0)
    assert not dp.claim_meta(pid, "train", ["x"], 8, blocking=False)
    assert dp.ready_depth(pid, ["train"]) == {"train": 0}


def test_kept_stale_samples_stay_for_the_tasks_without_a_bound(dp):
    pid = _register(dp, tasks=("train", "log"), max_staleness={"train": 0}, stale_samples="keep")
    _put(dp, pid, ["old"], 0)
    _put(dp, pid, ["new"], 1)
    dp.set_policy_version(pid, 1)
    assert dp.claim_meta(pid, "train", ["x"], 2, blocking=False).sample_ids == ["new"]
    assert sorted(dp.claim_meta(pid, "log", ["x"], 2, blocking=False).sample_ids) == [
        "new",
        "old",
    ]
    assert dp.describe_partition(pid).staleness.dropped_stale == {}


def test_a_group_is_stale_when_its_oldest_member_is(dp):
    pid = _register(dp, group_size=2, max_staleness=1)
    _put(dp, pid, ["g0"], 0, group="g")
    _put(dp, pid, ["g1"], 2, group="g")
    _put(dp, pid, ["h0", "h1"], 2, group="h")
    dp.set_policy_version(pid, 2)
    meta = dp.claim_meta(pid, "train", ["x"], 4, blocking=False)
    assert meta.sample_ids == ["h0", "h1"]
    assert dp.describe_partition(pid).staleness.dropped_stale == {"train": 2}


def test_a_group_dropped_as_stale_and_generated_again_is_as_old_as_its_new_members(dp):
    """The demo hands a dropped prompt out again under the same group id: the group then
    holds no live member, and its age was its dropped members' (every regeneration was
    dropped on arrival, and a run needing that prompt waited forever)."""
    pid = _register(dp, group_size=2, max_staleness=1)
    _put(dp, pid, ["g0", "g1"], 0, group="g")
    dp.set_policy_version(pid, 2)  # drops g at version 0
    _put(dp, pid, ["g0", "g1"], 2, group="g")
    meta = dp.claim_meta(pid, "train", ["x"], 2, blocking=False)
    assert meta.sample_ids == ["g0", "g1"]
    assert dp.describe_partition(pid).staleness.dropped_stale == {"train": 2}


def test_a_claim_may_tighten_the_window_but_not_widen_it(dp):
    pid = _register(dp, max_staleness=2)
    _put(dp, pid, ["a"], 0)
    _put(dp, pid, ["b"], 1)
    _put(dp, pid, ["c"], 2)
    dp.set_policy_version(pid, 2)
    tight = dp.claim_meta(pid, "train", ["x"], 3, blocking=False, max_staleness=0)
    assert tight.sample_ids == ["c"]
    # A looser bound was silently ignored (the partition's applied): it is refused, naming
    # both, and hands out nothing.
    with pytest.raises(InvalidBatch, match=r"max_staleness 9 .*bound of 2 .*'train'"):
        dp.claim_meta(pid, "train", ["x"], 3, blocking=False, max_staleness=9)
    same = dp.claim_meta(pid, "train", ["x"], 3, blocking=False, max_staleness=2)
    assert same.sample_ids == ["a", "b"]


# ---- where ------------------------------------------------------------------------------
def test_where_filters_on_numeric_tag_columns_in_every_form(dp):
    pid = _register(dp, group_size=2)
    _put(dp, pid, ["flat0", "flat1"], 0, group="flat", reward_std=0.0)
    _put(dp, pid, ["good0", "good1"], 0, group="good", reward_std=0.5)
    for where in ("reward_std > 0", [("reward_std", ">", 0)], ("reward_std", "!=", 0.0)):
        peek = dp.peek_meta(pid, "train", ["x"], 4, where=where)
        assert peek.sample_ids == ["good0", "good1"], where
    got = dp.claim_meta(pid, "train", ["x"], 4, blocking=False, where="reward_std > 0")
    assert got.sample_ids == ["good0", "good1"]
    # the filtered-out group is still there for a claim without the filter
    assert dp.claim_meta(pid, "train", ["x"], 4, blocking=False).sample_ids == [
        "flat0",
        "flat1",
    ]


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("reward > 0", "not numeric tags"),
        ("reward_std >> 0", "cannot read"),
        ([("reward_std", "~", 0)], "not one of"),
        ([("reward_std", ">", "0")], "must be a number"),
        ([("reward_std", ">", float("nan"))], "must be a number"),
        (42, "where must be"),
    ],
)
def test_a_bad_where_is_refused_naming_what_is_wrong(dp, where, message):
    pid = _register(dp)
    _put(dp, pid, ["a"], 0)
    with pytest.raises(InvalidBatch, match=message):
        dp.claim_meta(pid, "train", ["x"], 1, blocking=False, where=where)
    assert dp.ready_depth(pid, ["train"]) == {"train": 1}  # nothing was consumed


# ---- order within the window --------------------------------------------------------------
def test_claim_order_policies_by_version(dp):
    pid = _register(dp, max_staleness=5)
    for sid, v in (("a", 2), ("b", 0), ("c", 1), ("d", 2)):
        _put(dp, pid, [sid], v)
    dp.set_policy_version(pid, 2)
    default = dp.peek_meta(pid, "train", ["x"], 4).sample_ids
    assert default == ["a", "b", "c", "d"]  # commit order: the oldest written first
    in_order = dp.claim_meta(
        pid, "train", ["x"], 2, blocking=False, claim_policy="version_order"
    ).sample_ids
    assert in_order == ["b", "c"]
    freshest = dp.claim_meta(
        pid, "train", ["x"], 2, blocking=False, claim_policy="freshest_first"
    ).sample_ids
    assert freshest == ["a", "d"]


# ---- admission --------------------------------------------------------------------------
def test_admission_keeps_started_but_untrained_within_the_bound(dp):
    pid = _register(dp, max_staleness=1, admission_batch=2)  # bound: (1 + 1) x 2 = 4
    first = dp.admit_rollouts(pid, 3)
    assert first is not None
    assert first.n == 3
    assert first.version == 0
    assert dp.admit_rollouts(pid, 2) is None  # 3 + 2 > 4
    second = dp.admit_rollouts(pid, 1)
    assert second is not None
    _put(dp, pid, ["a", "b", "c"], 0)
    assert dp.release_rollouts(first)
    assert not dp.release_rollouts(first)  # once
    assert dp.admit_rollouts(pid, 1) is None  # 3 stored untrained + 1 in flight
    dp.claim_meta(pid, "train", ["x"], 2)  # trained: room for 2
    assert dp.admit_rollouts(pid, 2) is not None
    with pytest.raises(InvalidBatch, match="never be admitted"):
        dp.admit_rollouts(pid, 5)
    info = dp.describe_partition(pid).staleness
    assert (info.admission_limit, info.untrained, info.granted_in_flight) == (4, 1, 3)


def test_a_waiting_admission_is_granted_when_the_trainer_claims(dp):
    pid = _register(dp, max_staleness=0, admission_batch=2)
    _put(dp, pid, ["a", "b"], 0)
    got = []
    waiter = threading.Thread(
        target=lambda: got.append(dp.admit_rollouts(pid, 2, wait=True, timeout_s=30))
    )
    waiter.start()
    wait_until(
        lambda: dp.describe_partition(pid).staleness.admission_waits == 1,
        20,
        "the admission to wait",
    )
    assert not got
    dp.claim_meta(pid, "train", ["x"], 2)
    waiter.join(30)
    assert got
    assert got[0] is not None
    assert got[0].n == 2
    with pytest.raises(AdmissionTimeout, match="not admitted within 0.2s"):
        dp.admit_rollouts(pid, 1, wait=True, timeout_s=0.2)


def test_a_dead_producers_grant_expires(dp):
    pid = _register(dp, max_staleness=0, admission_batch=2)
    assert dp.admit_rollouts(pid, 2, lease_s=0.5) is not None
    assert dp.admit_rollouts(pid, 1) is None
    again = dp.admit_rollouts(pid, 2, wait=True, timeout_s=30)  # woken by the expiry
    assert again is not None


def test_kept_stale_samples_do_not_block_admission(dp):
    pid = _register(
        dp,
        tasks=("train", "log"),
        max_staleness={"train": 0},
        stale_samples="keep",
        admission_batch=2,
    )
    _put(dp, pid, ["a", "b"], 0)
    assert dp.admit_rollouts(pid, 1) is None  # 2 untrained of a bound of 2
    dp.set_policy_version(pid, 1)  # a and b are stale for train: never to be trained
    assert dp.admit_rollouts(pid, 2) is not None
    assert dp.describe_partition(pid).staleness.untrained == 0


def test_filtered_out_groups_never_wedge_admission_and_are_not_counted_stale(dp):
    """DAPO (issue 35): zero-variance groups a ``where`` claim refuses are no longer owed.
    Before, they counted as started and untrained until they went stale: admission refused
    and the filtered claim found nothing, so neither side could move."""
    pid = _register(dp, group_size=2, max_staleness=1, admission_batch=4)  # bound 8
    for g in range(4):
        _put(dp, pid, [f"g{g}-0", f"g{g}-1"], 0, group=f"g{g}", reward_std=0.0)
    assert dp.admit_rollouts(pid, 4) is None  # 8 untrained: the bound
    empty = dp.claim_meta(pid, "train", ["x"], 4, blocking=False, where="reward_std > 0")
    assert empty.sample_ids == []
    grant = dp.admit_rollouts(pid, 4)  # the producer moves on...
    assert grant is not None
    info = dp.describe_partition(pid).staleness
    assert (info.untrained, info.filtered) == (0, {"train": 8})
    _put(dp, pid, ["h-0", "h-1"], 0, group="h", reward_std=0.5)
    meta = dp.claim_meta(pid, "train", ["x"], 2, where="reward_std > 0", timeout_s=30)
    assert sorted(meta.sample_ids) == ["h-0", "h-1"]  # ...and so does the trainer
    dp.set_policy_version(pid, 2)  # the refused groups leave the window: not stale drops
    info = dp.describe_partition(pid).staleness
    assert info.dropped_stale == {}
    assert info.filtered == {"train": 8}
    # A peek marks nothing.
    assert dp.peek_meta(pid, "train", ["x"], 8, where="reward_std > 1").sample_ids == []
    assert dp.describe_partition(pid).staleness.filtered == {"train": 8}


def test_a_sample_without_the_filtered_tag_is_not_judged_yet(dp):
    pid = _register(dp, max_staleness=1, admission_batch=2)
    dp.put_samples(["a"], pid, {"x": torch.zeros(1)}, tags=[{"weight_version": 0}])
    assert dp.claim_meta(pid, "train", ["x"], 1, blocking=False, where="reward_std > 0").size == 0
    info = dp.describe_partition(pid).staleness
    assert (info.filtered, info.untrained) == ({}, 1)


def test_a_lapsed_grant_is_not_released(dp):
    pid = _register(dp, max_staleness=0, admission_batch=2)
    grant = dp.admit_rollouts(pid, 2, lease_s=0.05)
    # Only the clock: describe (like the next admit) would sweep the lapsed grant first.
    wait_until(lambda: time.time() > grant.expires_at, 10, "the lapse")
    assert dp.release_rollouts(grant) is False


def test_the_over_sampling_cap_counts_per_version(dp):
    pid = _register(dp, max_staleness=3, admission_batch=2, oversample_ratio=1.5)  # 3/version
    assert dp.admit_rollouts(pid, 3) is not None
    assert dp.admit_rollouts(pid, 1) is None  # the cap, though the bound (8) has room
    dp.set_policy_version(pid, 1)
    assert dp.admit_rollouts(pid, 3) is not None


def test_awaited_admission_does_not_block_the_event_loop(dp):
    pid = _register(dp, max_staleness=0, admission_batch=1)
    _put(dp, pid, ["a"], 0)

    async def run():
        waiting = asyncio.ensure_future(dp.admit_rollouts_async(pid, 1, wait=True, timeout_s=30))
        await asyncio.sleep(0)
        meta = await dp.claim_meta_async(pid, "train", ["x"], 1)
        return meta, await waiting

    meta, grant = asyncio.run(run())
    assert meta.sample_ids == ["a"]
    assert grant is not None


# ---- retirement, eviction, introspection ----------------------------------------------------
def test_clear_versions_retires_whole_generations(dp):
    pid = _register(dp, max_staleness=9)
    for v in range(3):
        _put(dp, pid, [f"v{v}-a", f"v{v}-b"], v)
    result = dp.clear_versions(pid, 0, 1)
    assert result.cleared == 4
    assert sorted(dp.peek_meta(pid, "train", ["x"], 9).sample_ids) == ["v2-a", "v2-b"]
    with pytest.raises(InvalidBatch, match="empty"):
        dp.clear_versions(pid, 2, 1)


def test_evict_by_id_is_counted(dp):
    pid = _register(dp)
    _put(dp, pid, ["a", "b"], 0)
    assert dp.evict_samples(["a"], pid) == 1
    info = dp.describe_partition(pid).staleness
    assert info.evicted == 1
    assert info.recently_dropped == ["a"]
    assert dp.peek_meta(pid, "train", ["x"], 2).sample_ids == ["b"]


def test_peek_and_depth_consume_nothing(dp):
    pid = _register(dp, max_staleness=0)
    _put(dp, pid, ["a", "b"], 0)
    assert dp.peek_meta(pid, "train", ["x"], 1).sample_ids == ["a"]
    assert dp.peek_meta(pid, "train", ["x"], 1).sample_ids == ["a"]
    assert dp.ready_depth(pid, ["train"], ["x"]) == {"train": 2}
    assert dp.claim_meta(pid, "train", ["x"], 2).sample_ids == ["a", "b"]
    empty = dp.peek_meta(pid, "train", ["x"], 1)
    assert empty.sample_ids == []
    assert not empty


def test_capabilities_and_ping(dp):
    caps = dp.capabilities()
    assert caps.async_rl
    assert {"version_order", "freshest_first", "grpo_groups"} <= set(caps.claim_policies)
    assert {"admit_rollouts", "set_policy_version", "peek_meta", "ready_depth"} <= set(caps.verbs)
    assert dp.ping() is True


# ---- bad input: every argument of every async-RL verb, sync and awaited ----------------------
SURROGATE = "\ud800"
WRONG = {
    "partition_id": {"int": 5, "none": None, "surrogate": "p" + SURROGATE, "empty": ""},
    "version": {"str": "1", "negative": -1, "float": 1.5, "bool": True},
    "n": {"str": "1", "zero": 0, "negative": -1, "float": 1.5, "bool": True},
    "wait": {"str": "yes", "int": 1},
    "timeout_s": {"str": "1", "negative": -1.0, "nan": float("nan")},
    "lease_s": {"zero": 0.0, "negative": -1.0, "str": "x", "huge": 1e12},
    "grant": {"none": None, "str": "g", "int": 5},
    "sample_ids": {"str": "a", "ints": [1], "surrogate": ["a" + SURROGATE], "empty": []},
    "lowest": {"negative": -1, "str": "0"},
    "highest": {"negative": -1, "float": 1.5},
    "task_name": {"int": 5, "surrogate": "t" + SURROGATE},
    "task_names": {"str": "train", "ints": [5]},
    "required_fields": {"str": "x", "ints": [5]},
    "batch_size": {"zero": 0, "str": "1"},
    "blocking": {"str": "no", "int": 0},
    "where": {"int": 5, "text": "x >> 1", "op": [("reward_std", "~", 1)]},
    "max_staleness": {"negative": -1, "str": "1", "float": 1.5},
}
# What each message names for an argument (the grant's fields are checked as one).
NEEDLE = {"grant": "RolloutGrant", "where": "where", "version": "version"}


def _verb_calls(pid, grant):
    return {
        "set_policy_version": {"partition_id": pid, "version": 1},
        "admit_rollouts": {
            "partition_id": pid,
            "n": 1,
            "wait": False,
            "timeout_s": 1.0,
            "lease_s": 60.0,
        },
        "release_rollouts": {"grant": grant},
        "evict_samples": {"sample_ids": ["a"], "partition_id": pid},
        "clear_versions": {"partition_id": pid, "lowest": 0, "highest": 0},
        "peek_meta": {
            "partition_id": pid,
            "task_name": "train",
            "required_fields": ["x"],
            "batch_size": 1,
            "where": "reward_std > 0",
            "max_staleness": 1,
        },
        "ready_depth": {"partition_id": pid, "task_names": ["train"], "required_fields": ["x"]},
        "claim_meta": {
            "partition_id": pid,
            "task_name": "train",
            "required_fields": ["x"],
            "batch_size": 1,
            "blocking": False,
            "where": "reward_std > 0",
            "max_staleness": 1,
        },
    }


def _state(dp, pid):
    info = dp.describe_partition(pid).staleness
    return (info.version, info.grants, info.dropped_stale, info.evicted), dp.ready_depth(
        pid, ["train"]
    )


def test_bad_arguments_of_every_async_rl_verb_are_invalid_batch_naming_them(dp):
    pid = _register(dp, max_staleness=1, admission_batch=4)
    _put(dp, pid, ["a", "b"], 0)
    grant = dp.admit_rollouts(pid, 1)
    before = _state(dp, pid)
    wrong, tried = [], 0
    for verb, base in _verb_calls(pid, grant).items():
        for arg in base:
            for label, value in WRONG[arg].items():
                for awaited in (False, True):
                    tried += 1
                    call = getattr(dp, f"{verb}_async" if awaited else verb)
                    kwargs = {**base, arg: value}
                    try:
                        if awaited:
                            asyncio.run(call(**kwargs))
                        else:
                            call(**kwargs)
                        raised = None
                    except Exception as e:  # noqa: BLE001 - judged below
                        raised = e
                    name = f"{verb}{'_async' if awaited else ''}({arg}={label})"
                    if not isinstance(raised, InvalidBatch):
                        wrong.append(f"{name} raised {raised!r:.200}")
                    elif NEEDLE.get(arg, arg) not in str(raised):
                        wrong.append(f"{name}: {str(raised)[:160]!r} does not name {arg}")
    assert wrong == []
    assert tried >= 170  # 87 wrong arguments, each called and awaited
    assert _state(dp, pid) == before  # nothing changed
