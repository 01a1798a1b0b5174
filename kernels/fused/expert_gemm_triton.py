"""Every expert's GEMM of one decode step in one launch (the dense MoE form: at batch 16-128 every expert is
read anyway): the gate|up GEMM with the GLU in its epilogue, and the down projection.

gate|up: z [T, l] against each expert's stacked [gate; up] rows of w13 [E, 2F, l], the GLU (SiTU or SwiGLU)
applied to the float32 accumulators -> act [E, T, F] (the operand layout of the down projection). Replaces
cuBLAS's GEMM over the [E*2F, l] view, the [T, E*2F] bf16 round trip through memory and the activation's
launch: 30.5 us instead of 36.1 us a layer on the H200 at batch 64 (bench.serve_glue), the weights streaming
at 3.3 TB/s. down: act [E, T, F] against w2 [E, l, F] -> [E, T, l] (what torch.bmm computes; the pointer form
only tied cuBLAS's batched GEMM, 16.6 vs 16.9 us).
Program = (one token tile of up to 64, BLOCK_N output columns of one expert): the gate rows n and the up rows
F + n are multiplied in the same K loop, so the GLU pairs them in registers. Token tiles are the fastest
grid axis: above 64 tokens the tiles that share a weight block run side by side and the second read hits
L2. No split along K: one expert alone gives F / BLOCK_N programs, hundreds in all.
Two load forms, same programs: pointer tiles (cp.async, every thread computes addresses and masks), or TMA
through host-built tensor descriptors (`tma=True`: one copy instruction a tile, out-of-range rows and K
columns zero-filled by the copy engine, so no masks in the loop). On the H200 TMA measured 29.9 vs 30.2 us
for the gate|up and 16.3 vs 17.1 us (cuBLAS) for the down projection at 64 rows (docs/serving.md item 11).
Triton's warp-specialised K loop on the TMA form was wrong on the H200 with 64-row token tiles and is gone
(docs/serving.md item 12).
"""

from __future__ import annotations

import torch

from kernels._triton import next_pow2, require, tl, triton
from kernels.fused.naive import require_activation

ACTIVATIONS = {"none": 0, "situ": 1, "swiglu": 2}

if triton is not None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    from kernels.moe.situ_glu_triton import glu_values

    @triton.jit
    def _epilogue(acc, up, out, expert, tokens, cols, T, N, stride_oe, stride_ot, beta1, beta2, ACT: tl.constexpr):
        """The GLU of the float32 accumulators (ACT 1 SiTU, 2 SwiGLU; 0: acc as is), stored as [E, T, N]."""
        if ACT != 0:
            acc = glu_values(acc, up, beta1, beta2, ACT == 1)
        target = out + expert * stride_oe + tokens.to(tl.int64)[:, None] * stride_ot + cols[None, :]
        tl.store(target, acc.to(out.dtype.element_ty), mask=(tokens < T)[:, None] & (cols < N)[None, :])

    @triton.jit
    def _expert_gemm_kernel(x, w, out, T, N, K, stride_xe, stride_xt, stride_we, stride_wn, stride_oe, stride_ot,
                            beta1, beta2, ACT: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_T: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Pointer loads. x [E or shared, T, K] (stride_xe 0: one z for every expert); with a GLU (ACT > 0) the
        up rows sit N rows after the gate rows of the same expert."""
        tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        expert = tl.program_id(2).to(tl.int64)
        ks = tl.arange(0, BLOCK_K)
        token_ok, col_ok = tokens < T, cols < N
        x_at = x + expert * stride_xe + tokens.to(tl.int64)[:, None] * stride_xt + ks[None, :]
        w_at = w + expert * stride_we + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :]
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        up = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x_ok, w_ok = token_ok[:, None], col_ok[:, None]
            if not EVEN_K:
                x_ok = x_ok & (k0 + ks < K)[None, :]
                w_ok = w_ok & (k0 + ks < K)[None, :]
            xt = tl.load(x_at, mask=x_ok, other=0.0)
            acc = tl.dot(xt, tl.trans(tl.load(w_at, mask=w_ok, other=0.0)), acc, input_precision="ieee")
            if ACT != 0:
                up = tl.dot(xt, tl.trans(tl.load(w_at + N * stride_wn, mask=w_ok, other=0.0)), up,
                            input_precision="ieee")
            x_at += BLOCK_K
            w_at += BLOCK_K
        _epilogue(acc, up, out, expert, tokens, cols, T, N, stride_oe, stride_ot, beta1, beta2, ACT)

    @triton.jit
    def _expert_gemm_tma_kernel(x_desc, w_desc, out, T, N, K, x_rows_per_expert, w_rows_per_expert, stride_oe,
                                stride_ot, beta1, beta2, ACT: tl.constexpr, BLOCK_T: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """TMA loads of 2-D views: x [E*x_rows_per_expert or T, K], w [E*w_rows_per_expert, K]. Rows past a
        tile's expert belong to the next one (or lie out of range: zeros); only the store is masked."""
        t0 = tl.program_id(0) * BLOCK_T
        n0 = tl.program_id(1) * BLOCK_N
        expert = tl.program_id(2)
        x_row = expert * x_rows_per_expert + t0
        w_row = expert * w_rows_per_expert + n0
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        up = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            xt = x_desc.load([x_row, k0])
            acc = tl.dot(xt, tl.trans(w_desc.load([w_row, k0])), acc, input_precision="ieee")
            if ACT != 0:
                up = tl.dot(xt, tl.trans(w_desc.load([w_row + N, k0])), up, input_precision="ieee")
        tokens = t0 + tl.arange(0, BLOCK_T)
        cols = n0 + tl.arange(0, BLOCK_N)
        _epilogue(acc, up, out, expert.to(tl.int64), tokens, cols, T, N, stride_oe, stride_ot, beta1, beta2, ACT)


def _tma_ready(*views: torch.Tensor) -> bool:
    """TMA's rules for a 2-D view: unit inner stride, 16-byte row stride and base address."""
    return all(v.stride(1) == 1 and (v.stride(0) * v.element_size()) % 16 == 0 and v.data_ptr() % 16 == 0
               for v in views)


def _launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, shared_x: bool, act: int, width: int,
            beta1: float, beta2: float, block_n: int, block_k: int, num_warps: int, num_stages: int,
            tma: bool) -> torch.Tensor:
    """x [E, T, K] (or [T, K] shared by every expert), w [E, rows, K] -> out [E, T, width]."""
    experts, tokens, depth = out.shape[0], out.shape[1], x.shape[-1]
    if tokens == 0:
        return out
    block_t = min(64, max(16, next_pow2(tokens)))
    block_k = min(block_k, max(16, next_pow2(depth)))
    grid = (triton.cdiv(tokens, block_t), triton.cdiv(width, block_n), experts)
    common = dict(ACT=act, BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
                  num_stages=num_stages)
    if tma:  # 2-D views: x [T or E*T, K], w [E*rows, K]
        require(w.is_contiguous() and (shared_x or x.is_contiguous()), "tma=True needs contiguous experts' operands")
        x2 = x if shared_x else x.view(experts * tokens, depth)
        w2 = w.view(experts * w.shape[1], depth)
        require(_tma_ready(x2, w2), "tma=True needs 16-byte aligned rows of x and w")
        _expert_gemm_tma_kernel[grid](
            TensorDescriptor.from_tensor(x2, [block_t, block_k]), TensorDescriptor.from_tensor(w2, [block_n, block_k]),
            out, tokens, width, depth, 0 if shared_x else tokens, w.shape[1], out.stride(0), out.stride(1),
            float(beta1), float(beta2), **common)
        return out
    _expert_gemm_kernel[grid](
        x, w, out, tokens, width, depth, 0 if shared_x else x.stride(0), x.stride(-2), w.stride(0), w.stride(1),
        out.stride(0), out.stride(1), float(beta1), float(beta2), EVEN_K=depth % block_k == 0, **common)
    return out


def expert_gate_up_glu(z: torch.Tensor, w13: torch.Tensor, activation: str = "situ", beta1: float = 4.0,
                       beta2: float = 25.0, block_n: int = 64, block_k: int = 64, num_warps: int = 4,
                       num_stages: int = 3, tma: bool = False) -> torch.Tensor:
    """Same contract as kernels.fused.naive.expert_gate_up_glu: z [T, l] (row-strided allowed), w13 [E, 2F, l]
    -> act [E, T, F] in z's dtype, the GLU computed from float32 accumulators."""
    require_activation(activation)
    require(z.dim() == 2 and w13.dim() == 3 and w13.shape[2] == z.shape[1] and w13.shape[1] % 2 == 0,
            f"z must be [T, l] and w13 [E, 2F, l], got {tuple(z.shape)} and {tuple(w13.shape)}")
    require(z.dtype == w13.dtype, f"z and w13 must share a dtype, got {z.dtype} and {w13.dtype}")
    require(z.stride(1) == 1 and w13.stride(2) == 1, "z and w13 need a unit stride along l")
    width = w13.shape[1] // 2
    out = torch.empty(w13.shape[0], z.shape[0], width, dtype=z.dtype, device=z.device)
    return _launch(z, w13, out, True, ACTIVATIONS[activation], width, beta1, beta2, block_n, block_k, num_warps,
                   num_stages, tma)


def expert_down(act: torch.Tensor, w2: torch.Tensor, block_n: int = 64, block_k: int = 64, num_warps: int = 4,
                num_stages: int = 3, tma: bool = False) -> torch.Tensor:
    """Same contract as kernels.fused.naive.expert_down: act [E, T, F] @ w2 [E, l, F]^T -> [E, T, l] in act's
    dtype (float32 accumulators)."""
    require(act.dim() == 3 and w2.dim() == 3 and act.shape[0] == w2.shape[0] and act.shape[2] == w2.shape[2],
            f"act must be [E, T, F] and w2 [E, l, F], got {tuple(act.shape)} and {tuple(w2.shape)}")
    require(act.dtype == w2.dtype, f"act and w2 must share a dtype, got {act.dtype} and {w2.dtype}")
    require(act.stride(2) == 1 and w2.stride(2) == 1, "act and w2 need a unit stride along F")
    experts, tokens, _ = act.shape
    out = torch.empty(experts, tokens, w2.shape[1], dtype=act.dtype, device=act.device)
    return _launch(act, w2, out, False, 0, w2.shape[1], 1.0, 1.0, block_n, block_k, num_warps, num_stages, tma)
