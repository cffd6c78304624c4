"""The driver benchmark's GPU-speed regime (``benchmarks/driver_fast_compute.py``).

Without Ray: the stand-in's logprobs, its cost setting (bad values are refused by
name), the bytes each path moves, the data-movement split and the targets judged
from made-up rows. With the session's Ray: one tiny level at DP=2 through the
real policy and service, both paths computing the same logprobs through the same
worker code. Never asserts on speed.
"""

import math

import pytest
import torch

from benchmarks import driver_fast_compute as fast
from benchmarks.common import MiB, Options, Section


def _batch(ids, lengths):
    from dataplane_client.batching.batched_data_dict import BatchedDataDict

    return BatchedDataDict({"input_ids": torch.tensor(ids), "input_lengths": torch.tensor(lengths)})


def test_standin_logprobs_follow_every_token_and_stop_at_each_length():
    out = fast.standin_logprobs(_batch([[5, 7, 9], [3, 0, 0]], [3, 1]), 0.0)
    assert out.dtype == torch.float32
    assert out.shape == (2, 3)
    want = torch.tensor([[-0.005, -0.007, -0.009], [-0.003, 0.0, 0.0]])
    torch.testing.assert_close(out, want)
    # another token, another logprob: the stand-in reads its input
    assert fast.standin_logprobs(_batch([[5, 8, 9], [3, 0, 0]], [3, 1]), 0.0)[0, 1] != out[0, 1]


def test_standin_cost_is_paid_per_real_token():
    # 2 real tokens x 50 ms: a wait of about 0.1 s, padding not counted
    import time

    t0 = time.perf_counter()
    fast.standin_logprobs(_batch([[1, 2, 0, 0]], [2]), 50e6)
    assert time.perf_counter() - t0 >= 0.1


@pytest.mark.parametrize("text", ["fast", "-1", "nan"])
def test_a_bad_cost_per_token_is_refused_by_name(monkeypatch, text):
    monkeypatch.setenv(fast.NS_PER_TOKEN_ENV, text)
    with pytest.raises(ValueError, match=fast.NS_PER_TOKEN_ENV):
        fast.ns_per_token()


def test_cost_per_token_defaults_to_zero_and_reads_the_environment(monkeypatch):
    monkeypatch.delenv(fast.NS_PER_TOKEN_ENV, raising=False)
    assert fast.ns_per_token() == 0.0
    monkeypatch.setenv(fast.NS_PER_TOKEN_ENV, "2.5")
    assert fast.ns_per_token() == 2.5


def test_bytes_moved_by_each_path():
    data = {
        "input_ids": torch.zeros(4, 10, dtype=torch.int64),
        "advantages": torch.zeros(4, 10, dtype=torch.float32),
        "sample_mask": torch.zeros(4, dtype=torch.float32),
    }
    # out: 320 + 160 + 16 bytes; back: [4, 10] float32
    assert fast.padded_batch_bytes(data) == 320 + 160 + 16
    assert fast.classic_bytes_moved(data) == 320 + 160 + 16 + 160
    assert fast.dataplane_bytes_moved(25) == 25 * 12


def _row(dp, batch, max_len, classic_s, dataplane_s, compute_s, rss_dp):
    def driver(n):
        return {"sent": n, "received": 0, "put_bytes": n, "arg_bytes": 0, "get_bytes": 0}

    return {
        "dp": dp,
        "batch": batch,
        "max_len": max_len,
        "tokens": batch * max_len,
        "tensor_bytes_classic_batch": 90 * MiB,
        "tensor_bytes_moved_classic": 100 * MiB,
        "tensor_bytes_moved_dataplane": 10 * MiB,
        "driver_bytes_classic": driver(100 * MiB),
        "driver_bytes_dataplane": driver(4096),
        "seconds": {"classic": classic_s, "dataplane": dataplane_s},
        "peak_rss_delta_bytes": {"classic": [50 * MiB] * 3, "dataplane": [rss_dp] * 3},
        "worker_phases_s": {
            path: [{"fetch": 0.0, "compute": c, "write_back": 0.0} for c in compute_s]
            for path in ("classic", "dataplane")
        },
        "max_abs_diff_logprobs": 0.0,
    }


def test_data_movement_is_wall_minus_the_slowest_ranks_compute():
    row = _row(2, 8, 8, [1.0, 2.0, 3.0], [0.5, 0.6, 0.7], [0.2, 0.4, 0.1], 0)
    assert fast.data_movement_s(row, "classic") == pytest.approx(1.6)  # median of 0.8, 1.6, 2.9
    assert fast.data_movement_s(row, "dataplane") == pytest.approx(0.3)


def test_targets_are_judged_at_the_largest_level_for_every_dp():
    results = [
        _row(2, 16, 64, [1.0] * 3, [1.0] * 3, [0.0] * 3, 0),  # smaller level: not judged
        _row(2, 64, 64, [2.0] * 3, [0.2] * 3, [0.0] * 3, 1 * MiB),  # 10x, flat: met
        _row(4, 64, 64, [2.0] * 3, [1.0] * 3, [0.0] * 3, 200 * MiB),  # 2x, grew: missed
    ]
    section = Section("driver")
    fast._report(section, results, 3, 0.0, (2, 4))
    verdicts = {t.name: t.verdict for t in section.targets}
    assert len(verdicts) == 4
    assert all("64 x 64" in name for name in verdicts)
    assert [v for n, v in verdicts.items() if "DP=2" in n] == ["met", "met"]
    assert [v for n, v in verdicts.items() if "DP=4" in n] == ["MISSED", "MISSED"]
    (table,) = section.tables
    assert len(table.rows) == 3
    assert all(len(r) == len(table.headers) for r in table.rows)
    speedups = [r[table.headers.index("data-movement speed-up")] for r in table.rows]
    assert speedups == pytest.approx([1.0, 10.0, 2.0])
    assert section.data["fast_compute"]["results"] is results


def test_one_tiny_level_through_the_real_policy(ray_session):
    """DP=2 stand-in workers on the benchmark's own service: both paths the same logprobs,
    the dataplane pass fetched and wrote back in the workers, its driver moved keys only."""
    section = Section("driver")
    fast.run(Options(quick=True, repeats=1), section, dp_sizes=(2,), levels=[(8, 32)])
    (row,) = section.data["fast_compute"]["results"]
    assert row["max_abs_diff_logprobs"] == 0.0
    assert 32 * 8 // 2 <= row["tokens"] <= 32 * 8
    (phases_dp,) = row["worker_phases_s"]["dataplane"]
    assert phases_dp["fetch"] > 0
    assert phases_dp["write_back"] > 0
    (phases_cl,) = row["worker_phases_s"]["classic"]
    assert "fetch" not in phases_cl
    assert phases_cl["compute"] > 0
    dp_bytes, cl_bytes = row["driver_bytes_dataplane"], row["driver_bytes_classic"]
    # the classic driver ships the padded batch and takes [B, S] logprobs back
    assert cl_bytes["put_bytes"] >= row["tensor_bytes_classic_batch"]
    back = row["tensor_bytes_moved_classic"] - row["tensor_bytes_classic_batch"]
    assert cl_bytes["get_bytes"] >= back
    # the dataplane driver: the claim's keys and one None per rank, no tensor
    assert dp_bytes["get_bytes"] < back
    assert all(t.met is not None for t in section.targets)
    assert not math.isnan(fast.data_movement_s(row, "dataplane"))
