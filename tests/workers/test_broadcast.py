"""Two-phase broadcast of a BatchedDataDict: every rank of a real gloo group gets identical bytes.

Mixed dtypes (bf16, bool, int64, float32, uint8, a 0-element tensor), a jagged
nested tensor, every plain value a BatchedDataDict may hold (str, int, float,
bool, None, and lists / tuples / dicts of them) and microbatch metadata travel
from the leader to its siblings in other processes. A value that cannot travel
raises the same typed error on every rank (no sibling is left waiting in the
collective); misuse (leader without data, non-leader with data) fails loudly
before any rank enters a collective.
"""

import os
import sys

import pytest
import ray
import torch

from dataplane_client.batching.batched_data_dict import BatchedDataDict
from dataplane_client.wire.errors import NonTensorField
from policy_workers.broadcast import broadcast_batched_data_dict
from policy_workers.recording import batch_digest
from policy_workers.sharding import NamedSharding
from policy_workers.worker_group import DistributedWorker, RayWorkerGroup

# Ray workers cannot import this test module by name: ship its classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

WORLD = 3  # a leader and two siblings


def make_batch() -> BatchedDataDict:
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 1000, (n,), generator=g) for n in (3, 1, 5, 2)]
    data = BatchedDataDict(
        {
            "input_ids": torch.randint(0, 2**40, (4, 6), generator=g),  # int64 beyond int32
            "logprobs": torch.randn(4, 6, generator=g).to(torch.bfloat16),
            "token_mask": torch.rand(4, 6, generator=g) > 0.5,
            "sample_mask": torch.tensor([1.0, 0.0, 1.0, float("nan")]),  # NaN bits survive
            "pixels": torch.randint(0, 255, (4, 2, 3), generator=g).to(torch.uint8),
            "empty": torch.zeros(4, 0),
            "jagged": torch.nested.nested_tensor(rows, layout=torch.jagged),
            "prompt": ["a", "bb", {"k": [1, 2]}, None],
            "task": "grpo",  # plain scalars: str, int, float, bool, None
            "step": 3,
            "temperature": 0.7,
            "greedy": False,
            "note": None,
            "rewards": [0.5, 1, True, -2.25],  # lists and tuples of numbers
            "pair": (1, "x"),
        }
    )
    data.micro_batch_indices = [[[0, 2], [2, 4]]]
    data.micro_batch_lengths = [[6, 5]]
    return data


class BroadcastProbe(DistributedWorker):
    """Rank 0 leads; everyone returns who it is and what it holds after the broadcast."""

    def run(self):
        leader = self.rank == 0
        data = make_batch() if leader else None
        out = broadcast_batched_data_dict(data, is_leader=leader, src=0, group=self.replica_group)
        return (self.rank, os.getpid(), out, batch_digest(out))

    def run_unsendable(self, value):
        """The leader's batch holds ``value`` in field "bad"; every rank reports what it raised."""
        leader = self.rank == 0
        data = BatchedDataDict({"x": torch.arange(3), "bad": value}) if leader else None
        try:
            broadcast_batched_data_dict(data, is_leader=leader, src=0, group=self.replica_group)
        except NonTensorField as e:
            return (type(e).__name__, e.fields)
        return ("no error", [])


@pytest.fixture(scope="module")
def group(ray_session):
    g = RayWorkerGroup(
        BroadcastProbe,
        NamedSharding.for_policy(tp=WORLD),
        num_cpus_per_worker=0.5,
        collective_timeout_s=60,
    )
    yield g
    g.shutdown()


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.slow  # three worker processes and their first gloo rendezvous: ~40 s here
def test_every_rank_receives_identical_bytes(group):
    results = ray.get(group.run_all_workers_single_data("run"))
    # one answer per rank, each from its own process: siblings really received it
    assert sorted(r[0] for r in results) == list(range(WORLD))
    assert len({r[1] for r in results}) == WORLD
    sent = make_batch()
    digests = {r[3] for r in results}
    assert digests == {batch_digest(sent)}
    for _, _, out, _ in results:
        assert list(out.keys()) == list(sent.keys())
        for key, value in sent.items():
            got = out[key]
            if not isinstance(value, torch.Tensor):
                assert type(got) is type(value), key
                assert got == value, key
            elif value.is_nested:
                assert got.is_nested
                assert torch.equal(got.offsets(), value.offsets())
                assert _bytes(got.values()) == _bytes(value.values())
            else:
                assert got.dtype == value.dtype, key
                assert got.shape == value.shape, key
                assert _bytes(got) == _bytes(value), key
        assert out.micro_batch_indices == sent.micro_batch_indices
        assert out.micro_batch_lengths == sent.micro_batch_lengths


@pytest.mark.slow
@pytest.mark.parametrize(
    "value",
    [{1, 2}, [torch.zeros(2), torch.ones(3)], b"raw", object()],
    ids=["set", "list_of_tensors", "bytes", "object"],
)
def test_a_value_that_cannot_travel_fails_on_every_rank(group, value):
    results = ray.get(group.run_all_workers_single_data("run_unsendable", value))
    assert results == [("NonTensorField", ["bad"])] * WORLD


@pytest.mark.parametrize(
    ("data", "is_leader"),
    [(None, True), (BatchedDataDict({"x": torch.zeros(1)}), False)],
    ids=["leader_without_data", "sibling_with_data"],
)
def test_misuse_fails_before_any_communication(data, is_leader):
    # raised before the first collective, so no rank is left waiting in a broadcast
    with pytest.raises(ValueError, match="must pass"):
        broadcast_batched_data_dict(data, is_leader=is_leader, src=0, group=None)
