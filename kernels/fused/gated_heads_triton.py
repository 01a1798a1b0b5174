"""Gated MLA's output gate in one launch, reading the head-major attention values in place: out[b, h*Dv + d]
= o[h, b, d] * sigmoid(gate[b, h*Dv + d]) (replaces the float32 casts, sigmoid, multiply and cast back of
the torch form, and the copy that turns [H, B, Dv] into the token-major [B, H*Dv] the output GEMM reads).
Program = (sequence, head); the gate is a row-strided slice of the fused projection GEMM's output.
"""

from __future__ import annotations

import torch

from kernels._triton import next_pow2, require, tl, triton

if triton is not None:

    @triton.jit
    def _gated_heads_kernel(o, gate, out, Dv, H, stride_oh, stride_ob, stride_gate, BLOCK: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < Dv
        v = tl.load(o + h * stride_oh + b * stride_ob + cols, mask=ok, other=0.0).to(tl.float32)
        g = tl.load(gate + b * stride_gate + h * Dv + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out + b * H * Dv + h * Dv + cols, (v * tl.sigmoid(g)).to(out.dtype.element_ty), mask=ok)


def gated_heads(o: torch.Tensor, gate: torch.Tensor, num_warps: int = 4) -> torch.Tensor:
    """Same contract as kernels.fused.naive.gated_heads (o [H, B, Dv] with unit last stride, gate [B, H*Dv]
    row-strided with unit column stride)."""
    heads, batch, width = o.shape
    require(o.stride(2) == 1, f"o's last dim must have unit stride, got strides {o.stride()}")
    require(gate.dim() == 2 and gate.shape == (batch, heads * width) and gate.stride(1) == 1,
            f"gate must be [{batch}, {heads * width}] with unit column stride, got {tuple(gate.shape)}")
    out = torch.empty(batch, heads * width, dtype=o.dtype, device=o.device)
    if batch:
        _gated_heads_kernel[(batch, heads)](o, gate, out, width, heads, o.stride(0), o.stride(1), gate.stride(0),
                                            BLOCK=next_pow2(width), num_warps=num_warps)
    return out
