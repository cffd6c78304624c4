"""Rows assembled from many sources come back bit for bit (no Ray).

``assembly.assemble`` builds one field from the parts of many sources (the
in-process client keeps one source per row). It once packed the source index into
the high bits of an int64 (``which << 48``), which wraps past 2**15 sources: a
40,000-row read held other samples' bytes in 7,232 of its rows.
"""

import numpy as np
import pytest
import torch

from dataplane_client.codec.assembly import assemble
from dataplane_client.codec.fields import encode_field
from dataplane_client.wire.encoded import DENSE, EncodedField
from dataplane_server.core.inprocess import InProcessDataPlaneClient

N = 40_000  # more than 2**15 sources


def _lengths(n: int) -> torch.Tensor:
    return torch.arange(n) % 5 + 1


def _expected(n: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Row i's dense value and jagged row, each unique to i."""
    dense = torch.arange(n, dtype=torch.int64) * 1_000_003 + 17
    lengths = _lengths(n)
    ends = torch.cumsum(lengths, 0)
    flat = torch.arange(int(ends[-1]), dtype=torch.int32) * 3 + 1
    jagged = list(torch.split(flat, lengths.tolist()))
    return dense, jagged


@pytest.fixture(scope="module")
def store():
    dp = InProcessDataPlaneClient()
    dp.register_partition("rows", fields=["x", "j"])
    dense, jagged = _expected(N)
    ids = [f"s{i}" for i in range(N)]
    fields = {"x": dense, "j": torch.nested.nested_tensor(jagged, layout=torch.jagged)}
    dp.put_samples(ids, "rows", fields)
    yield dp, ids, dense, jagged
    dp.close()


def _wrong_rows(td, rows: np.ndarray, dense, jagged) -> int:
    """How many of the read rows differ from what row ``rows[k]`` was written as."""
    got_x = td["x"]
    assert got_x.shape == (len(rows),)
    wrong = got_x.numpy() != dense.numpy()[rows]
    got_j = td["j"]
    offsets = got_j.offsets().numpy()
    values = got_j.values().numpy()
    for k, r in enumerate(rows.tolist()):
        row = values[offsets[k] : offsets[k + 1]]
        if not np.array_equal(row, jagged[r].numpy()):
            wrong[k] = True
    return int(wrong.sum())


def test_inprocess_get_in_order_every_row(store):
    dp, ids, dense, jagged = store
    td = dp.get_samples(ids, "rows", ["x", "j"])
    assert _wrong_rows(td, np.arange(N), dense, jagged) == 0


def test_inprocess_get_shuffled_every_row(store):
    dp, ids, dense, jagged = store
    rows = np.random.default_rng(7).permutation(N)
    td = dp.get_samples([ids[r] for r in rows], "rows", ["x", "j"])
    assert _wrong_rows(td, rows, dense, jagged) == 0


def _two_row_parts(values: np.ndarray) -> list[EncodedField]:
    """Two rows per part (part k holds values[2k], values[2k + 1]), each part its own
    source whose bytes start at 0, as the in-process client's parts do."""
    enc = encode_field("v", torch.from_numpy(values))
    size = 2 * values.itemsize
    return [
        EncodedField(
            kind=DENSE,
            dtype=enc.dtype,
            shape=enc.shape,
            values=enc.values[k * size : (k + 1) * size].copy(),
            num_rows=2,
        )
        for k in range(len(values) // 2)
    ]


@pytest.mark.parametrize("order", ["identity", "reversed", "shuffled", "abutting"])
def test_assemble_more_than_2_15_sources(order):
    parts_n = 2**15 + 1000
    n = 2 * parts_n
    values = np.arange(n, dtype=np.int64) * 13 + 5
    parts = _two_row_parts(values)
    k = np.arange(parts_n)
    rows = {
        "identity": np.arange(n),
        "reversed": np.arange(n)[::-1].copy(),
        "shuffled": np.random.default_rng(3).permutation(n),
        # row 0 of part k, then row 1 of part k + 1: bytes [0, 8) of one source, then
        # [8, 16) of the next, which abut in offsets but are not one run
        "abutting": 2 * k + k % 2,
    }[order]
    out = assemble(parts, rows)
    assert np.array_equal(out.numpy(), values[rows])
