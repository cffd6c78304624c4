"""BatchedDataDict: every method, the reference's docstring examples, and all_gather over a real 2-process gloo group."""

import datetime
import doctest
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dataplane_client.batching import batched_data_dict as bdd_module
from dataplane_client.batching.batched_data_dict import BatchedDataDict, SlicedDataDict
from dataplane_client.wire.errors import InvalidBatch


def test_docstring_examples_hold():
    res = doctest.testmod(bdd_module)
    assert res.failed == 0
    # the reference's shard_by_batch_size examples are among them
    assert res.attempted >= 20


# ---- from_batches ---------------------------------------------------------------
def test_from_batches_stacks_lists_and_tensors():
    out = BatchedDataDict.from_batches(
        [
            {"ids": torch.tensor([[1, 2], [3, 4]]), "n": torch.tensor([2, 2]), "s": ["a", "b"]},
            {"ids": torch.tensor([[5, 6, 7]]), "n": torch.tensor([3]), "s": ["c"]},
        ],
        pad_value_dict={"ids": 9},
    )
    assert isinstance(out, BatchedDataDict)
    assert list(out) == ["ids", "n", "s"]  # sorted keys
    assert out["ids"].tolist() == [[1, 2, 9], [3, 4, 9], [5, 6, 7]]
    assert out["n"].tolist() == [2, 2, 3]
    assert out["s"] == ["a", "b", "c"]
    # default pad is 0; dtype kept
    x = BatchedDataDict.from_batches(
        [
            {"lp": torch.ones(1, 2, dtype=torch.bfloat16)},
            {"lp": torch.ones(1, 3, dtype=torch.bfloat16)},
        ]
    )
    assert x["lp"].dtype == torch.bfloat16
    assert x["lp"].tolist() == [[1, 1, 0], [1, 1, 1]]


def test_from_batches_pads_every_trailing_dim():
    a = torch.ones(1, 2, 3)
    b = torch.full((2, 3, 1), 2.0)
    out = BatchedDataDict.from_batches([{"h": a}, {"h": b}], pad_value_dict={"h": -1})
    assert out["h"].shape == (3, 3, 3)
    assert out["h"][0, :2, :3].eq(1).all()
    assert out["h"][0, 2].eq(-1).all()
    assert out["h"][1:, :3, :1].eq(2).all()
    assert out["h"][1:, :, 1:].eq(-1).all()


def test_from_batches_of_nothing_is_empty():
    for batches in ([], [{}], [{}, {"x": torch.zeros(0, 3)}]):
        out = BatchedDataDict.from_batches(batches)
        assert isinstance(out, BatchedDataDict)
        assert dict(out) == {}
        assert out.size == 0


def test_zero_row_batches_contribute_nothing_and_need_no_keys():
    out = BatchedDataDict.from_batches(
        [{}, {"x": [1], "t": torch.tensor([5])}, {"x": []}, {"x": [2], "t": torch.tensor([6])}]
    )
    assert out["x"] == [1, 2]
    assert out["t"].tolist() == [5, 6]
    with pytest.raises(KeyError, match="Key 't' is missing from non-empty batches") as ei:
        BatchedDataDict.from_batches([{"x": [1], "t": torch.tensor([5])}, {}, {"x": [2]}])
    assert ei.value.fields == ["t"]


def test_from_batches_sizes_from_the_first_tensor_never_asking_metadata_its_len():
    class Metadata:  # an opaque value NeMo-RL carries through from_batches untouched
        def __len__(self):
            raise AssertionError("from_batches must not size a batch from its metadata")

    batches = [
        {"tokens": torch.tensor([[1], [2]]), "metadata": Metadata()},
        {"tokens": torch.tensor([[3]]), "metadata": Metadata(), "extra": torch.tensor([1])},
    ]
    with pytest.raises(KeyError, match=r"Key 'extra' is missing from non-empty batches \[0\]"):
        BatchedDataDict.from_batches(batches)


def test_from_batches_missing_key_says_non_empty_batches_as_nemo_rl():
    # NeMo-RL's own test matches "non-empty batches"; its words, with the positions (in the
    # list given) of the batches that have rows but not the key. Its closing period is left
    # out: our errors go on with "; fields=[...]".
    batches = [{"x": [1], "t": [5]}, {}, {"x": [2]}, {"x": [3]}]
    with pytest.raises(KeyError, match="non-empty batches") as ei:
        BatchedDataDict.from_batches(batches)
    assert ei.value.message == "Key 't' is missing from non-empty batches [2, 3]"
    assert ei.value.fields == ["t"]


def test_from_batches_errors():
    with pytest.raises(KeyError, match="Key 'x' is missing from non-empty batches"):
        BatchedDataDict.from_batches([{"x": [1]}, {"y": [2]}])
    with pytest.raises(InvalidBatch, match="cannot stack values"):
        BatchedDataDict.from_batches([{"x": [1]}, {"x": torch.tensor([2])}])
    with pytest.raises(InvalidBatch, match="cannot stack values"):
        BatchedDataDict.from_batches([{"x": "abc"}])
    with pytest.raises(InvalidBatch, match="same dim"):
        BatchedDataDict.from_batches([{"x": torch.ones(2)}, {"x": torch.ones(1, 2)}])


# ---- chunk / reorder / select / slice --------------------------------------------
def test_chunk():
    b = BatchedDataDict({"x": list("AAABBBDDE"), "t": torch.arange(9)})
    c = b.chunk(rank=2, chunks=3)
    assert isinstance(c, SlicedDataDict)
    assert c["x"] == list("DDE")
    assert c["t"].tolist() == [6, 7, 8]
    c["t"][0] = 100  # a copy, not a view
    assert b["t"][6] == 6
    assert b.chunk(rank=3, chunks=9)["x"] == ["B"]  # the reference rejects this valid rank
    with pytest.raises(InvalidBatch, match="not a multiple of chunks"):
        b.chunk(0, 2)
    with pytest.raises(InvalidBatch, match="out of range"):
        b.chunk(3, 3)
    with pytest.raises(InvalidBatch, match="not the same"):
        BatchedDataDict({"a": [1, 2], "b": [1]}).chunk(0, 1)


def test_reorder_data_sorts_rows_by_keys():
    b = BatchedDataDict(
        {
            "t": torch.tensor([[3, 3], [1, 1], [2, 2]]),
            "s": ["c", "a", "b"],
            "m": torch.tensor([3, 1, 2]),
        }
    )
    b.reorder_data([2, 0, 1])
    assert b["t"].tolist() == [[1, 1], [2, 2], [3, 3]]
    assert b["s"] == ["a", "b", "c"]
    assert b["m"].tolist() == [1, 2, 3]
    b.reorder_data(torch.tensor([1, 0, 2]))
    assert b["s"] == ["b", "a", "c"]
    with pytest.raises(InvalidBatch, match="got 2 indices for a batch of 3"):
        b.reorder_data([0, 1])


def test_select_indices_slice_get_dict_size_to():
    b = BatchedDataDict({"t": torch.arange(10, 15), "s": list("abcde")})
    sel = b.select_indices(torch.tensor([4, 0]))
    assert type(sel) is BatchedDataDict
    assert sel["t"].tolist() == [14, 10]
    assert sel["s"] == ["e", "a"]
    assert type(SlicedDataDict(b.get_dict()).select_indices([1])) is SlicedDataDict
    with pytest.raises(InvalidBatch, match="out of range"):
        b.select_indices([5])
    s = b.slice(1, 4)
    assert isinstance(s, SlicedDataDict)
    assert s["s"] == ["b", "c", "d"]
    assert s.size == 3
    assert b.slice(2, 2).size == 0
    with pytest.raises(InvalidBatch, match="out of range"):
        b.slice(3, 6)
    assert b.get_dict() is b.data
    assert b.size == 5
    assert BatchedDataDict().size == 0
    assert BatchedDataDict({"s": [1, 2]}).size == 2
    assert b.to("cpu") is b
    assert b["t"].device.type == "cpu"
    with pytest.raises(InvalidBatch, match="tensors or lists"):
        BatchedDataDict({"x": (1, 2)}).select_indices([0])


def test_nested_jagged_columns_select_and_slice():
    nt = torch.nested.nested_tensor(
        [torch.arange(3), torch.arange(5) + 10, torch.arange(0) + 20, torch.arange(2) + 30],
        layout=torch.jagged,
    )
    b = BatchedDataDict({"ids": nt, "k": [0, 1, 2, 3]})
    assert b.size == 4
    sel = b.select_indices([3, 1, 2])
    assert [r.tolist() for r in sel["ids"].unbind()] == [[30, 31], list(range(10, 15)), []]
    assert [r.tolist() for r in b.slice(1, 2)["ids"].unbind()] == [list(range(10, 15))]
    assert b.slice(1, 1)["ids"].size(0) == 0
    b.reorder_data([3, 2, 1, 0])
    assert b["k"] == [3, 2, 1, 0]
    assert b["ids"].unbind()[0].tolist() == [30, 31]


def test_repeat_interleave_and_truncate():
    item = {"deep": [1]}
    b = BatchedDataDict({"key": torch.tensor([1, 2, 3]), "other_key": [item, 2, 3]})
    r = b.repeat_interleave(2)
    assert type(r) is BatchedDataDict
    assert r["key"].tolist() == [1, 1, 2, 2, 3, 3]
    assert r["other_key"][1:] == [item, 2, 2, 3, 3]
    assert r["other_key"][0] is not item
    assert r["other_key"][0] == item

    t = BatchedDataDict(
        {"ids": torch.ones(2, 6), "h": torch.ones(2, 6, 4), "n": torch.ones(2), "s": ["a", "b"]}
    )
    t.truncate_tensors(dim=1, truncated_len=4)
    assert t["ids"].shape == (2, 4)
    assert t["h"].shape == (2, 4, 4)
    assert t["n"].shape == (2,)
    assert t["s"] == ["a", "b"]
    t.truncate_tensors(dim=1, truncated_len=10)  # never grows
    assert t["ids"].shape == (2, 4)


def test_make_microbatch_iterator():
    b = BatchedDataDict({"t": torch.arange(6), "s": list("abcdef")})
    mbs = list(b.make_microbatch_iterator(2))
    assert [m["s"] for m in mbs] == [["a", "b"], ["c", "d"], ["e", "f"]]
    assert all(isinstance(m, SlicedDataDict) for m in mbs)
    with pytest.raises(InvalidBatch, match="not a multiple of the microbatch size"):
        list(b.make_microbatch_iterator(4))


# ---- shard_by_batch_size ------------------------------------------------------------
def _padded(lengths):
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = i + 1
    return BatchedDataDict(
        {"input_ids": ids, "input_lengths": torch.tensor(lengths), "row": list(range(len(lengths)))}
    )


DYN = {
    "max_tokens_per_microbatch": 16,
    "sequence_length_round": 1,
    "input_key": "input_ids",
    "input_lengths_key": "input_lengths",
}


def _pack(algorithm="first_fit_decreasing", cap=16, **kw):
    return {
        "max_tokens_per_microbatch": cap,
        "input_key": "input_ids",
        "input_lengths_key": "input_lengths",
        "algorithm": algorithm,
        **kw,
    }


def test_shard_plain_interleaves_chunks_and_copies():
    b = BatchedDataDict({"t": torch.arange(8), "s": list("AABBCCDD")})
    shards = b.shard_by_batch_size(2, batch_size=4)
    assert [s["s"] for s in shards] == [list("AACC"), list("BBDD")]
    assert shards[0]["t"].tolist() == [0, 1, 4, 5]
    shards[0]["t"][0] = 99
    assert b["t"][0] == 0
    assert all(isinstance(s, SlicedDataDict) and s.micro_batch_indices is None for s in shards)
    with pytest.raises(InvalidBatch, match="batch_size must be None"):
        b.shard_by_batch_size(2, batch_size=4, allow_uneven_shards=True)
    with pytest.raises(InvalidBatch, match="not a multiple of shards"):
        b.shard_by_batch_size(3)
    uneven = BatchedDataDict({"s": list("abcde")}).shard_by_batch_size(4, allow_uneven_shards=True)
    assert [s["s"] for s in uneven] == [["a", "b"], ["c", "d"], ["e"], []]


def test_shard_dynamic_batching():
    lengths = [6, 2, 8, 3, 5, 1, 7, 4]
    shards, unsorted = _padded(lengths).shard_by_batch_size(2, dynamic_batching_args=DYN)
    # sorted by length: 1 2 3 4 5 6 7 8 -> rows 5 1 3 7 4 0 6 2, dealt out strided
    assert shards[0]["row"] == [5, 3, 4, 6]
    assert shards[1]["row"] == [1, 7, 0, 2]
    assert unsorted == [5, 3, 4, 6, 1, 7, 0, 2]
    # longest per position over ranks: 2, 4, 6, 8 -> 2 rows x 4 = 8 <= 16, a third row
    # would be 3 x 6 = 18 > 16, so a new microbatch: 6 then 2 rows x 8 = 16
    assert shards[0].micro_batch_indices == [[[0, 2], [2, 4]]]
    assert shards[0].micro_batch_lengths == [[4, 8]]
    assert shards[1].micro_batch_indices == shards[0].micro_batch_indices
    assert shards[0].elem_counts_per_gb is None

    # the older keyword name works too
    again, _ = _padded(lengths).shard_by_batch_size(2, dynamic_batching_cfg=DYN)
    assert [s["row"] for s in again] == [s["row"] for s in shards]

    # microbatches iterate with truncated sequence dims
    mbs = list(shards[1].get_batch(0, batch_size=4).make_microbatch_iterator_with_dynamic_shapes())
    assert [m["row"] for m in mbs] == [[1, 7], [0, 2]]
    assert [m["input_ids"].shape[1] for m in mbs] == [4, 8]
    assert mbs[0]["input_ids"].tolist() == [[2, 2, 0, 0], [8, 8, 8, 8]]
    assert shards[1].get_batch(0, batch_size=4).get_microbatch_iterator_dynamic_shapes_len() == 2

    # gather-and-restore roundtrip
    gathered = BatchedDataDict.from_batches(shards)
    gathered.reorder_data(unsorted)
    assert gathered["row"] == list(range(8))
    assert torch.equal(gathered["input_ids"], _padded(lengths)["input_ids"])


def test_shard_dynamic_batching_rounds_and_caps():
    lengths = [3, 5, 9, 2]
    cfg = {**DYN, "sequence_length_round": 4, "max_tokens_per_microbatch": 20}
    shards, _ = _padded(lengths).shard_by_batch_size(1, dynamic_batching_args=cfg)
    # sorted lengths 2, 3, 5, 9 round to 4, 4, 8, 12; 12 is capped at the tensor width 9
    assert shards[0].micro_batch_indices == [[[0, 2], [2, 4]]]
    assert shards[0].micro_batch_lengths == [[4, 9]]
    with pytest.raises(InvalidBatch, match="exceeds max_tokens_per_microbatch=8"):
        _padded(lengths).shard_by_batch_size(
            1, dynamic_batching_args={**DYN, "max_tokens_per_microbatch": 8}
        )
    with pytest.raises(InvalidBatch, match="not supported"):
        _padded([1, 2, 3]).shard_by_batch_size(
            2, allow_uneven_shards=True, dynamic_batching_args=DYN
        )


def test_shard_sequence_packing_and_packable_iterator():
    lengths = [9, 3, 7, 2, 8, 5, 1, 6, 4, 4]
    b = _padded(lengths)
    shards, unsorted = b.shard_by_batch_size(
        2, batch_size=None, sequence_packing_args=_pack(cap=12)
    )
    assert sorted(unsorted) == list(range(10))
    assert [r for s in shards for r in s["row"]] == unsorted
    counts = [len(s.micro_batch_indices[0]) for s in shards]
    assert counts[0] == counts[1] >= 1
    for s in shards:
        assert s.elem_counts_per_gb == [s.size]
        one = s.get_batch(0)
        assert one.elem_counts_per_gb == [s.size]
        bins = list(one.make_microbatch_iterator_for_packable_sequences())
        assert len(bins) == len(s.micro_batch_indices[0])
        assert sum(m.size for m in bins) == s.size
        for m, total in zip(bins, s.micro_batch_lengths[0], strict=True):
            assert m["input_lengths"].sum().item() == total <= 12
            assert isinstance(m, SlicedDataDict)
        n, longest = one.get_microbatch_iterator_for_packable_sequences_len()
        assert n == len(bins)
        assert longest == max(s.micro_batch_lengths[0])
    gathered = BatchedDataDict.from_batches(shards)
    gathered.reorder_data(unsorted)
    assert torch.equal(gathered["input_ids"], b["input_ids"])


def test_shard_sequence_packing_chunks_and_get_batch():
    lengths = [5, 1, 4, 2, 3, 3, 6, 6, 1, 1, 2, 2]
    shards, unsorted = _padded(lengths).shard_by_batch_size(
        2, batch_size=6, sequence_packing_args=_pack(cap=8, sequence_length_pad_multiple=2)
    )
    for s in shards:
        assert len(s.elem_counts_per_gb) == 2
        assert sum(s.elem_counts_per_gb) == s.size
        for gb in range(2):
            part = s.get_batch(gb)
            # each global batch holds only rows of its own chunk (optimizer-step boundary)
            assert all(gb * 6 <= r < (gb + 1) * 6 for r in part["row"])
            assert part.micro_batch_indices == [s.micro_batch_indices[gb]]
            for (st, en), total in zip(
                part.micro_batch_indices[0], part.micro_batch_lengths[0], strict=True
            ):
                padded = [-(-x // 2) * 2 for x in part["input_lengths"][st:en].tolist()]
                assert sum(padded) == total <= 8
    with pytest.raises(InvalidBatch, match="out of range"):
        shards[0].get_batch(2)
    # more bins than samples: the extra rank gets an empty microbatch
    shards, _ = _padded([3]).shard_by_batch_size(2, sequence_packing_args=_pack(cap=8))
    assert [s.size for s in shards] == [1, 0]
    assert shards[1].micro_batch_indices == [[[0, 0]]]
    assert shards[1].micro_batch_lengths == [[0]]


def test_packed_microbatch_order_is_the_packers_or_largest_first():
    # concatenative packs [2, 2, 8, 8] into bins of 4, 8 and 8 tokens, in that order
    b = _padded([2, 2, 8, 8])
    args = _pack("concatenative", cap=10)
    (packer,), _ = b.shard_by_batch_size(1, sequence_packing_args=args)
    assert packer.micro_batch_lengths == [[4, 8, 8]]
    assert packer["row"] == [0, 1, 2, 3]
    same, _ = b.shard_by_batch_size(1, sequence_packing_args={**args, "microbatch_order": "packer"})
    assert same[0].micro_batch_lengths == [[4, 8, 8]]
    (largest,), unsorted = b.shard_by_batch_size(
        1, sequence_packing_args={**args, "microbatch_order": "largest_first"}
    )
    assert largest.micro_batch_lengths == [[8, 8, 4]]
    assert largest["row"] == [2, 3, 0, 1]
    assert largest.micro_batch_indices == [[[0, 1], [1, 2], [2, 4]]]
    largest.reorder_data(unsorted)
    assert largest["row"] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="microbatch_order"):
        b.shard_by_batch_size(1, sequence_packing_args={**args, "microbatch_order": "smallest"})


def test_shard_argument_errors():
    b = _padded([1, 2])
    with pytest.raises(InvalidBatch, match="mutually exclusive"):
        b.shard_by_batch_size(2, dynamic_batching_args=DYN, sequence_packing_args=_pack())
    with pytest.raises(InvalidBatch, match="not both"):
        b.shard_by_batch_size(2, dynamic_batching_args=DYN, dynamic_batching_cfg=DYN)
    with pytest.raises(InvalidBatch, match="'nope', which is not in the batch"):
        b.shard_by_batch_size(2, dynamic_batching_args={**DYN, "input_lengths_key": "nope"})
    with pytest.raises(InvalidBatch, match="missing required key 'input_key'"):
        b.shard_by_batch_size(2, sequence_packing_args={"max_tokens_per_microbatch": 4})
    with pytest.raises(InvalidBatch, match="unknown sequence packing algorithm"):
        b.shard_by_batch_size(2, sequence_packing_args=_pack("bogus"))
    with pytest.raises(InvalidBatch, match="not the same"):
        BatchedDataDict({"a": [1, 2], "b": torch.ones(3)}).shard_by_batch_size(1)


def test_get_batch_plain_and_dynamic():
    b = BatchedDataDict({"s": list("abcdef")})
    assert b.get_batch(1, batch_size=2)["s"] == ["c", "d"]
    with pytest.raises(InvalidBatch, match="needs batch_size"):
        b.get_batch(0)
    b.micro_batch_indices = [[[0, 2]], [[0, 1], [1, 2]], [[0, 2]]]
    b.micro_batch_lengths = [[4], [3, 5], [2]]
    part = b.get_batch(1, batch_size=2)
    assert part.micro_batch_indices == [[[0, 1], [1, 2]]]
    assert part.micro_batch_lengths == [[3, 5]]
    with pytest.raises(InvalidBatch, match="exactly one global batch"):
        list(b.make_microbatch_iterator_with_dynamic_shapes())
    with pytest.raises(InvalidBatch, match="exactly one global batch"):
        list(BatchedDataDict({"s": [1]}).make_microbatch_iterator_for_packable_sequences())


# ---- all_gather over a real gloo group ------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gather_worker(index: int, first_rank: int, world: int, port: int, out_dir: str) -> None:
    """One rank of the gloo group: gather a batch, then a mismatched one; save what it saw."""
    rank = first_rank + index
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        n, width = (2, 3) if rank == 0 else (3, 5)
        local = BatchedDataDict(
            {
                "input_ids": torch.full((n, width), rank + 1, dtype=torch.long),
                "logprobs": torch.full((n, width), 0.5 * (rank + 1), dtype=torch.bfloat16),
                "mask": torch.ones(n, width, dtype=torch.bool),
                "hidden": torch.full((n, width, 2 + rank), float(rank)),
                "lengths": torch.arange(n) + 10 * rank,
                "text": [f"r{rank}-{i}" for i in range(n)],
            }
        )
        gathered = local.all_gather(dist.group.WORLD)
        result = {"gathered": dict(gathered.data), "type": type(gathered).__name__}
        bad = BatchedDataDict({"x": [1]} if rank == 0 else {"y": [1]})
        try:
            bad.all_gather(dist.group.WORLD)
            result["mismatch"] = None
        except InvalidBatch as e:
            result["mismatch"] = str(e)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_all_gather_two_process_gloo(tmp_path):
    port = _free_port()
    if dist.is_initialized():  # someone else's group lives here: run both ranks as children
        mp.spawn(_gather_worker, args=(0, 2, port, str(tmp_path)), nprocs=2, join=True)
    else:
        # rank 1 in a spawned process, rank 0 right here (one interpreter start, not two)
        ctx = mp.start_processes(
            _gather_worker,
            args=(1, 2, port, str(tmp_path)),
            nprocs=1,
            join=False,
            start_method="spawn",
        )
        try:
            _gather_worker(0, 0, 2, port, str(tmp_path))
        finally:
            if not ctx.join(timeout=120):
                for proc in ctx.processes:
                    proc.kill()  # only the child this test started
                pytest.fail("the rank-1 child did not finish within 120 s")
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for res in results:
        g = res["gathered"]
        assert res["type"] == "BatchedDataDict"
        # leading dims 2 + 3, trailing padded to the widest (5)
        assert g["input_ids"].shape == (5, 5)
        assert g["input_ids"][:2].tolist() == [[1, 1, 1, 0, 0]] * 2
        assert g["input_ids"][2:].eq(2).all()
        assert g["logprobs"].dtype == torch.bfloat16
        assert g["logprobs"][2:].eq(1.0).all()
        assert g["logprobs"][:2, 3:].eq(0).all()
        assert g["mask"].dtype == torch.bool
        assert g["mask"][:2, :3].all()
        assert not g["mask"][:2, 3:].any()
        assert g["hidden"].shape == (5, 5, 3)
        assert g["hidden"][:2, :, 2].eq(0).all()
        assert g["lengths"].tolist() == [0, 1, 10, 11, 12]
        assert g["text"] == ["r0-0", "r0-1", "r1-0", "r1-1", "r1-2"]
        assert res["mismatch"] is not None
        assert "keys" in res["mismatch"]
    assert results[0]["gathered"]["text"] == results[1]["gathered"]["text"]
