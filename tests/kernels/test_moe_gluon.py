"""The Gluon kernels of the latent-MoE decode (kernels/moe/decode_gluon.py, decode_wgmma_gluon.py): on the GPU
against the float32 oracle and the Triton kernels; on the CPU, which calls they fit, that CPU calls never take
them (Gluon has no interpreter, so CPU callers keep the Triton kernels) and the warpgroup kernels' K order."""

from __future__ import annotations

import pytest
import torch

from k3core.quant.mxfp4 import quantize
from kernels.moe import (
    decode_gluon,
    decode_wgmma_gluon,
    latent_moe_decode_triton,
    naive,
    prepared_experts,
)
from kernels.moe.tiles import GLUON_DOWN_TILE, Tile

GLUON_TILE = Tile(64, 128, 2, 2)


def _experts(gen: torch.Generator, experts: int, latent: int, width: int, device: str) -> tuple[torch.Tensor, ...]:
    return (*quantize(torch.randn(experts, 2 * width, latent, generator=gen, device=device) * latent**-0.5),
            *quantize(torch.randn(experts, latent, width, generator=gen, device=device) * width**-0.5))


def test_cpu_calls_never_take_the_gluon_kernels():
    """Calls the kernels would compute (`fits`) are not served from CPU tensors."""
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    down_tile = Tile(128, 128, 2, 2)
    assert decode_gluon.fits(1, x.dtype, 128, 256, GLUON_TILE) and decode_gluon.fits(1, x.dtype, 256, 256, down_tile)
    assert not decode_gluon.serves_gate_up(x, 128, GLUON_TILE)
    assert not decode_gluon.serves_down(x, 256, 1, down_tile)


FITTING = {"tokens": 16, "dtype": torch.bfloat16, "rows": 128, "depth": 256, "tile": GLUON_TILE}


@pytest.mark.parametrize("change", [
    {"tokens": 17}, {"dtype": torch.float16}, {"tile": Tile(64, 64, 2, 2)}, {"tile": Tile(8, 128, 1, 2)},
    {"tile": Tile(16, 128, 4, 2)}, {"rows": 96}, {"depth": 320}, {"depth": 128},
    {"tile": Tile(64, 128, 2, 2, splits=2)}])
def test_calls_outside_the_kernels_keep_the_triton_ones(change):
    """A call of 16 bf16 tokens, 128 weight rows and 256 columns of reduction in 64 x 128 tiles at 2 warps
    fits the Gluon kernels; changed in one thing it does not (so the launcher keeps the Triton kernels): more
    than 16 tokens, fp16 activations, 64-column steps, fewer than 16 rows or 8 rows a warp, rows the tile does
    not divide, a reduction not in 128-column steps, or a single step a program (alone or split in two)."""
    assert decode_gluon.fits(**FITTING)
    assert not decode_gluon.fits(**(FITTING | change))


E, K, L, F = 12, 4, 512, 512  # the GPU cases' experts: 4 steps of 128 columns a program


def _call_matches_oracle_and_triton(tokens: int, seed: int, tiles: dict, **gluon) -> None:
    """The whole call at `tiles` with the `gluon` forms and stages against the float32 oracle (the bench's 1e-2
    bar) and against the Triton kernels at the same tiles (bf16 h may differ by a rounding); tokens share
    experts (token 1 names token 0's first expert; at 16 tokens some expert serves several)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    packs = _experts(gen, E, L, F, "cuda")
    experts = prepared_experts.prepare_experts(*packs)
    x = torch.randn(tokens, L, generator=gen, device="cuda").to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen, device="cuda")[:K] for _ in range(tokens)]).int()
    if tokens > 1 and not (ids[1] == ids[0, 0]).any():
        ids[1, 2] = ids[0, 0]
    w = torch.rand(tokens, K, generator=gen, device="cuda")
    got = latent_moe_decode_triton.latent_moe_decode_prepared(x, ids, w, experts, **tiles, **gluon)
    triton_form = latent_moe_decode_triton.latent_moe_decode_prepared(x, ids, w, experts, **tiles, gluon_stages=0,
                                                                     gluon_down_stages=0)
    ref = naive.latent_moe_decode(x.float(), ids, w, *packs)
    err = ((got.float() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, err
    torch.testing.assert_close(got.float(), triton_form.float(), rtol=2e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize(("tokens", "stages", "gate_up", "down"), [
    (1, 3, GLUON_TILE, Tile(128, 128, 2, 2)), (3, 4, GLUON_TILE, Tile(128, 128, 2, 2)),
    (16, 4, Tile(64, 128, 4, 3), Tile(128, 128, 4, 3, splits=2)), (3, 2, Tile(32, 128, 2, 3), Tile(64, 128, 2, 3))])
def test_gluon_kernels_match_the_oracle_on_gpu(tokens, stages, gate_up, down):
    """Both projections on the mma.sync Gluon kernels (4 steps a program; 2 in a down split in two, under a
    4-stage ring whose prologue has a step to skip), 2 and 4 warps, 1-16 tokens: see
    `_call_matches_oracle_and_triton`."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    x = torch.empty(tokens, L, dtype=torch.bfloat16, device="cuda")
    assert decode_gluon.serves_gate_up(x, F, gate_up) and decode_gluon.serves_down(x, F, 1, down)
    _call_matches_oracle_and_triton(tokens, tokens * 10 + stages, {"gate_up_tile": gate_up, "down_tile": down},
                                    gluon_stages=stages, gluon_down_stages=stages)


def _to_k(columns: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """A step's columns as 7 bit axes (after a leading axis of 1), in `order`, flattened: what the kernels'
    reshape + permute do to a [rows, 128] tile."""
    return columns.reshape(1, *[2] * 7).permute(order).reshape(128)


def test_warpgroup_k_order_pairs_each_weight_with_its_activation():
    """The warpgroup kernels' two permutations into the MMA's K order agree: each k holds the same step
    column on the weight side (decoded word w = 4 t + b, its 8 outputs in the asm's order: output i is code
    i of the word, codes j and j + 4 sharing a register, joined as the kernel joins them) and on the
    activation side (columns in storage order); and a lane t's k slots (2t, 2t + 1, 2t + 8, 2t + 9 of each
    16) hold the 32 columns of its scale group t only."""
    column = torch.arange(16)[:, None] * 8 + torch.arange(8)[None, :]  # [word, code]: the step column
    e = [column[:, i] for i in range(8)]

    def join(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.stack([a, b], -1)

    decoded = join(join(join(e[0], e[4]), join(e[1], e[5])), join(join(e[2], e[6]), join(e[3], e[7])))
    weights = _to_k(decoded, decode_wgmma_gluon.WEIGHT_K_ORDER)
    acts = _to_k(torch.arange(128), decode_wgmma_gluon.ACT_K_ORDER)
    assert sorted(weights.tolist()) == list(range(128))
    assert torch.equal(weights, acts)
    k = torch.arange(128)
    lane = (k % 8) // 2  # the thread of a quad that holds slot k % 16 of a wgmma / mma A fragment
    assert torch.equal(weights // 32, lane)


@pytest.mark.gpu
@pytest.mark.parametrize(("tokens", "stages", "down_wgmma", "down"), [
    (1, 3, False, None), (5, 2, True, None), (16, 4, True, None), (3, 3, True, Tile(64, 128, 4, 3, splits=2))])
def test_warpgroup_kernels_match_the_oracle_on_gpu(tokens, stages, down_wgmma, down):
    """Gate/up, and down where `down_wgmma`, on warpgroup MMAs (kernels/moe/decode_wgmma_gluon.py: weights as
    the M side, decoded into the A fragments; activations permuted into the MMA's K order in shared memory):
    4 steps (2 in a down split in two), 1-16 tokens, 2-4 stages, 128- and 64-row down programs; see
    `_call_matches_oracle_and_triton`."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    x = torch.empty(tokens, L, dtype=torch.bfloat16, device="cuda")
    down_tile = down or (decode_wgmma_gluon.DOWN_TILE if down_wgmma else GLUON_DOWN_TILE)
    assert decode_gluon.serves_gate_up(x, F, decode_wgmma_gluon.GATE_UP_TILE)
    assert decode_gluon.serves_down(x, F, 1, down_tile) and (not down_wgmma or decode_wgmma_gluon.serves_down_tile(down_tile))
    _call_matches_oracle_and_triton(tokens, 100 + tokens, {"down_tile": down}, gluon_stages=stages,
                                    gluon_down_stages=stages, gluon_wgmma=True, gluon_down_wgmma=down_wgmma)
