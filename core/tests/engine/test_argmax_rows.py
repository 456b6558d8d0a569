"""The runner's greedy argmax (``_argmax_rows``) is ``torch.argmax``: the same ids on ties, NaN and ragged widths."""

import pytest
import torch

from vllm_port.engine.runner import _ARGMAX_CHUNK, _argmax_rows


@pytest.mark.parametrize("cols", [1, 255, 256, 300, 32000, 32001, 151936], ids=lambda c: f"{c} columns")
def test_random_rows_give_torch_argmax(cols):
    x = torch.randn(9, cols, generator=torch.Generator().manual_seed(cols))
    assert torch.equal(_argmax_rows(x), x.argmax(dim=-1))


@pytest.mark.parametrize("cols", [32000, 32001, 1000])
def test_ties_nan_and_infinities_give_torch_argmax(cols):
    x = torch.randn(10, cols, generator=torch.Generator().manual_seed(0))
    x[0, [5, 3 * _ARGMAX_CHUNK + 7, cols - 1]] = 50.0  # a tie across chunks and the tail: the first
    x[1, [cols - 1, cols - 2]] = 50.0  # the maximum in the tail only (ragged widths)
    x[2, 700 % cols] = float("nan")  # NaN wins, the first one
    x[2, cols - 1] = float("nan")
    x[3, cols - 1] = float("nan")  # a NaN only in the tail
    x[4] = float("-inf")  # every logit -inf: 0
    x[5, 10] = float("inf")
    x[5, cols - 1] = float("inf")
    x[6, 2 * _ARGMAX_CHUNK - 1] = 50.0  # a chunk's last column
    x[7, 2 * _ARGMAX_CHUNK] = 50.0  # the next chunk's first
    x[8] = 1.0  # all equal: 0
    assert torch.equal(_argmax_rows(x), x.argmax(dim=-1))


def test_bfloat16_rows_and_a_view_give_torch_argmax():
    x = torch.randn(6, 64, 1000, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)[:, 3]
    assert not x.is_contiguous()
    assert torch.equal(_argmax_rows(x), x.argmax(dim=-1))
