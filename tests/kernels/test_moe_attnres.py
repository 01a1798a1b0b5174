"""Latent-MoE MXFP4 decode, SiTU-GLU and AttnRes merge+norm: references vs float64, Triton vs references."""

from __future__ import annotations

import pytest
import torch

from k3core.ops.attnres import attnres_direct, attnres_inter
from k3core.quant.mxfp4 import dequantize, quantize
from kernels.attnres import merge_norm_triton
from kernels.attnres import naive as attnres_naive
from kernels.moe import latent_moe_decode_triton, situ_glu_triton
from kernels.moe import naive as moe_naive
from kernels.moe.tiles import Tile

T, K, E, L, F = 2, 3, 4, 64, 32  # 6 picks from 4 experts: the two tokens share at least two experts
SMALL = Tile(16, 32)  # several row blocks and column steps on these tiny shapes


def _moe_case(seed: int, experts: int = E):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, L, generator=gen)
    gate_up = quantize(torch.randn(experts, 2 * F, L, generator=gen) * 0.2)
    down = quantize(torch.randn(experts, L, F, generator=gen) * 0.2)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:K] for _ in range(T)]).int()
    return x, ids, torch.rand(T, K, generator=gen), *gate_up, *down


def test_moe_reference_matches_float64_math():
    x, ids, w, gu_p, gu_s, d_p, d_s = _moe_case(0)
    out = moe_naive.latent_moe_decode(x, ids, w, gu_p, gu_s, d_p, d_s)
    w_gu, w_d = dequantize(gu_p, gu_s, torch.float64), dequantize(d_p, d_s, torch.float64)
    for t in range(T):
        expected = torch.zeros(L, dtype=torch.float64)
        for j, e in enumerate(ids[t].tolist()):
            g, u = (w_gu[e] @ x[t].double()).split(F)
            h = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)
            expected += w[t, j].double() * (w_d[e] @ h)
        torch.testing.assert_close(out[t].double(), expected, rtol=1e-5, atol=1e-5)


def test_triton_moe_decode_matches_reference(interpreted):
    """Experts shared by both tokens are streamed once (expert-centric) and still serve each token; float32
    x enters the bf16 products as 3 bf16 parts, so the result keeps float32 accuracy."""
    case = _moe_case(1)
    shared = set(case[1][0].tolist()) & set(case[1][1].tolist())
    assert len(shared) >= 2
    # 2 column steps over l and 2 row blocks over F (gate/up); 2 row blocks over l (down, its own tile).
    out = latent_moe_decode_triton.latent_moe_decode(*case, gate_up_tile=Tile(16, 32), down_tile=Tile(32, 32))
    torch.testing.assert_close(out, moe_naive.latent_moe_decode(*case), rtol=1e-5, atol=1e-5)


def test_triton_moe_decode_bf16_activations(interpreted):
    """bf16 x (one bf16 part, h rounded to bf16 like x) against the float32 reference of the same x."""
    x, ids, w, *packs = _moe_case(3)
    x = x.bfloat16()
    out = latent_moe_decode_triton.latent_moe_decode(x, ids, w, *packs, gate_up_tile=SMALL, down_tile=SMALL)
    ref = moe_naive.latent_moe_decode(x.float(), ids, w, *packs)
    assert out.dtype == torch.bfloat16
    assert ((out.double() - ref.double()).norm() / ref.double().norm()).item() < 1e-2


def test_triton_moe_decode_expert_with_more_tokens_than_a_token_block(interpreted):
    """19 of 20 tokens pick expert 0: its program serves them in two passes of 16 slots."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(20, L, generator=gen)
    ids = torch.zeros(20, 1, dtype=torch.int32)
    ids[7, 0] = 1
    packs = (*quantize(torch.randn(2, 2 * F, L, generator=gen) * 0.2),
             *quantize(torch.randn(2, L, F, generator=gen) * 0.2))
    w = torch.rand(20, 1, generator=gen)
    out = latent_moe_decode_triton.latent_moe_decode(x, ids, w, *packs, gate_up_tile=Tile(32, 32),
                                                     down_tile=Tile(32, 32))
    torch.testing.assert_close(out, moe_naive.latent_moe_decode(x, ids, w, *packs), rtol=1e-5, atol=1e-5)


def test_triton_moe_decode_single_token(interpreted):
    """Batch 1 (one-wide token axis in the kernel) against the reference."""
    x, ids, w, *packs = _moe_case(8)
    one = (x[:1], ids[:1], w[:1], *packs)
    out = latent_moe_decode_triton.latent_moe_decode(*one, gate_up_tile=SMALL, down_tile=SMALL)
    torch.testing.assert_close(out, moe_naive.latent_moe_decode(*one), rtol=1e-5, atol=1e-5)


def test_triton_moe_decode_token_naming_an_expert_twice(interpreted):
    """A token that names one expert in two slots gets both router weights (as the reference does)."""
    x, ids, w, *packs = _moe_case(6, experts=3)
    ids[0, 2] = ids[0, 0]
    out = latent_moe_decode_triton.latent_moe_decode(x, ids, w, *packs, gate_up_tile=SMALL, down_tile=SMALL)
    torch.testing.assert_close(out, moe_naive.latent_moe_decode(x, ids, w, *packs), rtol=1e-5, atol=1e-5)


def test_moe_bad_arguments_name_the_field(interpreted):
    x, ids, w, gu_p, gu_s, d_p, d_s = _moe_case(2)
    with pytest.raises(ValueError, match="down_scales"):
        latent_moe_decode_triton.latent_moe_decode(x, ids, w, gu_p, gu_s, d_p, d_s[:, :1])
    with pytest.raises(ValueError, match="h_parts"):
        latent_moe_decode_triton.latent_moe_decode(x, ids, w, gu_p, gu_s, d_p, d_s, h_parts=4)
    with pytest.raises(ValueError, match="tile cols"):
        latent_moe_decode_triton.latent_moe_decode(x, ids, w, gu_p, gu_s, d_p, d_s, gate_up_tile=Tile(16, 24))
    with pytest.raises(ValueError, match="tile rows"):
        latent_moe_decode_triton.latent_moe_decode(x, ids, w, gu_p, gu_s, d_p, d_s, down_tile=Tile(8, 32))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # sigmoid of a large negative: 0, as wanted
def test_triton_situ_glu_matches_reference(interpreted):
    gate_up = torch.randn(3, 5, 2 * 40, generator=torch.Generator().manual_seed(3)) * 30  # saturating range
    out = situ_glu_triton.situ_glu_fused(gate_up, block=16)
    torch.testing.assert_close(out, moe_naive.situ_glu_fused(gate_up), rtol=1e-5, atol=1e-4)
    assert out.abs().max() < 4 * 25  # the eq.19 bound


def _attnres_case(seed: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randn(3, 5, 48, generator=gen)
    queries, key_w = torch.randn(4, 48, generator=gen), torch.rand(4, 48, generator=gen) + 0.5
    stats = attnres_inter(queries, blocks, key_w).row(2)
    partial = torch.randn(5, 48, generator=gen).to(dtype)
    return blocks, queries[2], key_w[2], stats, partial, torch.rand(48, generator=gen) + 0.5


def test_attnres_reference_equals_direct_attention_then_norm():
    blocks, query, key_w, stats, partial, out_w = _attnres_case(4, torch.float64)
    h, normed = attnres_naive.attnres_merge_norm(stats.max, stats.denom, stats.acc, query, partial, out_w, key_w)
    direct = attnres_direct(query.double(), torch.cat([blocks.double(), partial[None]]), key_w.double())
    torch.testing.assert_close(h, direct, rtol=1e-5, atol=1e-5)  # stats come from float32 blocks
    expected = direct / direct.square().mean(-1, keepdim=True).add(1e-6).sqrt() * out_w.double()
    torch.testing.assert_close(normed, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_partial", [True, False])
def test_triton_attnres_merge_norm_matches_reference(interpreted, dtype, with_partial):
    _, query, key_w, stats, partial, out_w = _attnres_case(5, dtype)
    args = (stats.max, stats.denom, stats.acc.contiguous(), query, partial if with_partial else None, out_w, key_w)
    ours = merge_norm_triton.attnres_merge_norm(*args)
    ref = attnres_naive.attnres_merge_norm(*args)
    for a, b in zip(ours, ref, strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b)  # dtype-aware: one bf16 rounding step apart at most
