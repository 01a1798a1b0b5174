"""The tail of the latent MoE in one launch: routed experts' rows weighted and summed per token, rounded to
the model dtype, RMS-normalised (the latent norm), and the shared experts' GLU written beside it.

Replaces, per MoE layer: the zero fill and scatter (or index_add) of the combine, the float32 casts, the
einsum's copies, the cast back, the RMSNorm, the shared experts' activation and the add of the two
branches (what follows is one GEMM of [normed | shared activation] against [W_up | W_shared_down]).
Programs = (token, part): part 0 gathers the token's K picked rows in one 2-D load (row = index *
index_stride + token * token_stride, so the dense [E, T, l] expert output and the grouped [T*k, l] one are
both read in place, only the picked rows) and keeps the whole l-wide sum in registers for the norm; part
j > 0 writes the shared GLU's j-th BLOCK_F slice. A decode launch has a few dozen tokens: one program per
token walking its K rows and then its shared slices was a chain of dependent round trips on a third of the
SMs; split this way the chains are two loads deep and the grid is (1 + F / BLOCK_F) times wider.
"""

from __future__ import annotations

import torch

from kernels._triton import next_pow2, require, tl, triton
from kernels.fused.naive import require_activation

if triton is not None:
    from kernels.moe.situ_glu_triton import glu_values

    @triton.jit
    def _combine_kernel(rows, index, weight, norm_w, shared, out, L, F, K, stride_rows, stride_shared, stride_out,
                        index_stride, token_stride, eps, beta1, beta2, HAS_NORM: tl.constexpr, SITU: tl.constexpr,
                        K_P2: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_F: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        if part == 0:
            cols = tl.arange(0, BLOCK_L)
            col_ok = cols < L
            picks = tl.arange(0, K_P2)
            pick_ok = picks < K
            pick = tl.load(index + token * K + picks, mask=pick_ok, other=0).to(tl.int64)
            row = pick * index_stride + token * token_stride
            values = tl.load(rows + row[:, None] * stride_rows + cols[None, :],
                             mask=pick_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
            scale = tl.load(weight + token * K + picks, mask=pick_ok, other=0.0).to(tl.float32)
            # the reference rounds the float32 sum before the norm
            routed = tl.sum(values * scale[:, None], axis=0).to(out.dtype.element_ty).to(tl.float32)
            if HAS_NORM:
                inv = 1.0 / tl.sqrt(tl.sum(routed * routed, axis=0) / L + eps)
                routed = routed * inv * tl.load(norm_w + cols, mask=col_ok, other=0.0).to(tl.float32)
            tl.store(out + token * stride_out + cols, routed.to(out.dtype.element_ty), mask=col_ok)
        else:
            f = (part - 1) * BLOCK_F + tl.arange(0, BLOCK_F)
            ok = f < F
            g = tl.load(shared + token * stride_shared + f, mask=ok, other=0.0).to(tl.float32)
            u = tl.load(shared + token * stride_shared + F + f, mask=ok, other=0.0).to(tl.float32)
            act = glu_values(g, u, beta1, beta2, SITU)
            tl.store(out + token * stride_out + L + f, act.to(out.dtype.element_ty), mask=ok)

def moe_combine(rows: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, index_stride: int,
                token_stride: int, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                shared_gate_up: torch.Tensor | None = None, activation: str = "situ", beta1: float = 4.0,
                beta2: float = 25.0, out_dtype: torch.dtype | None = None, block_f: int = 512,
                num_warps: int = 4) -> torch.Tensor:
    """Same contract as kernels.fused.naive.moe_combine (rows [R, l] and shared_gate_up [T, 2F] may be
    row-strided views with unit column stride; index and weight [T, K] contiguous)."""
    require_activation(activation)
    require(rows.dim() == 2 and rows.stride(1) == 1, f"rows must be [R, l] with unit column stride, got "
            f"{tuple(rows.shape)} strides {rows.stride()}")
    require(index.shape == weight.shape and index.dim() == 2, f"index {tuple(index.shape)} and weight "
            f"{tuple(weight.shape)} must be the same [T, K]")
    index, weight = index.contiguous(), weight.contiguous()
    tokens, picks = index.shape
    latent = rows.shape[1]
    width = 0
    if shared_gate_up is not None:
        require(shared_gate_up.dim() == 2 and shared_gate_up.shape[0] == tokens and shared_gate_up.stride(1) == 1
                and shared_gate_up.shape[1] % 2 == 0, f"shared_gate_up must be [T={tokens}, 2F] with unit "
                f"column stride, got {tuple(shared_gate_up.shape)}")
        width = shared_gate_up.shape[1] // 2
    if norm_weight is not None:
        require(norm_weight.shape == (latent,), f"norm_weight must be [{latent}], got {tuple(norm_weight.shape)}")
    out_dtype = rows.dtype if out_dtype is None else out_dtype
    out = torch.empty(tokens, latent + width, dtype=out_dtype, device=rows.device)
    if tokens == 0:
        return out
    shared = rows if shared_gate_up is None else shared_gate_up
    block_f = min(block_f, next_pow2(max(width, 1)))
    _combine_kernel[(tokens, 1 + triton.cdiv(width, block_f))](
        rows, index, weight, rows if norm_weight is None else norm_weight, shared, out, latent, width, picks,
        rows.stride(0), shared.stride(0), out.stride(0), index_stride, token_stride, float(eps), float(beta1),
        float(beta2), HAS_NORM=norm_weight is not None, SITU=activation == "situ", K_P2=next_pow2(picks),
        BLOCK_L=next_pow2(latent), BLOCK_F=block_f, num_warps=num_warps)
    return out
