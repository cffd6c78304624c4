"""Policy workers through the data plane equal the unsharded reference and the classic path.

One DP=2 x TP=2 policy (four Ray actors, gloo) serves the whole module. For
plain microbatches, dynamic batching and sequence packing, with jagged
lengths:

- logprobs and reference logprobs written to the store by the workers equal
  the unsharded single-process float32 reference and the classic path
  (tensors shipped by the driver);
- every TP sibling fetched byte-identical inputs, only replica leaders wrote,
  and a non-leader write-back is refused (by the mixin, and by the store with
  FieldAlreadyProduced when the guard is bypassed);
- one train step through the data plane gives the loss, grad norm and updated
  weights of the classic path and of a single-process reference step, and the
  weights are identical across DP ranks;
- the driver only ever ships metas and gets back ``None`` or small dicts
  (seen through an opt-in DispatchRecorder; workers record their I/O only
  once switched on).

The mixin's failure paths (abstract coordinates, bad fetch policy, missing
client, non-leader write) and the recorders' bounds are checked without Ray
at the end.
"""

import pickle
import sys
import uuid

import pytest
import ray
import torch

from dataplane_client.batching.batched_data_dict import BatchedDataDict
from dataplane_client.batching.preshard import GLOBAL_FORWARD_PAD_SEQLEN, MICRO_BATCH_INDICES
from dataplane_client.wire.errors import FieldAlreadyProduced
from dataplane_client.wire.meta import KVBatchMeta
from policy_workers.config import (
    DynamicBatchingConfig,
    LossConfig,
    ModelConfig,
    OptimizerConfig,
    PolicyConfig,
    SequencePackingConfig,
)
from policy_workers.loss import ClippedPGLoss, valid_token_mask
from policy_workers.model import build_hf_model, reference_logprobs
from policy_workers.rank_stream import StreamStep
from policy_workers.recording import DispatchRecorder, IORecorder, batch_digest
from policy_workers.tq_mixin import NotReplicaLeader, TQWorkerMixin, _cut_to_lengths
from policy_workers.tq_policy import TQPolicy, contains_tensor
from policy_workers.worker import PolicyWorker

# Ray workers cannot import this test module by name: ship its classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

TOL = 1e-5
N = 8
LENGTHS = [5, 17, 3, 24, 9, 12, 20, 7]  # jagged; longest 24
PAD_ID = 0
MODEL = ModelConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, seed=11)
LOSS = LossConfig(ratio_clip_min=0.2, ratio_clip_max=0.25, use_importance_sampling_correction=True)
# eps 1e-6 (not 1e-8): Adam's first step is ~lr * g / (|g| + eps), which for gradients
# near 1e-8 turns float32 summation-order noise into 1e-5-sized weight differences
OPT = OptimizerConfig(name="adamw", lr=1e-2, eps=1e-6, max_grad_norm=0.5)
MODES = {
    "plain": (None, None),
    "dynamic": (
        DynamicBatchingConfig(
            enabled=True, logprob_mb_tokens=48, train_mb_tokens=40, sequence_length_round=4
        ),
        None,
    ),
    "packing": (
        None,
        SequencePackingConfig(enabled=True, logprob_mb_tokens=40, train_mb_tokens=48),
    ),
}


class RecordingWorker(PolicyWorker):
    """PolicyWorker plus test hooks that production code must not have."""

    def fetch_digest(self, meta: KVBatchMeta, fetch_policy: str) -> str:
        return batch_digest(self._fetch(meta, fetch_policy=fetch_policy))

    def attempt_write_back(self, meta: KVBatchMeta, field: str, bypass_guard: bool) -> str:
        rows = [torch.full((n,), 7.0) for n in meta.sequence_lengths]
        try:
            if bypass_guard:  # straight to the store, as a buggy worker would
                self._require_dp_client().put_samples(
                    meta.sample_ids, meta.partition_id, {field: rows}
                )
            else:
                self._write_back(
                    meta, {field: torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)}
                )
        except (NotReplicaLeader, FieldAlreadyProduced) as e:
            return type(e).__name__
        return "written"


# ---- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def policy(service):
    cfg = PolicyConfig(
        dp=2,
        tp=2,
        model=MODEL,
        loss=LOSS,
        optimizer=OPT,
        train_global_batch_size=N,
        train_micro_batch_size=2,
        logprob_batch_size=3,
        pad_token_id=PAD_ID,
        num_cpus_per_worker=0.5,
        collective_timeout_s=120,
        data_plane=service.config,
    )
    p = TQPolicy(cfg, worker_cls=RecordingWorker, recorder=DispatchRecorder(keep_last=4))
    p.run_on_all_workers("save_training_state")  # the initial weights, to replay train steps
    yield p
    p.shutdown()


@pytest.fixture(scope="module")
def batch():
    """Token ids and GRPO fields, as jagged rows and as a padded BatchedDataDict."""
    g = torch.Generator().manual_seed(42)
    lens = torch.tensor(LENGTHS)
    width = max(LENGTHS)
    rows = [torch.randint(1, MODEL.vocab_size, (n,), generator=g) for n in LENGTHS]
    padded_ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=PAD_ID)
    ref_model = build_hf_model(MODEL)
    with torch.no_grad():
        ref_lp = reference_logprobs(ref_model, padded_ids, lens)
    jag = {
        "token_mask": [torch.cat([torch.zeros(2), torch.ones(n - 2)]).long() for n in LENGTHS],
        "advantages": [torch.randn(n, generator=g) for n in LENGTHS],
        "prev_logprobs": [
            ref_lp[i, :n] + 0.3 * torch.randn(n, generator=g) for i, n in enumerate(LENGTHS)
        ],
    }
    jag["generation_logprobs"] = [
        r + 0.05 * torch.randn(len(r), generator=g) for r in jag["prev_logprobs"]
    ]
    dense = {"input_lengths": lens, "sample_mask": torch.tensor([1.0, 1, 1, 1, 0, 1, 1, 1])}
    padded = BatchedDataDict({"input_ids": padded_ids, **dense})
    for k, v in jag.items():
        padded[k] = torch.nn.utils.rnn.pad_sequence(v, batch_first=True)
        assert padded[k].shape[1] == width
    return {"rows": rows, "jagged": jag, "dense": dense, "padded": padded, "ref_lp": ref_lp}


def _put(client, batch, fields, tasks=()) -> KVBatchMeta:
    pid = f"pw-{uuid.uuid4().hex[:8]}"
    client.register_partition(pid, fields=fields, consumer_tasks=list(tasks))
    values = {"input_ids": batch["rows"], **batch["dense"], **batch["jagged"]}
    return client.put_samples([f"s{i}" for i in range(N)], pid, {k: values[k] for k in fields})


def _mode(policy, name):
    dyn, pack = MODES[name]
    policy.configure_batching(dyn, pack)


@pytest.fixture(params=list(MODES))
def mode(request, policy) -> str:
    """Each micro-batching mode in turn (plain, dynamic batching, sequence packing), set on
    the module's policy before the test."""
    _mode(policy, request.param)
    return request.param


def _rank(policy, dp, tp):
    return policy.sharding.get_rank(
        pipeline_parallel=0, data_parallel=dp, context_parallel=0, tensor_parallel=tp
    )


# ---- logprobs ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_logprobs_through_data_plane_equal_reference_and_classic(policy, client, batch, mode):
    meta = _put(client, batch, ["input_ids", "input_lengths"])
    policy.run_on_all_workers("set_io_recording", True)
    policy.recorder.clear()

    out = policy.get_logprobs_from_meta(meta)
    out = policy.get_reference_policy_logprobs_from_meta(out)
    assert set(out.fields) >= {"prev_logprobs", "reference_policy_logprobs"}

    # the driver shipped keys only and got nothing but None back
    assert len(policy.recorder.shipped) == 2
    for metas in policy.recorder.shipped:
        assert all(isinstance(m, KVBatchMeta) and not contains_tensor(m) for m in metas)
        assert {m.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] for m in metas} == {max(LENGTHS)}
        assert (MICRO_BATCH_INDICES in metas[0].extra_info) == (mode != "plain")
    assert policy.recorder.received == [[None, None], [None, None]]

    # results live in the store, jagged like input_ids, and equal the unsharded reference
    jag = policy.read_from_dataplane(
        out, ["prev_logprobs", "reference_policy_logprobs"], layout="jagged"
    )
    for key in ("prev_logprobs", "reference_policy_logprobs"):
        assert (jag[key].offsets().diff() == torch.tensor(LENGTHS)).all()
    got = policy.read_from_dataplane(out, ["prev_logprobs", "reference_policy_logprobs"])
    ref = batch["ref_lp"]
    assert (got["prev_logprobs"] - ref).abs().max() <= TOL
    # no training yet: the policy still is the reference
    assert (got["reference_policy_logprobs"] - ref).abs().max() <= TOL

    classic_input = BatchedDataDict({k: batch["padded"][k] for k in ("input_ids", "input_lengths")})
    classic = policy.get_logprobs(classic_input)["logprobs"]
    classic_ref = policy.get_reference_policy_logprobs(classic_input)["logprobs"]
    assert (classic - got["prev_logprobs"]).abs().max() <= TOL
    assert (classic_ref - got["reference_policy_logprobs"]).abs().max() <= TOL

    # siblings fetched byte-identical batches; only leaders wrote; every sample written once
    logs = policy.run_on_all_workers("get_io_log")
    for dp in range(2):
        leader, sibling = logs[_rank(policy, dp, 0)], logs[_rank(policy, dp, 1)]
        fetches = [e for e in leader if e["op"] == "fetch"]
        assert len(fetches) == 2
        assert all(e["policy"] == "leader_broadcast" for e in fetches)
        # each pass fetched only what it reads, not every field its meta lists
        # (the second pass's meta lists prev_logprobs too)
        assert all(e["fields"] == ["input_ids", "input_lengths"] for e in fetches)
        assert [e["digest"] for e in fetches] == [
            e["digest"] for e in sibling if e["op"] == "fetch"
        ]
        assert not [e for e in sibling if e["op"] == "write"]
    writes = [e for r in (0, 1) for e in logs[_rank(policy, r, 0)] if e["op"] == "write"]
    for field in ("prev_logprobs", "reference_policy_logprobs"):
        written = [s for e in writes if e["fields"] == [field] for s in e["sample_ids"]]
        assert sorted(written) == sorted(meta.sample_ids)


@pytest.mark.slow
def test_fetch_policies_give_identical_batches(policy, client, batch):
    _mode(policy, "plain")
    meta = _put(client, batch, ["input_ids", "input_lengths", "advantages"])
    metas = policy._shard_meta(meta, kind="logprob", batch_size=None)
    digests = {}
    for fetch_policy in ("independent", "leader_broadcast", "auto"):
        futures = policy.worker_group.run_all_workers_sharded_data(
            "fetch_digest",
            metas,
            replicate_on_axes=["pipeline_parallel", "context_parallel", "tensor_parallel"],
            common_kwargs={"fetch_policy": fetch_policy},
            data_arg="meta",
        )
        digests[fetch_policy] = ray.get(futures.refs)
    assert digests["independent"] == digests["leader_broadcast"] == digests["auto"]
    d = digests["independent"]
    assert d[0] == d[1]
    assert d[2] == d[3]
    assert d[0] != d[2]


@pytest.mark.slow
def test_non_leader_write_back_is_rejected(policy, client, batch):
    _mode(policy, "plain")
    meta = _put(client, batch, ["input_ids", "input_lengths"])
    out = policy.get_logprobs_from_meta(meta)
    before = policy.read_from_dataplane(out, ["prev_logprobs"])["prev_logprobs"]
    metas = policy._shard_meta(meta, kind="logprob", batch_size=None)
    sibling = policy.worker_group.workers[_rank(policy, 0, 1)]
    guarded = ray.get(sibling.attempt_write_back.remote(metas[0], "prev_logprobs", False))
    bypassed = ray.get(sibling.attempt_write_back.remote(metas[0], "prev_logprobs", True))
    assert guarded == "NotReplicaLeader"  # the mixin refuses
    assert bypassed == "FieldAlreadyProduced"  # and so does the store, without the guard
    after = policy.read_from_dataplane(out, ["prev_logprobs"])["prev_logprobs"]
    assert torch.equal(before, after)  # a rejected write changes nothing


# ---- training --------------------------------------------------------------------------------------
TRAIN_FIELDS = [
    "input_ids",
    "input_lengths",
    "token_mask",
    "sample_mask",
    "advantages",
    "prev_logprobs",
    "generation_logprobs",
]


@pytest.fixture(scope="module")
def reference_step(batch):
    """One unsharded single-process step: same loss, full-batch normalisation, clip, AdamW."""
    model = build_hf_model(MODEL)
    opt = torch.optim.AdamW(
        model.parameters(), lr=OPT.lr, betas=OPT.betas, eps=OPT.eps, weight_decay=OPT.weight_decay
    )
    data = batch["padded"]
    lp = reference_logprobs(model, data["input_ids"], data["input_lengths"])
    loss, _ = ClippedPGLoss(LOSS)(lp, data, data["sample_mask"].sum(), valid_token_mask(data).sum())
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), OPT.max_grad_norm)
    opt.step()
    params = {f"body.{k}": v.detach() for k, v in model.base_model.named_parameters()}
    params["head_weight"] = model.lm_head.weight.detach()
    return {"loss": float(loss.detach()), "grad_norm": float(norm), "params": params}


def _train_and_collect(policy, run):
    policy.run_on_all_workers("restore_training_state")
    result = run()
    params = policy.run_on_all_workers("get_parameters", True)
    digests = policy.run_on_all_workers("parameters_digest")
    return result, params, digests


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.slow
def test_train_step_through_data_plane_equals_classic_and_reference(
    policy, client, batch, reference_step, mode
):
    meta = _put(client, batch, TRAIN_FIELDS)
    policy.recorder.clear()
    tq, tq_params, tq_digests = _train_and_collect(
        policy, lambda: policy.train_from_meta(meta, gbs=N, mbs=2)
    )
    classic, cl_params, _ = _train_and_collect(
        policy, lambda: policy.train(batch["padded"], gbs=N, mbs=2)
    )

    assert tq["num_steps"] == classic["num_steps"] == 1
    assert abs(tq["loss"] - classic["loss"]) <= TOL
    assert abs(tq["grad_norm"] - classic["grad_norm"]) <= TOL
    assert abs(tq["loss"] - reference_step["loss"]) <= TOL
    assert abs(tq["grad_norm"] - reference_step["grad_norm"]) <= TOL
    assert tq["grad_norm"] > OPT.max_grad_norm  # clipping was exercised
    for rank in range(4):
        assert _max_diff(tq_params[rank], cl_params[rank]) <= TOL
        assert _max_diff(tq_params[rank], reference_step["params"]) <= TOL
    # DP replicas hold bit-identical weights after the step
    for tp in range(2):
        assert tq_digests[_rank(policy, 0, tp)] == tq_digests[_rank(policy, 1, tp)]
    # the step changed the weights
    initial = build_hf_model(MODEL)
    assert float((tq_params[0]["head_weight"] - initial.lm_head.weight.detach()).abs().max()) > 1e-3

    # on the data-plane path the driver received small dicts of floats, no tensor
    (received,) = policy.recorder.received
    assert not contains_tensor(received)
    assert len(pickle.dumps(received)) < 16_384


@pytest.mark.slow
def test_reference_policy_is_frozen_through_training(policy, client, batch):
    _mode(policy, "plain")
    policy.run_on_all_workers("restore_training_state")
    policy.train(batch["padded"], gbs=N, mbs=4)
    meta = _put(client, batch, ["input_ids", "input_lengths"])
    out = policy.get_reference_policy_logprobs_from_meta(policy.get_logprobs_from_meta(meta))
    got = policy.read_from_dataplane(out, ["prev_logprobs", "reference_policy_logprobs"])
    assert (got["reference_policy_logprobs"] - batch["ref_lp"]).abs().max() <= TOL
    assert (got["prev_logprobs"] - batch["ref_lp"]).abs().max() > 1e-3


# ---- per-rank streaming pull: no driver plan (policy_workers/rank_stream.py) -----------------------
BUDGET = 40  # tokens per claim: the eight rows (97 tokens) come in several micro-batches


def _pulled_once_and_balanced(reports, ids) -> None:
    """Every sample pulled by exactly one DP rank, once; totals within the stated bound."""
    pulled = [i for r in reports for mb in r["sample_ids"] for i in mb]
    assert sorted(pulled) == sorted(ids)
    assert all(r["micro_batches"] >= 2 for r in reports)  # pulled in micro-batches
    totals = [r["tokens"] for r in reports]
    assert sum(totals) == sum(LENGTHS)
    assert max(totals) - min(totals) <= max(BUDGET, max(LENGTHS))


@pytest.mark.slow
def test_streamed_logprobs_equal_the_driver_planned_path(policy, client, batch):
    """Each DP leader pulls its own micro-batches under a token budget; the store then holds
    the planned path's logprobs; siblings got their leader's batches; only leaders wrote."""
    _mode(policy, "plain")
    planned = policy.get_logprobs_from_meta(_put(client, batch, ["input_ids", "input_lengths"]))
    want = policy.read_from_dataplane(planned, ["prev_logprobs"])["prev_logprobs"]
    meta = _put(client, batch, ["input_ids", "input_lengths"], tasks=["logprobs", "reference"])
    policy.run_on_all_workers("set_io_recording", True)
    policy.recorder.clear()

    fields = ["input_ids", "input_lengths"]
    step = policy.stream_step(meta.partition_id, "logprobs", fields, N, BUDGET, report_ids=True)
    reports = policy.get_logprobs_streamed(step)
    _pulled_once_and_balanced(reports, meta.sample_ids)
    ref_step = policy.stream_step(meta.partition_id, "reference", fields, N, BUDGET)
    policy.get_reference_policy_logprobs_streamed(ref_step)

    got = policy.read_from_dataplane(
        meta.with_fields(["prev_logprobs"]), ["prev_logprobs", "reference_policy_logprobs"]
    )
    assert (got["prev_logprobs"] - want).abs().max() <= TOL  # the weights as they are now
    assert (got["reference_policy_logprobs"] - batch["ref_lp"]).abs().max() <= TOL

    # the driver shipped one StreamStep per worker (no keys) and got small dicts back
    assert policy.recorder.shipped == [[step] * 4, [ref_step] * 4]
    assert not contains_tensor(policy.recorder.received)
    assert len(pickle.dumps(policy.recorder.received[0])) < 4096
    logs = policy.run_on_all_workers("get_io_log")
    for dp in range(2):
        leader, sibling = logs[_rank(policy, dp, 0)], logs[_rank(policy, dp, 1)]
        fetched = [e["digest"] for e in leader if e["op"] == "fetch"]
        assert len(fetched) >= 4  # two passes, in micro-batches
        assert fetched == [e["digest"] for e in sibling if e["op"] == "fetch"]
        assert not [e for e in sibling if e["op"] == "write"]
    policy.run_on_all_workers("set_io_recording", False)


@pytest.mark.slow
def test_a_streamed_train_step_equals_the_driver_planned_one(
    policy, client, batch, reference_step, mode
):
    meta = _put(client, batch, TRAIN_FIELDS)
    planned, planned_params, _ = _train_and_collect(
        policy, lambda: policy.train_from_meta(meta, gbs=N, mbs=2)
    )
    meta = _put(client, batch, TRAIN_FIELDS, tasks=["train"])
    step = policy.stream_step(meta.partition_id, "train", TRAIN_FIELDS, N, BUDGET, report_ids=True)
    streamed, params, digests = _train_and_collect(policy, lambda: policy.train_streamed(step))
    _pulled_once_and_balanced(streamed["streams"], meta.sample_ids)
    assert streamed["num_steps"] == 1
    assert abs(streamed["loss"] - planned["loss"]) <= TOL
    assert abs(streamed["grad_norm"] - planned["grad_norm"]) <= TOL
    assert abs(streamed["loss"] - reference_step["loss"]) <= TOL
    for rank in range(4):
        assert _max_diff(params[rank], planned_params[rank]) <= TOL
    for tp in range(2):  # DP replicas hold bit-identical weights after the step
        assert digests[_rank(policy, 0, tp)] == digests[_rank(policy, 1, tp)]


@pytest.mark.slow
def test_a_rank_that_pulled_nothing_still_takes_the_step_with_the_others(policy, client, batch):
    """A step of one sample: one DP rank pulls it, the other nothing; both train (the empty
    one on zero rows, in every collective) and the replicas keep identical weights."""
    _mode(policy, "plain")
    meta = _put(client, batch, TRAIN_FIELDS, tasks=["train"])
    step = policy.stream_step(meta.partition_id, "train", TRAIN_FIELDS, 1, BUDGET)
    result, _, digests = _train_and_collect(policy, lambda: policy.train_streamed(step))
    assert sorted(r["samples"] for r in result["streams"]) == [0, 1]
    assert result["num_steps"] == 1
    assert result["grad_norm"] > 0
    for tp in range(2):
        assert digests[_rank(policy, 0, tp)] == digests[_rank(policy, 1, tp)]
    assert client.consumption_detail(meta.partition_id, ["train"])[0].consumed == 1


def test_a_stream_step_claims_what_is_stored_not_input_lengths():
    step = TQPolicy.stream_step("p", "t", ["input_ids", "input_lengths", "x"], 4, 10)
    assert step == StreamStep("p", "t", ("input_ids", "x"), 4, 10)


# ---- the mixin's failure paths, without Ray ---------------------------------------------------------
class _Host(TQWorkerMixin):
    def __init__(self, coords=None, group=None, **cfg):
        self.cfg = PolicyConfig(**cfg)
        self._coords = coords or {
            "pipeline_parallel": 0,
            "data_parallel": 0,
            "context_parallel": 0,
            "tensor_parallel": 0,
        }
        self._group = group

    def _local_coords(self):
        return dict(self._coords)

    def _get_replica_group(self):
        return self._group


def _meta(n=4) -> KVBatchMeta:
    return KVBatchMeta(
        partition_id="p", sample_ids=[f"s{i}" for i in range(n)], sequence_lengths=[3, 1, 4, 2][:n]
    )


def test_local_coords_has_no_default():
    class Forgot(TQWorkerMixin):
        def _get_replica_group(self):
            return None

    with pytest.raises(NotImplementedError, match="_local_coords"):
        Forgot()._is_replica_leader()


def test_a_lone_worker_is_its_own_leader():
    class Lone(TQWorkerMixin):
        def _local_coords(self):
            return {"data_parallel": 3, "tensor_parallel": 0}

    lone = Lone()
    assert lone._get_replica_group() is None  # NeMo-RL's default
    assert lone._is_replica_leader()
    assert lone._replica_leader_rank() == 0  # no process group: rank 0 of its own
    # no siblings, so 'auto' fetches for itself and never tries a broadcast
    with pytest.raises(RuntimeError, match="setup_data_plane"):
        lone._fetch(_meta(), fetch_policy="auto")


def test_fetch_rejects_bad_policies_and_missing_client():
    host = _Host()
    with pytest.raises(ValueError, match="unknown fetch_policy"):
        host._fetch(_meta(), fetch_policy="everyone")
    with pytest.raises(RuntimeError, match="needs a replica group"):
        host._fetch(_meta(), fetch_policy="leader_broadcast")
    with pytest.raises(RuntimeError, match="setup_data_plane"):
        host._fetch(_meta(), fetch_policy="independent")


def test_write_back_is_leader_only():
    sibling = _Host(
        coords={
            "pipeline_parallel": 0,
            "data_parallel": 1,
            "context_parallel": 0,
            "tensor_parallel": 1,
        }
    )
    assert not sibling._is_replica_leader()
    with pytest.raises(NotReplicaLeader):
        sibling._write_back(_meta(), {"prev_logprobs": torch.zeros(4, 4)})
    assert _Host()._is_replica_leader()


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.complex64],
)
def test_write_back_cuts_each_row_to_its_length_in_every_dtype(dtype):
    """The cut of a [N, S, ...] result to jagged rows (numpy's gather on the CPU, a
    reinterpretation for dtypes numpy lacks): row i is exactly value[i, :length_i]
    (lengths past S clamp), in the value's dtype and trailing shape."""
    g = torch.Generator().manual_seed(1)
    value = (torch.randn(16, 12, 3, generator=g) * 8).to(dtype)
    lengths = [0, 12, 20, *torch.randint(0, 13, (13,), generator=g).tolist()]
    cut = _cut_to_lengths(value, lengths)
    assert cut.values().dtype == dtype
    for i, row in enumerate(cut.unbind()):
        assert torch.equal(row, value[i, : min(lengths[i], 12)]), i


@pytest.mark.parametrize("mode", ["dynamic", "packing"])
def test_pack_metadata_trusted_from_driver_else_rederived(mode):
    dyn, pack = MODES[mode]
    host = _Host(
        dynamic_batching=dyn or DynamicBatchingConfig(),
        sequence_packing=pack or SequencePackingConfig(),
    )
    meta = _meta()
    data = BatchedDataDict(
        {
            "input_ids": torch.ones(4, 4, dtype=torch.long),
            "input_lengths": torch.tensor(meta.sequence_lengths),
            "sid": list(meta.sample_ids),
        }
    )
    # driver metadata present: attached as-is, order untouched
    planted = dict(meta.extra_info, micro_batch_indices=[[[0, 4]]], micro_batch_lengths=[[4]])
    if mode == "packing":
        planted["elem_counts_per_gb"] = [4]
    trusted = KVBatchMeta(
        partition_id="p",
        sample_ids=meta.sample_ids,
        sequence_lengths=meta.sequence_lengths,
        extra_info=planted,
    )
    out, out_meta = host._attach_or_repack_pack_metadata(BatchedDataDict(dict(data)), trusted)
    assert out.micro_batch_indices == [[[0, 4]]]
    assert out_meta.sample_ids == meta.sample_ids
    # absent: re-derived locally; the returned meta follows the (possibly re-sorted) rows
    out, out_meta = host._attach_or_repack_pack_metadata(BatchedDataDict(dict(data)), meta)
    assert out.micro_batch_indices is not None
    assert len(out.micro_batch_indices) == 1
    assert out["sid"] == out_meta.sample_ids
    assert out["input_lengths"].tolist() == out_meta.sequence_lengths


# ---- opt-in bookkeeping -----------------------------------------------------------------------------
def test_io_recording_is_off_by_default_and_bounded_when_on(client, batch, monkeypatch):
    from policy_workers import recording

    digests = []  # a spy around the real digest: counts the calls, changes nothing
    real_digest = recording.batch_digest
    monkeypatch.setattr(recording, "batch_digest", lambda d: digests.append(1) or real_digest(d))
    meta = _put(client, batch, ["input_ids", "input_lengths"])
    host = _Host()  # a lone worker in this process, on the real store
    host._dp_client = client
    host._fetch(meta)
    assert host.get_io_log() == []  # off: nothing kept ...
    assert digests == []  # ... and nothing computed on the data path

    host.set_io_recording(True, keep_last=2)
    for n in (1, 2, 3):
        host._fetch(meta.slice(0, n))
    log = host.get_io_log()
    assert [e["sample_ids"] for e in log] == [meta.sample_ids[:2], meta.sample_ids[:3]]
    fetched = host._fetch(meta.slice(0, 3))
    assert host.get_io_log()[-1]["digest"] == batch_digest(fetched)
    # nbytes: input_ids [3, 17] int64 padded to the longest of the three rows + lengths [3]
    assert host.get_io_log()[-1]["nbytes"] == 3 * max(LENGTHS[:3]) * 8 + 3 * 8

    host.set_io_recording(True, digests=False)
    n_digests = len(digests)
    host._fetch(meta)
    (entry,) = host.get_io_log()
    assert "digest" not in entry
    assert len(digests) == n_digests
    assert entry["fields"] == ["input_ids", "input_lengths"]
    host.set_io_recording(False)
    assert host.get_io_log() == []


def test_dispatch_recorder_keeps_the_last_dispatches():
    rec = DispatchRecorder(keep_last=2)
    for i in range(5):
        rec.dispatched([f"meta{i}"], [i])
    assert rec.shipped == [["meta3"], ["meta4"]]
    assert rec.received == [[3], [4]]
    rec.clear()
    assert rec.shipped == rec.received == []
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="keep_last"):
            DispatchRecorder(keep_last=bad)
        with pytest.raises(ValueError, match="keep_last"):
            IORecorder(keep_last=bad)
