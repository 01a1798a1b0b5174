"""RMSNorm of row-strided rows in one launch: the decode path normalises column slices of a fused
projection's output (MLA's q_a part), which torch's rms_norm first copies into a contiguous tensor (a second
launch: ~2.3 us a layer at batch 64 on the H200, docs/serving.md item 23). Program = one row, read in place,
normalised in float32 with the weight applied before the one rounding (k3core.ops.norm.rms_norm's order)."""

from __future__ import annotations

import torch

from kernels._triton import next_pow2, require, tl, triton

if triton is not None:

    @triton.jit
    def rms_normalized(x, D, eps):
        """x * rsqrt(mean(x^2) + eps) of one float32 row [BLOCK] of D values (padding lanes zero): the row
        RMSNorm of this kernel, attnres/merge_norm and the KDA output norms. The caller multiplies by the weight
        after it (the same rounding order everywhere) and so also chooses when the weight is loaded: the tuned
        kernels load it late on purpose (merge_norm's comment), and inlining keeps each caller's order."""
        return x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)

    @triton.jit
    def _rms_rows_kernel(x, weight, out, D, stride_x, stride_out, eps, BLOCK_D: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_D)
        ok = cols < D
        v = tl.load(x + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        y = rms_normalized(v, D, eps) * tl.load(weight + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out + row * stride_out + cols, y.to(out.dtype.element_ty), mask=ok)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, num_warps: int = 4) -> torch.Tensor:
    """Same contract as kernels.fused.naive.rms_norm_rows (x [M, D] with any row stride, unit column stride)."""
    require(x.dim() == 2 and x.stride(1) == 1, f"x must be [M, D] with unit column stride, got {tuple(x.shape)} "
            f"strides {x.stride()}")
    require(weight.shape == (x.shape[1],), f"weight must be [{x.shape[1]}], got {tuple(weight.shape)}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        _rms_rows_kernel[(x.shape[0],)](x, weight, out, x.shape[1], x.stride(0), out.stride(0), float(eps),
                                        BLOCK_D=next_pow2(x.shape[1]), num_warps=num_warps)
    return out
