"""Every expert's GEMM of one decode step in one launch, streaming each expert's weights once (the dense
MoE form: at batch 16-128 every expert is read anyway).

Gate|up: z [T, l] against each expert's stacked [gate; up] rows of w13 [E, 2F, l], the GLU (SiTU or SwiGLU)
applied to the float32 accumulators in the epilogue -> act [E, T, F]. This replaces cuBLAS's GEMM over the
[E*2F, l] view (3.06 TB/s on the H200 at batch 64), the [T, E*2F] bf16 round trip through memory and the
activation's launch. Down: act [E, T, F] against w2 [E, l, F] -> [E, T, l] (a batched GEMM).
Program = (BLOCK_N output columns of one expert, one token tile of up to 128): the gate rows n and the up
rows F + n are multiplied in the same K loop, so the GLU pairs them in registers. Each weight byte is read
by one program (at decode batches one token tile holds every token); the activations, re-read by every
program of an expert, are small and stay in L2. No split along K: an expert alone gives F / BLOCK_N
programs, hundreds in all.
"""

from __future__ import annotations

import torch

from kernels._triton import next_pow2, require, tl, triton
from kernels.fused.naive import require_activation

if triton is not None:
    from kernels.moe.situ_glu_triton import situ_glu_values

    @triton.jit
    def _expert_gemm_kernel(a, w, out, T, N, K, stride_ae, stride_at, stride_we, stride_wn, stride_oe, stride_ot,
                            beta1, beta2, GLU: tl.constexpr, SITU: tl.constexpr, EVEN_K: tl.constexpr,
                            BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        expert = tl.program_id(1).to(tl.int64)
        tokens = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        token_ok, col_ok = tokens < T, cols < N
        a_at = a + expert * stride_ae + tokens.to(tl.int64)[:, None] * stride_at + ks[None, :]
        w_at = w + expert * stride_we + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :]
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)  # unused (and removed) without GLU
        for k0 in range(0, K, BLOCK_K):
            a_ok, w_ok = token_ok[:, None], col_ok[:, None]
            if not EVEN_K:
                a_ok = a_ok & (k0 + ks < K)[None, :]
                w_ok = w_ok & (k0 + ks < K)[None, :]
            x = tl.load(a_at, mask=a_ok, other=0.0)
            acc = tl.dot(x, tl.trans(tl.load(w_at, mask=w_ok, other=0.0)), acc, input_precision="ieee")
            if GLU:
                up = tl.load(w_at + N * stride_wn, mask=w_ok, other=0.0)
                acc_up = tl.dot(x, tl.trans(up), acc_up, input_precision="ieee")
            a_at += BLOCK_K
            w_at += BLOCK_K
        result = acc
        if GLU:
            if SITU:
                result = situ_glu_values(acc, acc_up, beta1, beta2)
            else:
                result = acc * tl.sigmoid(acc) * acc_up
        target = out + expert * stride_oe + tokens.to(tl.int64)[:, None] * stride_ot + cols[None, :]
        tl.store(target, result.to(out.dtype.element_ty), mask=token_ok[:, None] & col_ok[None, :])


def _launch(a: torch.Tensor, a_expert_stride: int, w: torch.Tensor, width: int, glu: bool, activation: str,
            beta1: float, beta2: float, block_n: int, block_k: int, num_warps: int, num_stages: int) -> torch.Tensor:
    """out [E, T, width] = a[e] @ w[e, :width]^T (and the GLU with rows width.. as the up half)."""
    tokens, depth = a.shape[-2], a.shape[-1]
    experts = w.shape[0]
    require(a.stride(-1) == 1 and w.stride(-1) == 1, "the GEMM operands need a unit stride along K")
    out = torch.empty(experts, tokens, width, dtype=a.dtype, device=a.device)
    if tokens == 0:
        return out
    block_t = min(128, max(16, next_pow2(tokens)))
    block_k = min(block_k, max(16, next_pow2(depth)))
    grid = (triton.cdiv(width, block_n), experts, triton.cdiv(tokens, block_t))
    _expert_gemm_kernel[grid](
        a, w, out, tokens, width, depth, a_expert_stride, a.stride(-2), w.stride(0), w.stride(1), out.stride(0),
        out.stride(1), float(beta1), float(beta2), GLU=glu, SITU=activation == "situ", EVEN_K=depth % block_k == 0,
        BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    return out


def expert_gate_up_glu(z: torch.Tensor, w13: torch.Tensor, activation: str = "situ", beta1: float = 4.0,
                       beta2: float = 25.0, block_n: int = 64, block_k: int = 64, num_warps: int = 4,
                       num_stages: int = 4) -> torch.Tensor:
    """Same contract as kernels.fused.naive.expert_gate_up_glu: z [T, l] (row-strided allowed), w13 [E, 2F, l]
    -> act [E, T, F] in z's dtype, the GLU computed from float32 accumulators."""
    require_activation(activation)
    require(z.dim() == 2 and w13.dim() == 3 and w13.shape[2] == z.shape[1] and w13.shape[1] % 2 == 0,
            f"z must be [T, l] and w13 [E, 2F, l], got {tuple(z.shape)} and {tuple(w13.shape)}")
    require(z.dtype == w13.dtype, f"z and w13 must share a dtype, got {z.dtype} and {w13.dtype}")
    return _launch(z, 0, w13, w13.shape[1] // 2, True, activation, beta1, beta2, block_n, block_k, num_warps,
                   num_stages)


def expert_down(act: torch.Tensor, w2: torch.Tensor, block_n: int = 64, block_k: int = 64, num_warps: int = 4,
                num_stages: int = 4) -> torch.Tensor:
    """Same contract as kernels.fused.naive.expert_down: act [E, T, F], w2 [E, l, F] -> [E, T, l]."""
    require(act.dim() == 3 and w2.dim() == 3 and act.shape[0] == w2.shape[0] and act.shape[2] == w2.shape[2],
            f"act must be [E, T, F] and w2 [E, l, F], got {tuple(act.shape)} and {tuple(w2.shape)}")
    require(act.dtype == w2.dtype, f"act and w2 must share a dtype, got {act.dtype} and {w2.dtype}")
    return _launch(act, act.stride(0), w2, w2.shape[1], False, "situ", 1.0, 1.0, block_n, block_k, num_warps,
                   num_stages)
