"""The staleness bound, as properties of the key space (no Ray): random puts at random
versions, version bumps, claims of bounded and unbounded tasks, drops, evictions and a
journal round trip of the versioned state. Whatever the order:

- no handed-out sample is older than its task's window at the moment of the claim
  (a group is as old as its oldest member);
- no sample is both dropped (or evicted) and handed out;
- GRPO groups are never split, by a claim, a drop or an eviction.
"""

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataplane_client.messages import CommitRequest, StalenessSpec
from dataplane_server.core import async_rl
from dataplane_server.core.keyspace import CommitPlan, KeySpace, declaration

GROUP = 2
BOUND = {"train": 1, "eval": 0}  # "log" is unbounded
FIELD = ("dense", "float32", ())


class Clock:
    now = 1000.0

    def __call__(self):
        return self.now


def _space(drop: bool, evict: bool):
    ks = KeySpace(Clock())
    ks.unit_alive = [True]
    spec = StalenessSpec(
        max_staleness=dict(BOUND), stale_samples="drop" if drop else "keep", evict_stale=evict
    )
    ks.register(
        "p",
        declaration("p", ["x"], None, ["train", "eval", "log"], GROUP, staleness=spec),
    )
    return ks


def _put(ks, group: int, versions: tuple[int, int]):
    ids = [f"g{group}-{i}" for i in range(GROUP)]
    tags = [{"group_id": group, "weight_version": v} for v in versions]
    plan = ks.check_commit(
        CommitRequest(
            partition_id="p",
            write_id=f"w{group}",
            sample_ids=ids,
            units=[0] * GROUP,
            schemas={"x": FIELD},
            sequence_lengths=None,
            tags=tags,
            overwrite=False,
            staged_units=[0],
        )
    )
    assert isinstance(plan, CommitPlan)
    ks.apply_commit(plan)


_step = st.one_of(
    st.tuples(st.just("put"), st.integers(0, 3), st.integers(0, 3)),
    st.tuples(st.just("bump"), st.integers(0, 2)),
    st.tuples(st.just("claim"), st.sampled_from(["train", "eval", "log"]), st.integers(1, 3)),
    st.tuples(st.just("drop")),
    st.tuples(st.just("evict")),
    st.tuples(st.just("journal")),
)


def _run(done: Counter, steps, drop: bool, evict: bool):
    ks = _space(drop, evict)
    part = ks.partition("p")
    versions = part.versions
    next_group = 0
    handed: dict[str, set[str]] = {t: set() for t in ("train", "eval", "log")}
    removed: set[str] = set()
    dropped: set[str] = set()
    for step in steps:
        if step[0] == "put":
            base = versions.version
            _put(ks, next_group, (max(base - step[1], 0), max(base - step[2], 0)))
            next_group += 1
        elif step[0] == "bump":
            versions.set_version(versions.check_version(versions.version + step[1]))
            done["bump"] += 1
        elif step[0] == "claim":
            task = step[1]
            meta = ks.claim(part, task, ["x"], GROUP * step[2], partial_ok=True)
            if meta is None:
                continue
            done["claim"] += 1
            oldest = {}
            for tag in meta.tags:
                group = tag["group_id"]
                oldest[group] = min(oldest.get(group, tag["weight_version"]), tag["weight_version"])
            if task in BOUND:
                assert min(oldest.values()) >= versions.version - BOUND[task], (meta, oldest)
            groups = Counter(sid.split("-")[0] for sid in meta.sample_ids)
            assert set(groups.values()) == {GROUP}, f"a group was split: {groups}"
            assert not removed & set(meta.sample_ids)
            handed[task].update(meta.sample_ids)
        elif step[0] in ("drop", "evict"):
            removal = (
                async_rl.stale_removal(ks, part)
                if step[0] == "drop"
                else async_rl.eviction(ks, part)
            )
            if removal is None:
                continue
            done[step[0]] += 1
            ids = removal.ids
            groups = Counter(sid.split("-")[0] for sid in ids)
            assert set(groups.values()) == {GROUP}, f"a {step[0]} split a group: {groups}"
            if step[0] == "evict":  # only what no task holds or consumed
                assert not set(ids) & set().union(*handed.values())
            else:  # only what a bounded task that has not had it could never claim
                assert all(any(sid not in handed[t] for t in BOUND) for sid in ids), (
                    "dropped a sample every bounded task already had"
                )
            async_rl.apply_removal(ks, removal)
            removed.update(ids)
            if step[0] == "drop":
                dropped.update(ids)
        else:  # the versioned state round-trips through the journal's snapshot form
            saved = versions.export()
            versions.restore(saved)
            assert versions.export() == saved
    # Every removal is counted: evictions once, drops once per task they were stale for.
    assert versions.evicted == len(removed - dropped)
    assert len(dropped) <= sum(versions.dropped.values()) <= len(BOUND) * len(dropped)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=st.lists(_step, max_size=40),
    drop=st.booleans(),
    evict=st.booleans(),
)
def _property(done, steps, drop, evict):
    _run(done, steps, drop, evict)


def test_no_handed_out_sample_is_over_the_bound_and_nothing_is_both_dropped_and_handed_out():
    done: Counter = Counter()
    _property(done)
    # The property is only worth something if the steps it checks really happened.
    for kind in ("claim", "bump", "drop", "evict"):
        assert done[kind] >= 20, done
