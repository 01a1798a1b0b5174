"""Block AttnRes phase 1 (kernels/attnres/inter_triton.py) in the Triton interpreter against float64 math.

Both forms of the launcher (one fused kernel per row tile; scores kernel over D chunks + apply kernel) and
the block-diagonal multi-row tiles are held to a float64 evaluation of eq.9's batched statistics, over
block counts that are not powers of two, a single block, row counts that leave partial tiles, bf16 and
float32 blocks, with and without key-norm weights.
"""

from __future__ import annotations

import pytest
import torch

from k3core.ops.attnres import attnres_direct
from kernels.attnres import inter_triton


def _float64_logits(queries: torch.Tensor, blocks: torch.Tensor, norm_w: torch.Tensor | None, eps: float = 1e-6):
    """q_eff . RMSNorm(b) in float64: blocks [..., D] -> [Q, ...] (blocks [N, R, D] -> [Q, N, R])."""
    b = blocks.double()
    q = queries.double() * (norm_w.double() if norm_w is not None else 1.0)
    keys = b / b.square().mean(-1, keepdim=True).add(eps).sqrt()
    return torch.einsum("...d,qd->q...", keys, q)


def _float64_softmax(logits: torch.Tensor, blocks: torch.Tensor):
    """max, denominator, accumulator of softmax over the blocks of logits [Q, N, ...], in float64."""
    logits = logits.double()
    top = logits.max(1).values
    weights = (logits - top.unsqueeze(1)).exp()
    return top, weights.sum(1), torch.einsum("qn...,n...d->q...d", weights, blocks.double())


def _float64_stats(queries: torch.Tensor, blocks: torch.Tensor, norm_w: torch.Tensor | None, eps: float = 1e-6):
    """max, denominator, accumulator of softmax_n(q_eff . RMSNorm(b_n)) over the blocks, in float64."""
    return _float64_softmax(_float64_logits(queries, blocks, norm_w, eps), blocks)


CASES = [  # (blocks N, rows shape, D, sites Q, dtype, key-norm weights, launcher arguments)
    (3, (5,), 40, 4, torch.bfloat16, True, {"fused": True}),
    (3, (5,), 40, 4, torch.bfloat16, True, {"fused": True, "apply_rows": 4}),  # one partial 4-row tile + 1
    (1, (2, 3), 40, 3, torch.bfloat16, False, {"fused": True, "apply_rows": 2}),  # a layer with one block
    (5, (6,), 48, 5, torch.float32, True, {"fused": True, "apply_rows": 2}),  # 3xTF32 path
    (3, (5,), 40, 4, torch.bfloat16, True, {"chunks": (2, 3), "score_rows": 2, "apply_rows": 2}),
    (6, (7,), 56, 6, torch.bfloat16, True, {"chunks": (3, 2), "score_rows": 4}),
    (2, (3,), 40, 2, torch.float32, False, {"chunks": (1, 1)}),
    (3, (2, 3), 40, 4, torch.bfloat16, False, {"score_rows": 4}),  # default chunks and apply tiles
]


@pytest.mark.parametrize(("n_blocks", "rows", "dim", "sites", "dtype", "with_norm_w", "kwargs"), CASES)
def test_inter_matches_float64(interpreted, n_blocks, rows, dim, sites, dtype, with_norm_w, kwargs):
    gen = torch.Generator().manual_seed(n_blocks * 100 + dim)
    blocks = (torch.randn(n_blocks, *rows, dim, generator=gen) * 3).to(dtype)
    queries = torch.randn(sites, dim, generator=gen)
    norm_w = torch.rand(sites, dim, generator=gen) + 0.5 if with_norm_w else None
    ours = inter_triton.attnres_inter(queries, blocks, norm_w, block_d=16, apply_block_d=16, **kwargs)
    expected = _float64_stats(queries, blocks, norm_w)
    for got, want in zip((ours.max, ours.denom, ours.acc), expected, strict=True):
        assert got.dtype == torch.float32 and got.shape == want.shape
        torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=2e-5)
    # The statistics are a valid online softmax: each site's result is eq.9 over the blocks alone.
    site = sites - 1
    direct = attnres_direct(queries[site].double(), blocks.double(), norm_w[site].double() if with_norm_w else None)
    torch.testing.assert_close(ours.row(site).result().double(), direct, rtol=1e-5, atol=1e-5)


def test_fused_and_split_forms_agree(interpreted):
    """The fused form (opt-in) and the two-kernel form give the same numbers, to 1e-6 (tighter than the
    float64 tolerance above, which each form also meets)."""
    gen = torch.Generator().manual_seed(11)
    blocks = torch.randn(4, 9, 64, generator=gen).bfloat16()
    queries, norm_w = torch.randn(6, 64, generator=gen), torch.rand(6, 64, generator=gen) + 0.5
    fused = inter_triton.attnres_inter(queries, blocks, norm_w, block_d=32, apply_block_d=32, fused=True)
    split = inter_triton.attnres_inter(queries, blocks, norm_w, block_d=32, apply_block_d=32, chunks=(2, 2))
    for a, b in ((fused.max, split.max), (fused.denom, split.denom), (fused.acc, split.acc)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_dominant_block_takes_the_weight(interpreted):
    """Hand-made case: a block aligned with the query wins the softmax; the accumulator/denominator is it."""
    dim = 32
    query = torch.ones(1, dim) * 4.0
    blocks = torch.stack([torch.ones(1, dim), -torch.ones(1, dim), torch.zeros(1, dim)]).bfloat16()
    ours = inter_triton.attnres_inter(query, blocks, block_d=16, apply_block_d=16, fused=True)
    # logits: +4*32, -4*32, 0 (RMSNorm(0) = 0): exp(-128) of the others vanish next to exp(0) at the top.
    assert ours.max.item() == pytest.approx(4.0 * dim / (1 + 1e-6) ** 0.5, rel=1e-6)
    torch.testing.assert_close(ours.row(0).result(), torch.ones(1, dim))


@pytest.mark.parametrize(("kwargs", "field"), [({"apply_rows": 3}, "apply_rows"), ({"score_rows": 0}, "score_rows")])
def test_bad_tuning_names_the_argument(interpreted, kwargs, field):
    with pytest.raises(ValueError, match=field):
        inter_triton.attnres_inter(torch.randn(2, 16), torch.randn(2, 3, 16), **kwargs)


def test_bad_shapes_name_the_argument(interpreted):
    with pytest.raises(ValueError, match="queries"):
        inter_triton.attnres_inter(torch.randn(2, 15), torch.randn(2, 3, 16))
    with pytest.raises(ValueError, match="norm_weights"):
        inter_triton.attnres_inter(torch.randn(2, 16), torch.randn(2, 3, 16), torch.randn(3, 16))


def test_prefill_sized_rows_take_wider_score_tiles(interpreted, monkeypatch):
    """score_rows=None picks 16-row score tiles once the rows fill the GPU (faked here by one SM), and the
    numbers stay those of float64 math."""
    monkeypatch.setattr(inter_triton, "sm_count", lambda device, cpu: 1)
    gen = torch.Generator().manual_seed(5)
    blocks, queries = torch.randn(3, 40, 32, generator=gen).bfloat16(), torch.randn(4, 32, generator=gen)
    plan = inter_triton.plan_inter(queries, blocks, block_d=16, apply_block_d=16)
    assert plan.consts["BM_SCORES"] == 16 and plan.score_grid[0] == 3
    ours = plan.run()
    for got, want in zip((ours.max, ours.denom, ours.acc), _float64_stats(queries, blocks, None), strict=True):
        torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=2e-5)


@pytest.mark.gpu
@pytest.mark.parametrize(("n_blocks", "rows", "dim", "sites"), [(5, 37, 200, 7), (8, 64, 7168, 24), (9, 3, 7168, 1)])
def test_compiled_kernels_match_float64_on_gpu(n_blocks, rows, dim, sites):
    """The compiled kernels (bf16 MMAs on the split parts; the interpreter multiplies the parts as float32)
    against float64 math at serving-sized D, both forms, including the final site's single query."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    gen = torch.Generator(device="cuda").manual_seed(rows)
    blocks = (torch.randn(n_blocks, rows, dim, generator=gen, device="cuda") * 3).bfloat16()
    queries = torch.randn(sites, dim, generator=gen, device="cuda").bfloat16() * dim**-0.5
    norm_w = (torch.rand(sites, dim, generator=gen, device="cuda") + 0.5).bfloat16()
    expected = _float64_stats(queries, blocks, norm_w)
    for kwargs in ({}, {"fused": True}):
        ours = inter_triton.attnres_inter(queries, blocks, norm_w, **kwargs)
        for got, want in zip((ours.max, ours.denom, ours.acc), expected, strict=True):
            # Accumulator entries cancel towards 0: the bound is relative to the largest entry (as the
            # benchmark's norm-relative error: 5e-7 at decode, 1.1e-5 over one chain of D=7168).
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=5e-5 * want.abs().max().item())
