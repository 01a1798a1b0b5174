"""The dense experts' GEMMs (kernels/fused/expert_gemm_triton.py), interpreted, against the references: the
gate|up + GLU and the down projection, in both load forms (pointer tiles, TMA descriptors), on tiny shapes whose
sizes are not multiples of the blocks (F past the column block, T past the token block, K past the K block).
float16 stands in for bf16 (the interpreter's bf16 tl.dot is broken); the references are checked against
float64 by hand."""

from __future__ import annotations

import pytest
import torch

from kernels.fused import expert_gemm_triton
from kernels.fused import naive as fused_naive

E, F, L = 3, 24, 40  # F not a multiple of the 16-column block, L (the GEMM depth) not of the 32-deep K block


def _inputs(tokens: int, seed: int = 0, dtype: torch.dtype = torch.float16):
    """Row-strided z [T, L] (a column slice, as the fast path's x GEMM output), w13 [E, 2F, L], w2 [E, L, F]."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(tokens, L + 8, generator=gen).to(dtype)[:, 8:]
    w13 = (torch.randn(E, 2 * F, L, generator=gen) / L ** 0.5).to(dtype)
    w2 = (torch.randn(E, L, F, generator=gen) / F ** 0.5).to(dtype)
    return z, w13, w2


def test_expert_down_reference_matches_float64():
    _, _, w2 = _inputs(5, dtype=torch.float32)
    act = torch.randn(E, 5, F, generator=torch.Generator().manual_seed(1))
    got = fused_naive.expert_down(act, w2)
    for e in range(E):
        torch.testing.assert_close(got[e].double(), act[e].double() @ w2[e].double().T, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize(("tokens", "activation"), [(5, "situ"), (19, "swiglu")])
def test_gate_up_glu_matches_reference(interpreted, tma, tokens, activation):
    """19 tokens: two 16-row token tiles, the second mostly out of range (TMA zero-fills it)."""
    z, w13, _ = _inputs(tokens)
    want = fused_naive.expert_gate_up_glu(z, w13, activation, 4.0, 25.0)
    got = expert_gemm_triton.expert_gate_up_glu(z, w13, activation, 4.0, 25.0, block_n=16, block_k=32, tma=tma)
    assert got.shape == want.shape == (E, tokens, F) and got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("tokens", [5, 19])
def test_expert_down_matches_reference(interpreted, tma, tokens):
    """A token tile past an expert's rows reads the next expert's (or, for the last, TMA's zeros): the store
    mask keeps each expert's output its own."""
    _, _, w2 = _inputs(tokens)
    act = torch.randn(E, tokens, F, generator=torch.Generator().manual_seed(2)).to(torch.float16)
    want = fused_naive.expert_down(act.float(), w2.float())
    got = expert_gemm_triton.expert_down(act, w2, block_n=16, block_k=16, tma=tma)
    assert got.shape == (E, tokens, L) and got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)


def test_expert_gemms_refuse_bad_layouts():
    z, w13, w2 = _inputs(4)
    with pytest.raises(ValueError, match="w13"):
        expert_gemm_triton.expert_gate_up_glu(z[:, 1:], w13)
    with pytest.raises(ValueError, match="w2"):
        expert_gemm_triton.expert_down(torch.zeros(E, 4, F + 1, dtype=torch.float16), w2)
    with pytest.raises(ValueError, match="16-byte"):  # a row stride of 2 * 47 bytes cannot be a TMA view
        expert_gemm_triton.expert_gate_up_glu(torch.zeros(4, L + 7, dtype=torch.float16)[:, :L], w13, tma=True)
