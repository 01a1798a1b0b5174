"""Latent-MoE decode on the CUDA-core path (kernels/moe/mxfp4_gemv_triton.py, GemvTile), interpreted, against
the plain-torch reference (itself checked against float64 in test_moe_attnres); the L2-fair routings of the
benchmark (kernels/perf/moe_cases.routings)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3core.quant.mxfp4 import quantize
from kernels.moe import latent_moe_decode_triton, naive
from kernels.moe.mxfp4_tile_triton import _decode_asm
from kernels.moe.tiles import GemvTile, Tile
from kernels.perf import moe_cases
from kernels.perf.moe_cases import Variant, parse_tiles


def _experts(seed: int, experts: int, latent: int, width: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return (*quantize(torch.randn(experts, 2 * width, latent, generator=gen) * latent**-0.5),
            *quantize(torch.randn(experts, latent, width, generator=gen) * width**-0.5))


def _check(x, ids, w, packs, gate_up: GemvTile, down: GemvTile, blocked: bool = True) -> None:
    experts = latent_moe_decode_triton.prepare_experts(*packs, blocked=blocked)
    out = latent_moe_decode_triton.latent_moe_decode_prepared(x, ids, w, experts, gate_up_tile=gate_up,
                                                              down_tile=down)
    ref = naive.latent_moe_decode(x.float(), ids, w, *packs)  # float32 oracle; the output rounds to x's dtype
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[x.dtype]
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


PACKS = _experts(5, 6, 256, 128)  # E=6, l=256, F=128: 8 groups a gate/up row, 4 a down row


@pytest.mark.parametrize(("gate_up", "down", "dtype"), [
    (GemvTile(16, 64, 2, 2), GemvTile(32, 32, 2, 2), torch.float32),  # 2 ranges, 2 steps of 2 groups
    (GemvTile(8, 128, 1, 1, tokens=2), GemvTile(16, 64, 1), torch.float16),  # 1 range; 2 slots (2 passes)
    (GemvTile(64, 32, 4, 4, tokens=1), GemvTile(8, 32, 4), torch.float32),  # 1 slot, 4 ranges of 1 group
])
def test_gemv_path_matches_the_reference(interpreted, gate_up, down, dtype):
    """T=3, k=2, a token naming one expert twice (its router weights add up), an expert shared by two tokens;
    x in float32 and float16 (h is float32, so both keep x's precision)."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, 256, generator=gen).to(dtype)
    ids = torch.tensor([[0, 4], [4, 2], [5, 5]], dtype=torch.int32)
    _check(x, ids, torch.rand(3, 2, generator=gen), PACKS, gate_up, down)


def test_gemv_path_partial_row_blocks_and_row_storage(interpreted):
    """F=96 and l=96 rows in 64-row programs (the last block half empty), whole-row storage, bf16 x, T=1."""
    packs = _experts(9, 3, 96, 96)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, 96, generator=gen).bfloat16()
    ids = torch.tensor([[2, 0]], dtype=torch.int32)
    for blocked in (True, False):
        _check(x, ids, torch.rand(1, 2, generator=gen), packs, GemvTile(64, 32, 1, 2), GemvTile(64, 32, 1), blocked)


SMALL = _experts(12, 5, 64, 32)  # E=5, l=64, F=32


@settings(max_examples=3, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(tokens=st.integers(1, 6), top_k=st.integers(1, 3), data=st.data())
def test_gemv_path_any_routing(interpreted, tokens, top_k, data):
    """Arbitrary ids (repeats inside a token, one expert for all tokens, more tokens on an expert than the 4
    slots of a pass) give the reference's sums."""
    ids = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, 4), min_size=top_k, max_size=top_k),
                                          min_size=tokens, max_size=tokens)), dtype=torch.int32)
    gen = torch.Generator().manual_seed(tokens * 5 + top_k)
    _check(torch.randn(tokens, 64, generator=gen), ids, torch.rand(tokens, top_k, generator=gen), SMALL,
           GemvTile(16, 32, 2, 2), GemvTile(32, 32, 1, 2))


def test_tile_kinds_cannot_mix():
    x, ids, w = torch.zeros(1, 64), torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1)
    with pytest.raises(ValueError, match="both be GemvTile"):
        latent_moe_decode_triton.latent_moe_decode(x, ids, w, *SMALL, gate_up_tile=GemvTile(), down_tile=Tile(16, 32))


@pytest.mark.parametrize(("tile", "message"), [
    (GemvTile(splits=3), "splits"), (GemvTile(splits=4), "splits"), (GemvTile(rows=24, splits=1), "rows"),
    (GemvTile(cols=48, splits=1), "cols"), (GemvTile(warps=3, splits=1), "warps"),
    (GemvTile(stages=0, splits=1), "stages"), (GemvTile(tokens=8, splits=1), "tokens"),
])
def test_bad_gemv_tiles_name_the_field(tile, message):
    with pytest.raises(ValueError, match=message):
        tile.groups(64)  # 64 columns: 2 groups, so 4 ranges cannot each hold a group


def test_float32_decode_ptx_widens_both_halves():
    """The CUDA-core decode's PTX: per register one lop3, one bf16x2 multiply, then the low half shifted up
    and the high half masked (8 float32 outputs); the tensor-core decode moves the halves out as bf16."""
    f32, bf16 = _decode_asm(f32=True), _decode_asm()
    assert f32.count("lop3.b32") == bf16.count("lop3.b32") == 4
    assert f32.count("shl.b32") == f32.count("and.b32") == 4 and "mov.b32 {" not in f32
    assert bf16.count("mov.b32 {") == 4 and "shl.b32" not in bf16


@pytest.mark.parametrize("T", [1, 2, 4, 8, 16])
def test_l2_fair_routings_share_no_expert_with_the_call_before(T):
    """Consecutive sets (cyclically: the last before the first) name disjoint experts, so a timed call never
    finds the previous call's experts in the L2: 16 sets at T=1 (all 256 experts once), one at T=16; every
    token names k distinct experts; T > 1: tokens 0 and 1 share one."""
    sets = moe_cases.routings(T, torch.Generator().manual_seed(T))
    assert len(sets) == max(1, min(16, moe_cases.E // (T * moe_cases.TOP_K)))
    for s, ids in enumerate(sets):
        assert ids.shape == (T, moe_cases.TOP_K) and ids.dtype == torch.int32 and int(ids.max()) < moe_cases.E
        assert all(row.unique().numel() == moe_cases.TOP_K for row in ids)
        if T > 1:
            assert (ids[1] == ids[0, 0]).any()
        if len(sets) > 1:
            before = sets[s - 1]
            assert not torch.isin(ids, before).any()
    if T == 1:
        assert torch.cat(sets).unique().numel() == moe_cases.E


def test_gemv_variants_parse_with_their_batches():
    assert parse_tiles("g16,128,4,4,2/g32,128,2,4,2,80/T1,2;16,128,2,2/32,128,2,2") == (
        Variant(GemvTile(16, 128, 4, 4, 2), GemvTile(32, 128, 2, 4, 2, 80), batches=(1, 2)),
        Variant(Tile(16, 128, 2, 2), Tile(32, 128, 2, 2)))
    assert Variant(None, None, batches=(1,)).runs_at(1) and not Variant(None, None, batches=(1,)).runs_at(4)
