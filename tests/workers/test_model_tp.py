"""Vocab-parallel logprobs and gradients equal the unsharded float32 reference.

Single-process checks pin the logprob convention, the packed forward and the
closed-form backward; a real 2-process gloo TP group (two Ray actors) checks
the sharded head, with an uneven vocabulary split and with tied embeddings.
"""

import sys

import pytest
import ray
import torch
import torch.distributed as dist

from policy_workers.config import ModelConfig
from policy_workers.model import (
    VocabParallelCausalLM,
    build_hf_model,
    reference_logprobs,
    vocab_parallel_target_logprobs,
    vocab_shard_range,
)
from policy_workers.sharding import TENSOR_PARALLEL, NamedSharding
from policy_workers.worker_group import DistributedWorker, RayWorkerGroup

# Ray workers cannot import this test module by name: ship its classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

TOL = 1e-5
# 131 = 66 + 65 rows: an uneven vocabulary split over TP=2
UNTIED = ModelConfig(vocab_size=131, hidden_size=32, num_hidden_layers=2, seed=7)
TIED = ModelConfig(
    vocab_size=131, hidden_size=32, num_hidden_layers=2, seed=8, tie_word_embeddings=True
)


def _batch(vocab: int = 131, lengths=(5, 11, 2, 16, 9), seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lengths)
    ids = torch.randint(1, vocab, (len(lengths), max(lengths) + 3), generator=g)  # 3 extra pad cols
    for i, n in enumerate(lengths):
        ids[i, n:] = 0
    return ids, lens


# ---- single process ------------------------------------------------------------------------
def test_vocab_shard_range_covers_vocab_contiguously():
    for vocab, tp in [(131, 2), (128, 4), (7, 3), (5, 8)]:
        ranges = [vocab_shard_range(vocab, tp, r) for r in range(tp)]
        assert ranges[0][0] == 0
        assert ranges[-1][1] == vocab
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        sizes = [e - s for s, e in ranges]
        assert max(sizes) - min(sizes) <= 1


def test_tiny_model_is_deterministic_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_hf_model(UNTIED)
    after = torch.rand(1)
    b = build_hf_model(UNTIED)
    assert torch.equal(before, after)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb
        assert torch.equal(pa, pb)


def test_logprob_convention_and_unsharded_equivalence():
    hf = build_hf_model(UNTIED)
    ids, lens = _batch()
    ref = reference_logprobs(hf, ids, lens)
    model = VocabParallelCausalLM(hf)
    with torch.no_grad():
        padded = model.forward_padded(ids, lens)
        packed = model.forward_packed(ids, lens)
    # position 0 is 0; positions at or beyond the length are 0; the rest are real logprobs
    assert torch.all(padded[:, 0] == 0)
    for i, n in enumerate(lens.tolist()):
        assert torch.all(padded[i, n:] == 0)
        assert torch.all(padded[i, 1:n] < 0)
    # token i's logprob at position i: compare one entry with an explicit computation
    with torch.no_grad():
        logits = hf(input_ids=ids[1:2, :4]).logits.float()
    explicit = torch.log_softmax(logits[0, 2], -1)[ids[1, 3]]
    assert abs(float(padded[1, 3]) - float(explicit)) <= TOL
    assert (padded - ref).abs().max() <= TOL
    assert (packed - ref).abs().max() <= TOL


def test_vocab_parallel_backward_matches_autograd():
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 6, (2, 3))
    assert torch.autograd.gradcheck(
        lambda x: vocab_parallel_target_logprobs(x, t, vocab_start=0), (x,)
    )
    y = x.detach().clone().requires_grad_(True)
    ref = torch.log_softmax(y, -1).gather(-1, t.unsqueeze(-1)).squeeze(-1)
    ours = vocab_parallel_target_logprobs(x, t, vocab_start=0)
    w = torch.randn(2, 3, dtype=torch.float64)
    (ref * w).sum().backward()
    (ours * w).sum().backward()
    assert torch.allclose(x.grad, y.grad, atol=1e-12)


# ---- a real 2-process TP group ---------------------------------------------------------------
class TPProbe(DistributedWorker):
    """Holds the untied and the tied tiny model, sharded over the TP group."""

    def setup(self) -> None:
        tp_rank = self.coords[TENSOR_PARALLEL]
        tp_size = self.sharding.get_axis_size(TENSOR_PARALLEL)
        self.models = {
            name: VocabParallelCausalLM(
                build_hf_model(cfg), tp_group=self.tp_group, tp_rank=tp_rank, tp_size=tp_size
            )
            for name, cfg in (("untied", UNTIED), ("tied", TIED))
        }

    def head_rows(self, which: str) -> tuple[int, int]:
        m = self.models[which]
        return m.vocab_start, m.vocab_end

    def logprobs(self, which: str, ids, lens, packed: bool):
        m = self.models[which]
        with torch.no_grad():
            return (m.forward_packed if packed else m.forward_padded)(ids, lens)

    def grads(self, which: str, ids, lens, weights, packed: bool):
        """Gradients of sum(weights * logprobs); the head's gradient gathered over TP."""
        m = self.models[which]
        m.zero_grad(set_to_none=True)
        lp = (m.forward_packed if packed else m.forward_padded)(ids, lens)
        (lp * weights).sum().backward()
        out = {k: p.grad.clone() for k, p in m.body.named_parameters() if p.grad is not None}
        if m.head_weight is not None:
            parts = [None] * dist.get_world_size(self.tp_group)
            dist.all_gather_object(parts, m.head_weight.grad.clone(), group=self.tp_group)
            out["lm_head.weight"] = torch.cat(parts)
        return out


@pytest.fixture(scope="module")
def tp_group(ray_session):
    group = RayWorkerGroup(TPProbe, NamedSharding.for_policy(tp=2), num_cpus_per_worker=0.5)
    ray.get(group.run_all_workers_single_data("setup"))
    yield group
    group.shutdown()


def _on_both(group, method, *args):
    return ray.get(group.run_all_workers_single_data(method, *args))


@pytest.mark.slow  # the first test on the TP=2 worker group pays its ~50 s start-up here
def test_head_is_split_by_vocabulary(tp_group):
    assert _on_both(tp_group, "head_rows", "untied") == [(0, 66), (66, 131)]


@pytest.mark.slow
@pytest.mark.parametrize("which", ["untied", "tied"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_tp2_logprobs_equal_unsharded_reference(tp_group, which, packed):
    cfg = UNTIED if which == "untied" else TIED
    ids, lens = _batch()
    ref = reference_logprobs(build_hf_model(cfg), ids, lens).detach()
    outs = _on_both(tp_group, "logprobs", which, ids, lens, packed)
    for out in outs:
        assert out.shape == ref.shape
        assert (out - ref).abs().max() <= TOL
    assert torch.equal(outs[0], outs[1])  # the log-softmax is assembled identically on both ranks


@pytest.mark.slow
@pytest.mark.parametrize("which", ["untied", "tied"])
def test_tp2_gradients_equal_unsharded_reference(tp_group, which):
    cfg = UNTIED if which == "untied" else TIED
    ids, lens = _batch(seed=3)
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(5))
    hf = build_hf_model(cfg)
    (reference_logprobs(hf, ids, lens) * weights).sum().backward()
    ref = {k: p.grad for k, p in hf.base_model.named_parameters()}
    if not cfg.tie_word_embeddings:
        ref["lm_head.weight"] = hf.lm_head.weight.grad
    for packed in (False, True):
        for grads in _on_both(tp_group, "grads", which, ids, lens, weights, packed):
            assert set(grads) == set(ref)
            for k, g in grads.items():
                assert (g - ref[k]).abs().max() <= TOL, k
