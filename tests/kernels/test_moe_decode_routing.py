"""Latent-MoE MXFP4 decode (kernels/moe) on routing patterns and shapes the fixed cases do not cover: the
Triton launcher (interpreted) against the plain-torch reference (test_moe_attnres checks that against
float64)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3core.quant.mxfp4 import quantize
from kernels import compile_check
from kernels.moe import latent_moe_decode_triton, naive, prepared_experts
from kernels.moe.tiles import Tile, default_tiles


def _experts(gen: torch.Generator, experts: int, latent: int, width: int) -> tuple[torch.Tensor, ...]:
    return (*quantize(torch.randn(experts, 2 * width, latent, generator=gen) * latent**-0.5),
            *quantize(torch.randn(experts, latent, width, generator=gen) * width**-0.5))


def _assert_matches_reference(x, ids, w, packs, gate_up: Tile, down: Tile) -> None:
    out = latent_moe_decode_triton.latent_moe_decode(x, ids, w, *packs, gate_up_tile=gate_up, down_tile=down)
    torch.testing.assert_close(out, naive.latent_moe_decode(x, ids, w, *packs), rtol=1e-5, atol=1e-5)


def test_non_power_of_two_shapes_match_the_reference(interpreted):
    """T=3, k=3, E=5, l=96, F=96: a partial row block in both kernels (96 rows in 64-row tiles), three
    32-column steps each, float32 x as three bf16 parts."""
    gen = torch.Generator().manual_seed(11)
    T, K, E, L, F = 3, 3, 5, 96, 96
    packs = _experts(gen, E, L, F)
    x = torch.randn(T, L, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).int()
    w = torch.rand(T, K, generator=gen)
    _assert_matches_reference(x, ids, w, packs, Tile(64, 32), Tile(64, 32))


@pytest.mark.parametrize(("gate_up", "down"), [
    (Tile(16, 128), Tile(32, 128)), (Tile(32, 256), Tile(16, 64)), (Tile(16, 128), Tile(16, 128, splits=2)),
    (Tile(16, 64), Tile(16, 32, splits=4))])
def test_lane_group_column_order_matches_the_reference(interpreted, gate_up, down):
    """Steps of 4 and 8 scale groups (128 / 256 columns), where the weights' words and the activations are
    reordered so that a tensor-core lane's words share a scale (kernels.moe.mxfp4_tile_triton); 1-2 groups
    keep the plain order; the down reduction split 2 and 4 ways (partials added by the last kernel). T=3,
    k=2, E=4, l=256, F=128, float32 x as three bf16 parts."""
    gen = torch.Generator().manual_seed(13)
    T, K, E, L, F = 3, 2, 4, 256, 128
    packs = _experts(gen, E, L, F)
    x = torch.randn(T, L, generator=gen)
    ids = torch.tensor([[0, 2], [2, 3], [1, 0]], dtype=torch.int32)
    w = torch.rand(T, K, generator=gen)
    _assert_matches_reference(x, ids, w, packs, gate_up, down)


PACKS = _experts(torch.Generator().manual_seed(12), 5, 64, 32)  # E=5, l=64, F=32, shared by the examples


@settings(max_examples=5, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(tokens=st.integers(1, 18), top_k=st.integers(1, 4), data=st.data())
def test_any_routing_matches_the_reference(interpreted, tokens, top_k, data):
    """Arbitrary expert ids (repeats inside a token, one expert for every token, more than 16 tokens on
    one expert) and router weights: each expert is served by its first pair and every token gets the
    sum over its slots, as the reference computes it."""
    ids = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, 4), min_size=top_k, max_size=top_k),
                                          min_size=tokens, max_size=tokens)), dtype=torch.int32)
    gen = torch.Generator().manual_seed(tokens * 7 + top_k)
    x = torch.randn(tokens, 64, generator=gen)
    w = torch.rand(tokens, top_k, generator=gen)
    _assert_matches_reference(x, ids, w, PACKS, Tile(32, 64), Tile(64, 32))


@pytest.mark.parametrize(("tile", "message"), [
    (Tile(24, 32), "tile rows"), (Tile(8, 32), "tile rows"), (Tile(16, 48), "tile cols"),
    (Tile(16, 32, warps=3), "tile warps"), (Tile(16, 32, stages=0), "tile stages"),
    (Tile(16, 32, splits=3), "tile splits"),
])
def test_bad_tiles_name_the_field(tile, message):
    with pytest.raises(ValueError, match=message):
        tile.groups(64)


def test_gate_up_tiles_cannot_split():
    x, ids, w = torch.zeros(1, 64), torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1)
    with pytest.raises(ValueError, match="gate/up tiles cannot split"):
        latent_moe_decode_triton.latent_moe_decode(x, ids, w, *PACKS, gate_up_tile=Tile(16, 32, splits=2))


def test_tile_columns_are_capped_at_the_reduction_width():
    assert Tile(16, 512).groups(64) == 2
    assert Tile(16, 512, splits=2).groups(64) == 1
    assert Tile(128, 128, 8, 3, 168).launch_options() == {"num_warps": 8, "maxnreg": 168}


@pytest.mark.parametrize(("pairs", "stages", "cap"), [(1, 2, None), (64, 2, None), (131, 2, None), (132, 3, 168),
                                                   (256, 3, 168)])
def test_default_tiles_follow_the_measured_choice(pairs, stages, cap):
    """2-warp tiles; two stages while there are fewer (token, expert) pairs than SMs, else three stages and
    168 registers (history 25 of docs/kernels.md)."""
    gate_up, down = default_tiles(pairs, 132)
    assert gate_up == Tile(64, 128, 2, stages, cap) and down == Tile(128, 128, 2, stages, cap)
    assert gate_up.groups(2048) >= 1 and down.groups(1024) >= 1



def test_calls_gluon_does_not_take_run_triton_at_the_default_tiles():
    """From as many (token, expert) pairs as SMs the launcher offers gate/up to the warpgroup Gluon kernel at
    its own 64-row 4-warp tile; a call no Gluon kernel takes (here CPU tensors, launches recorded as the H200
    would compile them) runs both Triton kernels at `default_tiles`' tiles, that tile not carried over."""
    T, K, E, L, F = 16, 16, 16, 256, 128
    experts = prepared_experts.PreparedExperts(
        torch.zeros(E, 2 * F, L // 8, dtype=torch.int32), torch.zeros(E, 2 * F, L // 32, dtype=torch.uint8),
        torch.zeros(E, L, F // 8, dtype=torch.int32), torch.zeros(E, L, F // 32, dtype=torch.uint8))
    with compile_check.record_launches({"USE_ASM": True}) as recorder:
        latent_moe_decode_triton.latent_moe_decode_prepared(
            torch.zeros(T, L, dtype=torch.bfloat16), torch.zeros(T, K, dtype=torch.int64), torch.zeros(T, K), experts)
    launched = {spec.kernel.split(":")[1]: spec for spec in recorder.unique()}
    for name, tile in zip(("_gate_up_kernel", "_down_kernel"), default_tiles(T * K, compile_check.H200_SMS),
                          strict=True):
        spec = launched[name]
        constexprs = {list(spec.signature)[path[0]]: v for path, v in spec.constexprs.items()}
        assert (spec.options["num_warps"], spec.options.get("maxnreg"), constexprs["BR"], constexprs["STAGES"]) == (
            tile.warps, tile.max_registers, tile.rows, tile.stages), name
