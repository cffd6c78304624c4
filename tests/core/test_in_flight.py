"""The index of commits in flight answers as a plain list of plans would, whichever of its
paths (a plan alone in its partition, or sharing it) each change takes."""

from hypothesis import given, settings
from hypothesis import strategies as st

from dataplane_server.core.in_flight import SamplesInFlight

PARTITIONS = ["p", "q"]
SAMPLES = [f"s{i}" for i in range(6)]


class _Plan:
    """Compared by identity, as ``CommitPlan`` is."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


def _reference(flight: list, partition_id: str, sample_ids: list) -> list:
    """(position, plan) of every plan in flight writing each sample, oldest first."""
    return [
        (i, plan)
        for i, s in enumerate(sample_ids)
        for pid, ids, plan in flight
        if pid == partition_id and s in ids
    ]


_change = st.one_of(
    st.tuples(
        st.just("add"),
        st.sampled_from(PARTITIONS),
        st.lists(st.sampled_from(SAMPLES), min_size=1, max_size=4, unique=True),
    ),
    st.tuples(st.just("remove"), st.integers(0, 20)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_change, max_size=25))
def test_sharing_matches_a_plain_list_of_the_plans_in_flight(changes):
    index, flight = SamplesInFlight(), []
    for n, change in enumerate(changes):
        if change[0] == "add":
            _, pid, ids = change
            plan = _Plan(f"plan{n}")
            index.add(pid, ids, plan)
            flight.append((pid, ids, plan))
        elif flight:
            pid, ids, plan = flight.pop(change[1] % len(flight))
            index.remove(pid, ids, plan)
            index.remove(pid, ids, plan)  # a second removal changes nothing
        for pid in PARTITIONS:
            assert list(index.sharing(pid, SAMPLES)) == _reference(flight, pid, SAMPLES)


def test_removing_a_plan_never_added_leaves_the_others():
    index, a, stranger = SamplesInFlight(), _Plan("a"), _Plan("stranger")
    index.add("p", ["s0", "s1"], a)
    index.remove("p", ["s0", "s1"], stranger)
    assert list(index.sharing("p", ["s0", "s1"])) == [(0, a), (1, a)]
