"""The Gluon form of the dense experts' GEMMs (kernels/fused/expert_gemm_gluon.py, `K3_DENSE_EXPERTS=gluon`).

On the CPU: which calls it takes (`serves`), and that the launchers' `gluon=True` falls back to the Triton form
for every other call (the interpreter's results unchanged). On the H200 (`-m gpu`, compiled; Gluon has no
interpreter): bf16 at mini's expert shapes (E 32, F 768, l 1024: 384 gate|up and 256 down tiles, so every
persistent program walks 2-3 tiles through its ring) against the float32 reference of kernels/fused/naive.py,
both GLUs, token counts inside one 16-row tile (5), one 64-row tile exactly (16, 64) and padded (48)."""

from __future__ import annotations

import pytest
import torch

from kernels.fused import expert_gemm_gluon, expert_gemm_triton
from kernels.fused import naive as fused_naive

E, F, L = 32, 768, 1024  # mini: num_experts, moe_intermediate_size, routed_expert_hidden_size


def _operands(tokens: int, device: torch.device, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """z [T, l] as a column slice of a wider row (the fast path's x GEMM output), w13 [E, 2F, l], act [E, T, F],
    w2 [E, l, F], weights scaled to unit-variance outputs."""
    gen = torch.Generator(device=device).manual_seed(seed + tokens)
    z = torch.randn(tokens, 3 * L, device=device, generator=gen).to(dtype)[:, :L]
    w13 = (torch.randn(E, 2 * F, L, device=device, generator=gen) / L ** 0.5).to(dtype)
    act = torch.randn(E, tokens, F, device=device, generator=gen).to(dtype)
    w2 = (torch.randn(E, L, F, device=device, generator=gen) / F ** 0.5).to(dtype)
    return z, w13, act, w2


def test_serves_only_cuda_bf16_decode_shapes():
    """What the Gluon form refuses stays with the Triton forms: CPU tensors always; on any device fp16, more
    than 64 tokens, K or output columns off its tiles, experts' weights that are not one contiguous stack, token
    rows TMA cannot read (a row stride not a multiple of 16 bytes)."""
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(8, 3 * 128, generator=gen).bfloat16()[:, :128]
    w13, act, w2 = torch.zeros(2, 2 * 64, 128).bfloat16(), torch.zeros(2, 8, 64).bfloat16(), torch.zeros(2, 256, 64).bfloat16()
    assert not expert_gemm_gluon.serves(z, w13, 8, 64, True)  # CPU
    rules = expert_gemm_gluon.shape_rules
    assert rules(z, w13, 8, 64, True) and rules(act, w2, 8, 256, False) and rules(z, w13, 64, 64, True)
    assert not rules(z, w13, 65, 64, True)  # past one 64-row token tile
    assert not rules(z.half(), w13.half(), 8, 64, True)  # fp16
    assert not rules(z[:, :96], w13[:, :, :96], 8, 64, True)  # K not a multiple of 64
    assert not rules(act, w2[:, :192], 8, 192, False)  # 192 output columns: not 128-column tiles
    assert not rules(act, torch.zeros(2, 64, 256).bfloat16().transpose(1, 2), 8, 256, False)  # w2 [E, l, F] strided
    assert not rules(torch.zeros(8, 135).bfloat16()[:, :128], w13, 8, 64, True)  # 270-byte rows


@pytest.mark.parametrize("activation", ["situ", "swiglu"])
def test_gluon_flag_falls_back_to_the_triton_form_off_cuda(interpreted, activation):
    """`gluon=True` where the Gluon form does not serve (here: the CPU interpreter) is the Triton TMA form."""
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(5, 64, generator=gen).half()
    w13 = (torch.randn(2, 2 * 16, 64, generator=gen) / 8).half()
    w2 = (torch.randn(2, 64, 16, generator=gen) / 4).half()
    act = expert_gemm_triton.expert_gate_up_glu(z, w13, activation, block_n=16, block_k=32, tma=True, gluon=True)
    torch.testing.assert_close(act, expert_gemm_triton.expert_gate_up_glu(z, w13, activation, block_n=16, block_k=32,
                                                                          tma=True), rtol=0, atol=0)
    torch.testing.assert_close(expert_gemm_triton.expert_down(act, w2, block_n=16, block_k=16, tma=True, gluon=True),
                               expert_gemm_triton.expert_down(act, w2, block_n=16, block_k=16, tma=True), rtol=0, atol=0)


def _cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch.device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["situ", "swiglu"])
@pytest.mark.parametrize("tokens", [5, 16, 48, 64])
def test_gluon_expert_gemms_match_float32_reference_on_gpu(tokens, activation):
    dev = _cuda()
    z, w13, act, w2 = _operands(tokens, dev)
    assert expert_gemm_gluon.serves(z, w13, tokens, F, True) and expert_gemm_gluon.serves(act, w2, tokens, L, False)
    want = fused_naive.expert_gate_up_glu(z.float(), w13.float(), activation, 4.0, 25.0)
    got = expert_gemm_gluon.expert_gemm(z, w13, torch.empty(E, tokens, F, device=dev, dtype=z.dtype),
                                        expert_gemm_triton.ACTIVATIONS[activation], 4.0, 25.0)
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
    # the launcher's gluon=True is this kernel (same bits)
    routed = expert_gemm_triton.expert_gate_up_glu(z, w13, activation, 4.0, 25.0, tma=True, gluon=True)
    assert torch.equal(routed, got)
    want_down = fused_naive.expert_down(act.float(), w2.float())
    got_down = expert_gemm_triton.expert_down(act, w2, tma=True, gluon=True)
    torch.testing.assert_close(got_down.float(), want_down, rtol=1e-2, atol=1e-2)
    assert torch.equal(got_down, expert_gemm_gluon.expert_gemm(act, w2, torch.empty_like(got_down), 0, 1.0, 1.0))


@pytest.mark.gpu
@pytest.mark.parametrize(("boxes", "resident"), [(2, False), (4, False), (1, True), (2, True)])
@pytest.mark.parametrize("tokens", [16, 48])
def test_gluon_tuning_variants_match_float32_reference_on_gpu(tokens, boxes, resident):
    """The launcher's other tunings (bench.serve_glue's GLUON_VARIANTS): 2 or 4 K boxes a ring stage, the tokens
    resident in shared memory (gate|up only: z is shared by every expert)."""
    dev = _cuda()
    z, w13, act, w2 = _operands(tokens, dev, seed=1)
    want = fused_naive.expert_gate_up_glu(z.float(), w13.float(), "situ", 4.0, 25.0)
    got = expert_gemm_gluon.expert_gemm(z, w13, torch.empty(E, tokens, F, device=dev, dtype=z.dtype), 1, 4.0, 25.0,
                                        boxes=boxes, resident=resident)
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
    if not resident:
        got_down = expert_gemm_gluon.expert_gemm(act, w2, torch.empty(E, tokens, L, device=dev, dtype=z.dtype), 0,
                                                 1.0, 1.0, boxes=boxes)
        torch.testing.assert_close(got_down.float(), fused_naive.expert_down(act.float(), w2.float()),
                                   rtol=1e-2, atol=1e-2)
