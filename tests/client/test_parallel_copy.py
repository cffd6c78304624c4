"""Large copies split over threads land every byte where a one-thread copy would."""

import threading

import numpy as np
import pytest

from dataplane_client.wire import parallel_copy
from dataplane_client.wire.encoded import EncodedField, gather_bytes, row_copy_pairs, take_rows


@pytest.fixture
def two_threads(monkeypatch):
    monkeypatch.setenv("DATAPLANE_COPY_THREADS", "3")
    monkeypatch.setattr(parallel_copy, "MIN_PARALLEL_BYTES", 1)  # small data, parallel path


def _pairs(rng, sizes):
    out = np.zeros(sum(sizes), dtype=np.uint8)
    pairs, pos = [], 0
    for n in sizes:
        pairs.append((out[pos : pos + n], rng.integers(0, 256, n, dtype=np.uint8)))
        pos += n
    return out, pairs


def test_every_piece_lands_in_place_whatever_the_split(two_threads):
    rng = np.random.default_rng(0)
    for sizes in ([1], [7, 0, 5], [1000], [3, 997, 1, 1, 50_000], list(range(1, 300))):
        out, pairs = _pairs(rng, sizes)
        parallel_copy.copy_pairs(pairs)
        assert np.array_equal(out, np.concatenate([s for _, s in pairs]))


def test_the_copy_really_runs_on_several_threads(two_threads, monkeypatch):
    seen = []
    real = parallel_copy._copy_group

    def recording(group):
        seen.append((threading.get_ident(), sum(len(d) for d, _ in group)))
        real(group)

    monkeypatch.setattr(parallel_copy, "_copy_group", recording)
    out, pairs = _pairs(np.random.default_rng(1), [90_000])
    parallel_copy.copy_pairs(pairs)
    assert sorted(n for _, n in seen) == [30_000] * 3, "three even thirds"
    caller = threading.get_ident()
    assert caller in [t for t, _ in seen], "the caller copies a third itself"
    assert any(t != caller for t, _ in seen), "the pool copies the rest"
    assert np.array_equal(out, pairs[0][1])


def test_an_error_in_a_piece_reaches_the_caller(two_threads):
    read_only = np.zeros(10, dtype=np.uint8)
    read_only.flags.writeable = False
    src = np.ones(10, dtype=np.uint8)
    with pytest.raises(ValueError, match="read-only"):
        parallel_copy.copy_pairs([(np.zeros(10, dtype=np.uint8), src), (read_only, src)])


def test_one_thread_when_asked(monkeypatch):
    monkeypatch.setenv("DATAPLANE_COPY_THREADS", "1")
    assert parallel_copy.threads() == 1
    monkeypatch.setenv("DATAPLANE_COPY_THREADS", "two")
    with pytest.raises(ValueError, match="DATAPLANE_COPY_THREADS"):
        parallel_copy.threads()
    monkeypatch.delenv("DATAPLANE_COPY_THREADS")
    assert 1 <= parallel_copy.threads() <= 4


def test_gathered_rows_match_a_plain_gather(two_threads):
    """Shuffled rows of a jagged field, gathered through the threaded path."""
    rng = np.random.default_rng(2)
    lengths = rng.integers(0, 50, 200)
    values = rng.integers(0, 256, int(lengths.sum()) * 4, dtype=np.uint8)
    enc = EncodedField("jagged", "int32", (), values, lengths, len(lengths))
    rows = rng.permutation(200)[:150]
    expected = take_rows(
        enc, rows, out=np.empty(take_rows(enc, rows, header_only=True).nbytes, np.uint8)
    )
    out = np.zeros_like(expected.values)
    parallel_copy.copy_pairs(row_copy_pairs(enc, rows, out))
    assert np.array_equal(out, expected.values)
    offs = np.concatenate(([0], np.cumsum(lengths * 4)))
    manual = np.concatenate([values[offs[r] : offs[r + 1]] for r in rows])
    assert np.array_equal(out, manual)
    assert np.array_equal(
        gather_bytes([values], np.zeros(len(rows), np.int64), offs[rows], offs[rows + 1]), manual
    )


@pytest.mark.ray
def test_a_large_put_copied_on_threads_reads_back_bit_for_bit(service_factory, monkeypatch):
    """A same-node put over the threaded copy (dense and jagged fields, 24 MiB): the
    rows read back are the rows written, and the copy really was split."""
    import torch

    client = service_factory("pcopy", num_storage_units=1).client()
    monkeypatch.setenv("DATAPLANE_COPY_THREADS", "3")
    groups = []
    real = parallel_copy._copy_group

    def recording(group):
        groups.append(sum(len(d) for d, _ in group))
        real(group)

    monkeypatch.setattr(parallel_copy, "_copy_group", recording)
    gen = torch.Generator().manual_seed(3)
    n = 48
    dense = torch.randn(n, 64 * 1024, generator=gen)  # 12 MiB
    jagged = torch.nested.nested_tensor(
        [torch.randint(0, 1 << 30, (int(k) * 1024,), generator=gen) for k in range(1, n + 1)],
        layout=torch.jagged,
    )  # ~9.4 MiB of int64
    ids = [f"big{i}" for i in range(n)]
    client.register_partition("parallel-copy", fields=["dense", "jagged"])
    client.put_samples(ids, "parallel-copy", {"dense": dense, "jagged": jagged})
    assert len(groups) == 3, "the put's one copy ran split in thirds"
    assert sum(groups) == dense.nbytes + jagged.values().nbytes
    order = list(reversed(ids))
    got = client.get_samples(order, "parallel-copy", ["dense", "jagged"])
    assert torch.equal(got["dense"], dense.flip(0))
    for i, row in enumerate(got["jagged"].unbind()):
        assert torch.equal(row, jagged[n - 1 - i])
    client.clear_samples(None, "parallel-copy")
