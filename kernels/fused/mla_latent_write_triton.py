"""Gated MLA's new latent row of one decode step, normalised and written into the pool in one launch
(replaces the RMSNorm of the latent part, the concat with the rope part, the dtype cast and the
index_copy into the pool rows).

Program = one sequence: the R-wide latent part of its compressed-KV row (a row-strided slice of the fused
projection GEMM's output, read in place) is RMS-normalised in float32, rounded to the input dtype as the
reference norm returns it, and stored with the P-wide rope part into pool row write_rows[b] + row_offset (the
decode path passes its layer group's row base and the layer's slot: no add launch per MLA layer).
"""

from __future__ import annotations

import torch

from kernels._triton import next_pow2, require, tl, triton

if triton is not None:

    @triton.jit
    def _latent_write_kernel(kv, norm_w, rows, write_rows, row_offset, R, P, stride_kv, stride_rows, eps,
                             BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_R)
        ok = cols < R
        x = tl.load(kv + b * stride_kv + cols, mask=ok, other=0.0).to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / R + eps)
        y = (x * inv * tl.load(norm_w + cols, mask=ok, other=0.0).to(tl.float32)).to(kv.dtype.element_ty)
        row = tl.load(write_rows + b).to(tl.int64) + row_offset
        tl.store(rows + row * stride_rows + cols, y.to(rows.dtype.element_ty), mask=ok)
        rope = tl.arange(0, BLOCK_P)
        rope_ok = rope < P
        r = tl.load(kv + b * stride_kv + R + rope, mask=rope_ok, other=0.0)
        tl.store(rows + row * stride_rows + R + rope, r.to(rows.dtype.element_ty), mask=rope_ok)


def mla_latent_write(kv: torch.Tensor, norm_weight: torch.Tensor, eps: float, rows: torch.Tensor,
                     write_rows: torch.Tensor, row_offset: int = 0, num_warps: int = 4) -> None:
    """Same contract as kernels.fused.naive.mla_latent_write (kv and rows row-strided with unit column stride)."""
    rank = norm_weight.shape[0]
    require(kv.dim() == 2 and kv.stride(1) == 1 and kv.shape[1] > rank,
            f"kv must be [B, R+P] with unit column stride and R={rank}, got {tuple(kv.shape)}")
    require(rows.dim() == 2 and rows.stride(1) == 1 and rows.shape[1] == kv.shape[1],
            f"rows must be [N, {kv.shape[1]}] with unit column stride, got {tuple(rows.shape)}")
    require(write_rows.shape == (kv.shape[0],), f"write_rows must be [{kv.shape[0]}], got {tuple(write_rows.shape)}")
    if kv.shape[0] == 0:
        return
    rope = kv.shape[1] - rank
    _latent_write_kernel[(kv.shape[0],)](kv, norm_weight, rows, write_rows, row_offset, rank, rope, kv.stride(0),
                                         rows.stride(0), float(eps), BLOCK_R=next_pow2(rank),
                                         BLOCK_P=next_pow2(rope), num_warps=num_warps)
