"""AttnRes merge + RMSNorm without h (kernels/attnres/merge_norm_triton.py, `store_h=False`): the normed row
is the one the default launch writes, in the interpreter (and against the reference) and on the GPU. The
merge's math itself is tested in test_moe_attnres.py.
"""

from __future__ import annotations

import pytest
import torch

from kernels.attnres import merge_norm_triton
from kernels.attnres import naive as attnres_naive
from kernels.perf.attnres_decode_cases import merge_inputs


@pytest.mark.parametrize("with_partial", [True, False])
def test_without_h_the_normed_row_is_unchanged(interpreted, with_partial):
    stats, partial, out_w, key_w = merge_inputs(5, 48, "cpu")
    args = (*stats, partial if with_partial else None, out_w, key_w)
    h, normed = merge_norm_triton.attnres_merge_norm(*args, out_dtype=torch.bfloat16)
    none, alone = merge_norm_triton.attnres_merge_norm(*args, out_dtype=torch.bfloat16, store_h=False)
    assert none is None and torch.equal(alone, normed)
    ref_none, ref = attnres_naive.attnres_merge_norm(*args, out_dtype=torch.bfloat16, store_h=False)
    assert ref_none is None and ref.dtype == alone.dtype
    torch.testing.assert_close(alone, ref)  # one bf16 rounding step apart at most


@pytest.mark.gpu
@pytest.mark.parametrize(("rows", "dim"), [(64, 7168), (3, 2048)])
def test_without_h_the_normed_row_is_unchanged_on_gpu(rows, dim):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    stats, partial, out_w, key_w = merge_inputs(rows, dim, "cuda")
    for with_partial in (partial, None):
        want = merge_norm_triton.attnres_merge_norm(*stats, with_partial, out_w, key_w, out_dtype=torch.bfloat16)[1]
        none, got = merge_norm_triton.attnres_merge_norm(*stats, with_partial, out_w, key_w, out_dtype=torch.bfloat16,
                                                         store_h=False)
        assert none is None and torch.equal(got, want)
