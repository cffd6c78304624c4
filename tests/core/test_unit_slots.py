"""A storage unit's slot bookkeeping (no Ray): the vectorised assignment gives every id the
slot the one-by-one rule would (known ids keep theirs; new ids take freed slots, last
freed first, then fresh ones), and commit metadata lands on the right slots."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dataplane_server.core.recovery_messages import SampleMeta
from dataplane_server.core.unit.partition import UnitPartition


def _one_by_one(part: UnitPartition, ids: list[str]) -> list[int]:
    out = []
    for sid in ids:
        if sid not in part.slot_of:
            part.slot_of[sid] = part.free_slots.pop() if part.free_slots else part.next_slot
            part.next_slot += part.slot_of[sid] == part.next_slot
        out.append(part.slot_of[sid])
    return out


_writes = st.lists(
    st.tuples(
        st.lists(st.integers(0, 40).map(lambda i: f"s{i}"), max_size=25),  # ids (repeats too)
        st.sets(st.integers(0, 40).map(lambda i: f"s{i}")),  # ids cleared afterwards
    ),
    max_size=8,
)


@settings(max_examples=300, deadline=None)
@given(_writes)
def test_slots_match_the_one_by_one_rule(writes):
    fast, slow = UnitPartition(), UnitPartition()
    for ids, cleared in writes:
        assert fast.slots_for(ids).tolist() == _one_by_one(slow, ids)
        assert fast.slot_of == slow.slot_of
        assert fast.next_slot == slow.next_slot
        for part in (fast, slow):
            for sid in sorted(cleared & set(part.slot_of)):
                part.free_slots.append(part.slot_of.pop(sid))


def test_commit_metadata_first_commit_wins_and_tags_merge():
    part = UnitPartition()
    ids = ["a", "b", "c"]
    slots = part.slots_for(ids)
    part.remember(slots, ids, SampleMeta(5, {"a": 7, "c": 9}, {"b": {"x": 1}}))
    later = part.slots_for(["b", "c", "d"])
    part.remember(later, ["b", "c", "d"], SampleMeta(6, {"b": 3, "c": 4, "d": 2}, {"b": {"y": 2}}))
    by_id = dict(zip(["a", "b", "c", "d"], [*slots.tolist(), int(later[2])]))
    assert [int(part.seq[by_id[s]]) for s in "abcd"] == [5, 5, 5, 6]
    assert [int(part.seq_len[by_id[s]]) for s in "abcd"] == [7, 3, 9, 2]
    assert part.tags[by_id["b"]] == {"x": 1, "y": 2}
    assert np.all(part.seq[: part.next_slot] >= 0)
