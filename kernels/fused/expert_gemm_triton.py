"""Every expert's gate|up GEMM of one decode step with the GLU in its epilogue, in one launch (the dense MoE
form: at batch 16-128 every expert is read anyway).

z [T, l] against each expert's stacked [gate; up] rows of w13 [E, 2F, l], the GLU (SiTU or SwiGLU) applied
to the float32 accumulators -> act [E, T, F] (the operand layout of the down projection's batched GEMM).
Replaces cuBLAS's GEMM over the [E*2F, l] view, the [T, E*2F] bf16 round trip through memory and the
activation's launch: 30.5 us instead of 36.1 us a layer on the H200 at batch 64 (bench.serve_glue), the
weights streaming at 3.3 TB/s. The same kernel without the GLU for the down projection only tied
cuBLAS's batched GEMM (16.6 vs 16.9 us), so that one stays cuBLAS.
Program = (one token tile of up to 64, BLOCK_N output columns of one expert): the gate rows n and the up rows
F + n are multiplied in the same K loop, so the GLU pairs them in registers. Token tiles are the fastest
grid axis: above 64 tokens the tiles that share a weight block run side by side and the second read hits
L2. No split along K: one expert alone gives F / BLOCK_N programs, hundreds in all.
"""

from __future__ import annotations

import torch

from kernels._triton import next_pow2, require, tl, triton
from kernels.fused.naive import require_activation

if triton is not None:
    from kernels.moe.situ_glu_triton import situ_glu_values

    @triton.jit
    def _gate_up_glu_kernel(z, w, out, T, F, K, stride_zt, stride_we, stride_wn, stride_oe, stride_ot, beta1, beta2,
                            SITU: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr):
        tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        expert = tl.program_id(2).to(tl.int64)
        ks = tl.arange(0, BLOCK_K)
        token_ok, col_ok = tokens < T, cols < F
        z_at = z + tokens.to(tl.int64)[:, None] * stride_zt + ks[None, :]
        w_at = w + expert * stride_we + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :]
        gate = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        up = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            z_ok, w_ok = token_ok[:, None], col_ok[:, None]
            if not EVEN_K:
                z_ok = z_ok & (k0 + ks < K)[None, :]
                w_ok = w_ok & (k0 + ks < K)[None, :]
            x = tl.load(z_at, mask=z_ok, other=0.0)
            gate = tl.dot(x, tl.trans(tl.load(w_at, mask=w_ok, other=0.0)), gate, input_precision="ieee")
            up = tl.dot(x, tl.trans(tl.load(w_at + F * stride_wn, mask=w_ok, other=0.0)), up, input_precision="ieee")
            z_at += BLOCK_K
            w_at += BLOCK_K
        if SITU:
            act = situ_glu_values(gate, up, beta1, beta2)
        else:
            act = gate * tl.sigmoid(gate) * up
        target = out + expert * stride_oe + tokens.to(tl.int64)[:, None] * stride_ot + cols[None, :]
        tl.store(target, act.to(out.dtype.element_ty), mask=token_ok[:, None] & col_ok[None, :])


def expert_gate_up_glu(z: torch.Tensor, w13: torch.Tensor, activation: str = "situ", beta1: float = 4.0,
                       beta2: float = 25.0, block_n: int = 64, block_k: int = 64, num_warps: int = 4,
                       num_stages: int = 3) -> torch.Tensor:
    """Same contract as kernels.fused.naive.expert_gate_up_glu: z [T, l] (row-strided allowed), w13 [E, 2F, l]
    -> act [E, T, F] in z's dtype, the GLU computed from float32 accumulators."""
    require_activation(activation)
    require(z.dim() == 2 and w13.dim() == 3 and w13.shape[2] == z.shape[1] and w13.shape[1] % 2 == 0,
            f"z must be [T, l] and w13 [E, 2F, l], got {tuple(z.shape)} and {tuple(w13.shape)}")
    require(z.dtype == w13.dtype, f"z and w13 must share a dtype, got {z.dtype} and {w13.dtype}")
    require(z.stride(1) == 1 and w13.stride(2) == 1, "z and w13 need a unit stride along l")
    (tokens, depth), (experts, two_f, _) = z.shape, w13.shape
    width = two_f // 2
    out = torch.empty(experts, tokens, width, dtype=z.dtype, device=z.device)
    if tokens == 0:
        return out
    block_t = min(64, max(16, next_pow2(tokens)))
    block_k = min(block_k, max(16, next_pow2(depth)))
    grid = (triton.cdiv(tokens, block_t), triton.cdiv(width, block_n), experts)
    _gate_up_glu_kernel[grid](
        z, w13, out, tokens, width, depth, z.stride(0), w13.stride(0), w13.stride(1), out.stride(0), out.stride(1),
        float(beta1), float(beta2), SITU=activation == "situ", EVEN_K=depth % block_k == 0, BLOCK_T=block_t,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    return out
