"""Block AttnRes phase 1 (kernels/attnres/inter_triton.py) in the Triton interpreter against float64 math.

The kernel's scores and apply phases (the interpreter runs programs one after another, so it launches them
as two passes of the same kernel; on the GPU one launch with a per-row-tile barrier does both), over row
tiles and D chunks, and the block-diagonal multi-row apply steps inside a tile, are held to a float64
evaluation of eq.9's batched statistics, over block counts that are not powers of two, a single block, row
counts that leave partial tiles, bf16 and float32 blocks, with and without key-norm weights.
"""

from __future__ import annotations

import pytest
import torch

from k3core.ops.attnres import attnres_direct
from kernels.attnres import inter_triton


def _float64_stats(queries: torch.Tensor, blocks: torch.Tensor, norm_w: torch.Tensor | None, eps: float = 1e-6):
    """max, denominator, accumulator of softmax_n(q_eff . RMSNorm(b_n)) over the blocks, in float64."""
    b = blocks.double()
    q = queries.double() * (norm_w.double() if norm_w is not None else 1.0)
    keys = b / b.square().mean(-1, keepdim=True).add(eps).sqrt()
    logits = torch.einsum("n...d,qd->qn...", keys, q)
    top = logits.max(1).values
    weights = (logits - top.unsqueeze(1)).exp()
    return top, weights.sum(1), torch.einsum("qn...,n...d->q...d", weights, b)


CASES = [  # (blocks N, rows shape, D, sites Q, dtype, key-norm weights, launcher arguments)
    (3, (5,), 40, 4, torch.bfloat16, True, {"chunks": 1, "score_rows": 8}),  # one tile, all of D
    (3, (5,), 40, 4, torch.bfloat16, True, {"chunks": 1, "score_rows": 4, "apply_rows": 4}),  # partial tile
    (1, (2, 3), 40, 3, torch.bfloat16, False, {"chunks": 1, "apply_rows": 2}),  # a layer with one block
    (5, (6,), 48, 5, torch.float32, True, {"chunks": 2, "score_rows": 2, "apply_rows": 2}),  # 3xTF32 path
    (3, (5,), 40, 4, torch.bfloat16, True, {"chunks": 3, "score_rows": 2, "apply_rows": 2}),
    (6, (7,), 56, 6, torch.bfloat16, True, {"chunks": 2, "score_rows": 4}),  # 2 apply steps per tile
    (2, (3,), 40, 2, torch.float32, False, {"chunks": 1, "score_rows": 1, "apply_rows": 1}),
    (3, (2, 3), 40, 4, torch.bfloat16, False, {"score_rows": 4}),  # default chunks (as many as D allows)
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


def test_chunkings_agree(interpreted):
    """One D chunk per tile and several give the same numbers, to 1e-6 (tighter than the float64 tolerance
    above, which each also meets): the partials of the chunks are added up exactly once."""
    gen = torch.Generator().manual_seed(11)
    blocks = torch.randn(4, 9, 64, generator=gen).bfloat16()
    queries, norm_w = torch.randn(6, 64, generator=gen), torch.rand(6, 64, generator=gen) + 0.5
    whole = inter_triton.attnres_inter(queries, blocks, norm_w, block_d=32, apply_block_d=32, chunks=1)
    split = inter_triton.attnres_inter(queries, blocks, norm_w, block_d=16, apply_block_d=16, chunks=3)
    for a, b in ((whole.max, split.max), (whole.denom, split.denom), (whole.acc, split.acc)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_hoisted_query_parts_give_the_same_numbers(interpreted, dtype):
    """A caller whose queries are weights computes `query_parts` once and passes it: same statistics as
    the call that cuts the queries itself; the parts are exact (their sum is q_eff to float32 rounding)."""
    gen = torch.Generator().manual_seed(13)
    blocks = torch.randn(3, 5, 48, generator=gen).to(dtype)
    queries, norm_w = torch.randn(4, 48, generator=gen), torch.rand(4, 48, generator=gen) + 0.5
    parts = inter_triton.query_parts(queries, norm_w, blocks.dtype)
    torch.testing.assert_close(parts.double().sum(0), (queries * norm_w).double(), rtol=1e-7, atol=1e-7)
    given = inter_triton.attnres_inter(queries, blocks, norm_w, block_d=16, apply_block_d=16, parts=parts)
    own = inter_triton.attnres_inter(queries, blocks, norm_w, block_d=16, apply_block_d=16)
    for a, b in ((given.max, own.max), (given.denom, own.denom), (given.acc, own.acc)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="parts"):
        inter_triton.attnres_inter(queries, blocks, norm_w, parts=parts[:, :2])


def test_dominant_block_takes_the_weight(interpreted):
    """Hand-made case: a block aligned with the query wins the softmax; the accumulator/denominator is it."""
    dim = 32
    query = torch.ones(1, dim) * 4.0
    blocks = torch.stack([torch.ones(1, dim), -torch.ones(1, dim), torch.zeros(1, dim)]).bfloat16()
    ours = inter_triton.attnres_inter(query, blocks, block_d=16, apply_block_d=16)
    # logits: +4*32, -4*32, 0 (RMSNorm(0) = 0): exp(-128) of the others vanish next to exp(0) at the top.
    assert ours.max.item() == pytest.approx(4.0 * dim / (1 + 1e-6) ** 0.5, rel=1e-6)
    torch.testing.assert_close(ours.row(0).result(), torch.ones(1, dim))


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"apply_rows": 3}, "apply_rows"), ({"score_rows": 0}, "score_rows"),
    ({"score_rows": 2, "apply_rows": 4}, "apply_rows"), ({"chunks": 133}, "chunks"), ({"chunks": 0}, "chunks"),
])
def test_bad_tuning_names_the_argument(interpreted, kwargs, field):
    with pytest.raises(ValueError, match=field):
        inter_triton.attnres_inter(torch.randn(2, 16), torch.randn(2, 3, 16), **kwargs)


def test_bad_shapes_name_the_argument(interpreted):
    with pytest.raises(ValueError, match="queries"):
        inter_triton.attnres_inter(torch.randn(2, 15), torch.randn(2, 3, 16))
    with pytest.raises(ValueError, match="norm_weights"):
        inter_triton.attnres_inter(torch.randn(2, 16), torch.randn(2, 3, 16), torch.randn(3, 16))


@pytest.mark.parametrize(("rows", "sms", "chunk_d"), [(64, 132, 512), (8192, 132, 512), (8192, 132, 1024),
                                                      (40, 1, 16), (3, 200, 16)])
def test_chunk_plan(interpreted, monkeypatch, rows, sms, chunk_d):
    """The launch shape's rules: a chunk is whole D tiles of at most `chunk_d` columns (so the re-read blocks
    are still in L2), or more chunks while the grid has under about two programs per SM; chunks of a tile never
    exceed the SMs (so a tile's programs can all be resident: the barrier's deadlock-freedom) nor the D tiles."""
    monkeypatch.setattr(inter_triton, "sm_count", lambda device, cpu: sms)
    D = 7168 if rows >= 64 else 64
    blocks, queries = torch.empty(2, rows, D, dtype=torch.bfloat16), torch.empty(3, D)
    plan = inter_triton.plan_inter(queries, blocks, chunk_d=chunk_d, block_d=16 if D == 64 else 64,
                                   apply_block_d=16 if D == 64 else 128)
    step = max(plan.consts["BD_S"], plan.consts["BD"])
    tiles = -(-rows // plan.consts["BM_S"])
    assert plan.grid == (tiles * plan.chunks,) and plan.chunk % step == 0
    assert (plan.chunks - 1) * plan.chunk < D <= plan.chunks * plan.chunk  # the chunks cover D, none empty
    assert plan.chunks <= min(sms, D // step)
    assert plan.chunk <= chunk_d or plan.chunks == min(sms, D // step)
    # Rounding a chunk up to whole D tiles at most halves the chunk count asked for.
    assert 2 * plan.grid[0] > min(2 * sms, tiles * min(sms, D // step))


def test_prefill_sized_rows_match_float64(interpreted, monkeypatch):
    """A plan with many row tiles and several chunks per tile (faked small: one SM, 16-column chunks) gives
    the numbers of float64 math."""
    monkeypatch.setattr(inter_triton, "sm_count", lambda device, cpu: 1)
    gen = torch.Generator().manual_seed(5)
    blocks, queries = torch.randn(3, 40, 48, generator=gen).bfloat16(), torch.randn(4, 48, generator=gen)
    plan = inter_triton.plan_inter(queries, blocks, block_d=16, apply_block_d=16, chunk_d=16, score_rows=4)
    assert plan.chunks == 1 and plan.grid == (10,)  # one SM: one chunk per tile (the residency bound)
    ours = plan.run()
    for got, want in zip((ours.max, ours.denom, ours.acc), _float64_stats(queries, blocks, None), strict=True):
        torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=2e-5)


@pytest.mark.gpu
@pytest.mark.parametrize(("n_blocks", "rows", "dim", "sites"), [(5, 37, 200, 7), (8, 64, 7168, 24), (9, 3, 7168, 1)])
def test_one_launch_barrier_on_gpu(n_blocks, rows, dim, sites):
    """On the GPU the chunk programs of a row tile wait for each other inside one launch: the numbers of the
    two-launch form (the partials are added in the same order), float64 math's within the tolerance above,
    and the barrier counters are zero again after every call (else the next call would pass its barrier
    early)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    gen = torch.Generator(device="cuda").manual_seed(rows)
    blocks = (torch.randn(n_blocks, rows, dim, generator=gen, device="cuda") * 3).bfloat16()
    queries = torch.randn(sites, dim, generator=gen, device="cuda").bfloat16() * dim**-0.5
    norm_w = (torch.rand(sites, dim, generator=gen, device="cuda") + 0.5).bfloat16()
    expected = _float64_stats(queries, blocks, norm_w)
    two = inter_triton.attnres_inter(queries, blocks, norm_w, barrier=False)
    for _ in range(3):
        one = inter_triton.attnres_inter(queries, blocks, norm_w)
        torch.cuda.synchronize()
        assert all(int(c.abs().sum()) == 0 for c in inter_triton._COUNTERS.values())
        for got, same, want in zip((one.max, one.denom, one.acc), (two.max, two.denom, two.acc), expected,
                                   strict=True):
            torch.testing.assert_close(got, same, rtol=1e-6, atol=1e-6)
            # Accumulator entries cancel towards 0: the bound is relative to the largest entry (as the
            # benchmark's norm-relative error; 1-2e-6 measured at D=7168).
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
