"""The greedy draw's Triton argmax (kernels/fused/greedy_argmax_triton.py) against `torch.argmax` as the
oracle, run through Triton's interpreter on the CPU (compiled on a GPU, where the tensors live there): the
lowest index among equal maxima (rows of a few distinct
values, so ties cross chunk and lane boundaries), NaN beating every number (its first index), rows of -inf,
+inf, and vocabularies that end inside a chunk and inside a load."""

from __future__ import annotations

import pytest
import torch

from kernels import dispatch
from kernels.fused import greedy_argmax_triton as ga

pytestmark = pytest.mark.skipif(ga.triton is None, reason="no triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _check(logits: torch.Tensor) -> None:
    logits = logits.to(DEVICE)
    got = ga.argmax_triton(logits)
    assert got.dtype == torch.int64
    assert torch.equal(got, logits.argmax(-1))


@pytest.mark.parametrize("cols", [5, ga.BLOCK + 3, ga.CHUNK, 2 * ga.CHUNK + 37])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ties_take_the_lowest_index(cols, dtype):
    g = torch.Generator().manual_seed(cols)
    # 3 levels: every row has its maximum many times over, in several chunks and lanes
    logits = torch.randint(0, 3, (6, cols), generator=g).to(dtype)
    logits[1] = 0  # a constant row: index 0
    logits[2, -1] = 7  # the maximum in the last column only
    _check(logits)


def test_nan_inf_and_minus_inf_rows():
    cols = ga.CHUNK + 300
    logits = torch.randn(6, cols, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    logits[0, [40, ga.CHUNK + 5]] = float("nan")  # the first NaN wins, even over a later chunk's
    logits[1, ga.CHUNK + 7] = float("nan")  # a NaN only in the second chunk beats the first chunk's maximum
    logits[1, 3] = float("inf")
    logits[2] = float("-inf")  # every column -inf: index 0
    logits[3, [17, ga.CHUNK + 1]] = float("inf")  # the first +inf
    logits[4, :] = float("-inf")
    logits[4, ga.CHUNK + 299] = -1.0  # the one finite column is the last
    _check(logits)


def test_row_strided_rows_of_a_larger_buffer():
    buffer = torch.randn(8, 3 * ga.BLOCK, generator=torch.Generator().manual_seed(2)).to(torch.float16)
    _check(buffer[1:6, : 2 * ga.BLOCK + 1])  # row stride larger than the row


def test_the_cpu_path_is_torch_argmax(monkeypatch):
    called = []
    monkeypatch.setattr(ga, "argmax_triton", lambda x, out=None: called.append(x) or x.argmax(-1))
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    assert torch.equal(dispatch.greedy_argmax(logits), logits.argmax(-1)) and not called
    assert torch.equal(ga.greedy_argmax(logits), logits.argmax(-1)) and len(called) == 1  # the launcher's own path
    monkeypatch.setenv(ga.ENV, "torch")  # and the switch that keeps torch's on CUDA
    assert torch.equal(dispatch.greedy_argmax(logits.to(DEVICE)), logits.to(DEVICE).argmax(-1)) and len(called) == 1
    assert torch.equal(ga.greedy_argmax(logits), logits.argmax(-1)) and len(called) == 1


def test_out_takes_the_rows_of_a_larger_buffer_and_leaves_the_rest():
    # The decode graph's in-graph draw writes its argmax into the first rows of the fast path's `drawn` buffer.
    logits = torch.randn(5, ga.CHUNK + 11, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).to(DEVICE)
    drawn = torch.full((8,), -5, dtype=torch.int64, device=DEVICE)
    assert ga.argmax_triton(logits, out=drawn[:5]).data_ptr() == drawn.data_ptr()
    assert torch.equal(drawn[:5], logits.argmax(-1)) and (drawn[5:] == -5).all()
    reference = torch.full((8,), -5, dtype=torch.int64)
    dispatch.greedy_argmax(logits.cpu(), out=reference[:5])  # the CPU path (naive.py) into the same kind of view
    assert torch.equal(reference, drawn.cpu())
    with pytest.raises(ValueError, match="out"):
        ga.argmax_triton(logits, out=drawn[:4])
