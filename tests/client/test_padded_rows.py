"""Jagged rows to a padded rectangle and back (``padded_rows``), against a row-by-row
reference, in every dtype the codec stores (numpy's path and the integer-bits path for
dtypes numpy lacks) and with the shapes a batch can have."""

import pytest
import torch

from dataplane_client.batching.padded_rows import cut_rows, pad_rows

DTYPES = [
    torch.int64,
    torch.int32,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.bool,
    torch.uint8,
    torch.complex64,
]


def _reference_pad(values, lengths, width, pad_value):
    out = torch.full((len(lengths), width, *values.shape[1:]), pad_value, dtype=values.dtype)
    start = 0
    for i, n in enumerate(lengths.tolist()):
        out[i, :n] = values[start : start + n]
        start += n
    return out


def _values(n: int, dtype: torch.dtype, trailing: tuple[int, ...] = ()) -> torch.Tensor:
    raw = torch.arange(n * max(1, torch.Size(trailing).numel())).reshape(n, *trailing)
    return (raw % 2).to(dtype) if dtype == torch.bool else (raw % 97).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("trailing", [(), (3,)], ids=["rows", "rows of vectors"])
def test_padding_and_cutting_back_match_a_row_by_row_copy(dtype, trailing):
    lengths = torch.tensor([5, 0, 7, 1, 7])
    values = _values(int(lengths.sum()), dtype, trailing)
    pad_value = 1 if dtype != torch.bool else True
    padded = pad_rows(values, lengths, 9, pad_value)
    assert padded.dtype == dtype
    assert torch.equal(padded, _reference_pad(values, lengths, 9, pad_value))
    assert torch.equal(cut_rows(padded, lengths), values)


def test_an_empty_batch_and_rows_past_the_width():
    empty = pad_rows(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.long), 4, -1)
    assert empty.shape == (0, 4)
    padded = torch.arange(12).reshape(3, 4)
    # Lengths past the width are cut at it; a negative length keeps nothing.
    cut = cut_rows(padded, torch.tensor([6, 2, -1]))
    assert torch.equal(cut, torch.tensor([0, 1, 2, 3, 4, 5]))


def test_a_non_contiguous_rectangle_is_cut_by_its_values():
    padded = torch.arange(24).reshape(4, 6).t()  # [6, 4], a transposed view
    assert not padded.is_contiguous()
    cut = cut_rows(padded, torch.tensor([2, 0, 4, 1, 0, 3]))
    expect = torch.cat([padded[0, :2], padded[2, :4], padded[3, :1], padded[5, :3]])
    assert torch.equal(cut, expect)
