"""AttnRes merge + RMSNorm (kernels/attnres/merge_norm_triton.py): without h (`store_h=False`) the normed row
is the one the default launch writes, in the interpreter (and against the reference) and on the GPU; with
the newest completed block folded in by the merge (`newest=`: the statistics cover only the older blocks,
or none) the result is eq.9 over every source, against a float64 direct attention. The merge's math without
`newest` is tested in test_moe_attnres.py.
"""

from __future__ import annotations

import pytest
import torch

from k3core.ops.attnres import attnres_direct, attnres_inter
from k3core.ops.norm import rms_norm
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


def _sources(rows: int, dim: int, older: int, device: str = "cpu", seed: int = 0) -> tuple:
    """Older blocks [older, rows, dim], the newest block, a partial sum (the sources' dtype float32), a site's
    query and key-norm weight, an output norm weight."""
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks = torch.randn(older + 2, rows, dim, device=device, generator=gen) * (1 + torch.arange(older + 2.0,
                                                                                                device=device))[:, None, None]
    query = torch.randn(dim, device=device, generator=gen) * dim**-0.25  # logits of a few units: soft weights
    key_w, out_w = (torch.rand(2, dim, device=device, generator=gen) + 0.5).unbind(0)
    return blocks[:older], blocks[older], blocks[older + 1], query, key_w, out_w


def _merge_with_newest(merge, older, newest, partial, query, key_w, out_w, dtype, **kw):
    stats = (None, None, None)
    if len(older):
        inter = attnres_inter(query[None].to(dtype), older.to(dtype), key_w[None].to(dtype)).row(0)  # as rounded
        stats = (inter.max, inter.denom, inter.acc.contiguous())
    return merge(*stats, query.to(dtype), None if partial is None else partial.to(dtype), out_w.to(dtype),
                 key_w.to(dtype), out_dtype=dtype, newest=newest.to(dtype), **kw)


@pytest.mark.parametrize("older", [0, 1, 3])
@pytest.mark.parametrize("with_partial", [True, False])
def test_newest_block_folded_in_equals_direct_attention(interpreted, older, with_partial):
    """fp16 sources (the interpreter's bf16 is not at issue here: no dot); float64 oracle: eq.9 over the older
    blocks, the newest and the partial sum, then the RMSNorm."""
    blocks, newest, partial, query, key_w, out_w = _sources(5, 48, older, seed=older)
    partial = partial if with_partial else None
    sources = torch.cat([blocks, newest[None]] + ([partial[None]] if with_partial else []))
    direct = attnres_direct(query.half().double(), sources.half().double(), key_w.half().double())
    want = rms_norm(direct, out_w.half().double(), 1e-6)
    for merge in (merge_norm_triton.attnres_merge_norm, attnres_naive.attnres_merge_norm):
        h, normed = _merge_with_newest(merge, blocks, newest, partial, query, key_w, out_w, torch.float16)
        assert h.dtype == normed.dtype == torch.float16
        torch.testing.assert_close(h.double(), direct, rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(normed.double(), want, rtol=4e-3, atol=4e-3)
    ours = _merge_with_newest(merge_norm_triton.attnres_merge_norm, blocks, newest, partial, query, key_w, out_w,
                              torch.float32, num_warps=2)
    ref = _merge_with_newest(attnres_naive.attnres_merge_norm, blocks, newest, partial, query, key_w, out_w,
                             torch.float32)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_newest_block_needs_all_statistics_or_none(interpreted):
    blocks, newest, _, query, key_w, out_w = _sources(3, 16, 1)
    stats = attnres_inter(query[None], blocks, key_w[None]).row(0)
    with pytest.raises(ValueError, match="all or none"):
        merge_norm_triton.attnres_merge_norm(stats.max, None, None, query, None, out_w, key_w, newest=newest)
    with pytest.raises(ValueError, match="stat_acc or newest"):
        merge_norm_triton.attnres_merge_norm(None, None, None, query, None, out_w, key_w)


@pytest.mark.gpu
@pytest.mark.parametrize(("rows", "dim"), [(64, 7168), (64, 2048), (3, 2048)])
def test_newest_block_folded_in_on_gpu(rows, dim):
    """bf16 as served, against the float64 direct attention over all sources."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    for older in (0, 2):
        blocks, newest, partial, query, key_w, out_w = _sources(rows, dim, older, "cuda", seed=older)
        sources = torch.cat([blocks, newest[None], partial[None]]).to(torch.bfloat16)
        direct = attnres_direct(query.to(torch.bfloat16).double(), sources.double(),
                                key_w.to(torch.bfloat16).double())
        for store_h in (True, False):
            h, normed = _merge_with_newest(merge_norm_triton.attnres_merge_norm, blocks, newest, partial, query,
                                           key_w, out_w, torch.bfloat16, store_h=store_h)
            want = rms_norm(direct, out_w.to(torch.bfloat16).double(), 1e-6)
            torch.testing.assert_close(normed.double(), want, rtol=2e-2, atol=2e-2)
            if store_h:
                torch.testing.assert_close(h.double(), direct, rtol=2e-2, atol=2e-2)
