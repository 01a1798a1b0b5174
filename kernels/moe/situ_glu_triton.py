"""Fused SiTU-GLU (K3 report eq.12) on the concatenated gate|up projection output.

[beta1 tanh(g / beta1) sigmoid(g)] * [beta2 tanh(u / beta2)] in one pass: read g and u once, write the
product once (the unfused torch expression materialises four intermediates). tanh(y) = 2 sigmoid(2y) - 1.
"""

from __future__ import annotations

import torch

from kernels._triton import require, tl, triton

if triton is not None:

    @triton.jit
    def situ_glu_values(g, u, beta1, beta2):
        """SiTU-GLU of float32 gate and up values; shared with the latent-MoE decode kernel."""
        gate = beta1 * (2 * tl.sigmoid(2 * g / beta1) - 1) * tl.sigmoid(g)
        return gate * (beta2 * (2 * tl.sigmoid(2 * u / beta2) - 1))

    @triton.jit
    def glu_values(g, u, beta1, beta2, SITU: tl.constexpr):
        """The MoE GLU of float32 gate and up values: SiTU-GLU, or SwiGLU when not SITU; shared by the fused
        kernels that apply it in an epilogue (dense experts' gate|up GEMM, the shared experts' combine)."""
        if SITU:
            return situ_glu_values(g, u, beta1, beta2)
        return g * tl.sigmoid(g) * u

    @triton.jit
    def _situ_glu_kernel(gate_up, out, F, beta1, beta2, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < F
        g = tl.load(gate_up + row * 2 * F + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(gate_up + row * 2 * F + F + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out + row * F + cols, situ_glu_values(g, u, beta1, beta2).to(out.dtype.element_ty), mask=ok)


def situ_glu_fused(gate_up: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0, block: int = 1024,
                   num_warps: int = 4) -> torch.Tensor:
    """gate_up [..., 2F] (gate first) -> [..., F] in gate_up's dtype."""
    require(gate_up.shape[-1] % 2 == 0, f"gate_up's last dim must be even (gate | up), got {gate_up.shape[-1]}")
    require(beta1 > 0 and beta2 > 0, f"SiTU betas must be positive, got {beta1}, {beta2}")
    x = gate_up.contiguous().reshape(-1, gate_up.shape[-1])
    F = x.shape[1] // 2
    out = torch.empty(x.shape[0], F, dtype=gate_up.dtype, device=gate_up.device)
    _situ_glu_kernel[(x.shape[0], triton.cdiv(F, block))](x, out, F, beta1, beta2, BLOCK=block,
                                                           num_warps=num_warps)
    return out.reshape(*gate_up.shape[:-1], F)
