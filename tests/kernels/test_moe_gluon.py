"""The Gluon gate/up step of the latent-MoE decode (kernels/moe/gate_up_gluon.py): on the GPU against the
float32 oracle and the Triton kernel; on the CPU, that it never takes a call (Gluon has no interpreter, so
CPU callers keep the Triton kernel)."""

from __future__ import annotations

import pytest
import torch

from k3core.quant.mxfp4 import quantize
from kernels.moe import gate_up_gluon, latent_moe_decode_triton, naive
from kernels.moe.tiles import Tile

GLUON_TILE = Tile(64, 128, 2, 2)


def _experts(gen: torch.Generator, experts: int, latent: int, width: int, device: str) -> tuple[torch.Tensor, ...]:
    return (*quantize(torch.randn(experts, 2 * width, latent, generator=gen, device=device) * latent**-0.5),
            *quantize(torch.randn(experts, latent, width, generator=gen, device=device) * width**-0.5))


def test_cpu_calls_never_take_the_gluon_kernel():
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    assert not gate_up_gluon.serves(x, 128, GLUON_TILE)


@pytest.mark.parametrize(("shape", "tile"), [
    ((17, 256), GLUON_TILE), ((1, 256), Tile(64, 64, 2, 2)), ((1, 256), Tile(32, 128, 2, 2)),
    ((1, 256), Tile(64, 128, 4, 2)), ((1, 64), GLUON_TILE)])
def test_calls_outside_the_kernel_keep_the_triton_kernel(shape, tile):
    """More than 16 tokens, another tile, or rows of fewer than 16 words (l < 128) are not served."""
    if not torch.cuda.is_available():
        pytest.skip("serves() only ever answers yes for CUDA tensors")
    x = torch.zeros(*shape, dtype=torch.bfloat16, device="cuda")
    assert not gate_up_gluon.serves(x, 128, tile)


@pytest.mark.gpu
@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("tokens", [1, 3, 16])
def test_gluon_gate_up_matches_the_oracle_on_gpu(tokens, stages):
    """E=12, k=4, l=512, F=256 (4 row blocks, 4 steps: the ring wraps at every stage count), tokens that
    share experts (token 1 names token 0's first expert; at 16 tokens some expert serves several): the
    whole call with the Gluon gate/up step against the float32 oracle (as the bench's 1e-2 bar) and
    against the Triton gate/up step (bf16 h may differ by a rounding)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    gen = torch.Generator(device="cuda").manual_seed(tokens * 10 + stages)
    E, K, L, F = 12, 4, 512, 256
    packs = _experts(gen, E, L, F, "cuda")
    experts = latent_moe_decode_triton.prepare_experts(*packs)
    x = torch.randn(tokens, L, generator=gen, device="cuda").to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen, device="cuda")[:K] for _ in range(tokens)]).int()
    if tokens > 1 and not (ids[1] == ids[0, 0]).any():
        ids[1, 2] = ids[0, 0]
    w = torch.rand(tokens, K, generator=gen, device="cuda")
    assert gate_up_gluon.serves(x, F, GLUON_TILE)
    got = latent_moe_decode_triton.latent_moe_decode_prepared(x, ids, w, experts, gate_up_tile=GLUON_TILE,
                                                             gluon_stages=stages)
    triton_form = latent_moe_decode_triton.latent_moe_decode_prepared(x, ids, w, experts, gate_up_tile=GLUON_TILE)
    ref = naive.latent_moe_decode(x.float(), ids, w, *packs)
    err = ((got.float() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, err
    torch.testing.assert_close(got.float(), triton_form.float(), rtol=2e-2, atol=2e-2 * ref.abs().max().item())
