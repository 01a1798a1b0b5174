"""An L2 prefetch of a tensor's bytes on sm_90 (`cp.async.bulk.prefetch.L2`): no output, no value changes.

Why: at batch 64 a decode step's output GEMMs read 8-10 MB of weight each at about a third of copy speed
(cuBLAS, docs/serving.md items 9-10): too few bytes in flight per SM for the HBM latency. The decode fast path
issues this on a side branch of its captured graph (services/engine/weight_prefetch.py) while latency-bound
kernels hold the main chain and HBM is mostly idle, so the weight's lines are in L2 when its GEMM starts.
Each lane of a one-warp program issues one bulk prefetch of CHUNK bytes (the copy engine walks the range;
the program retires at once): few programs, little issue work. A hint only: a tensor the instruction cannot
take (not contiguous, not 16-byte aligned) is skipped. On the CPU and in the interpreter nothing runs
(`naive.l2_prefetch`): inline PTX has no interpreter form, and no value depends on it.
"""

from __future__ import annotations

import torch

from kernels._triton import tl, triton

CHUNK = 16384  # bytes per lane: 32 lanes = 512 KiB a program, ~20 programs for a 10 MB weight
LANES = 32  # one warp, one element (one bulk prefetch) per thread


def plan(t: torch.Tensor) -> tuple[int, int] | None:
    """(bytes, programs) a prefetch of `t` covers and launches, or None where the instruction cannot take it
    (the address and size must be 16-byte multiples; a non-contiguous tensor has no single byte range)."""
    nbytes = t.numel() * t.element_size()
    if not nbytes or not t.is_contiguous() or t.data_ptr() % 16 or nbytes % 16:
        return None
    return nbytes, triton.cdiv(nbytes, CHUNK * LANES)


def l2_prefetch(t: torch.Tensor) -> None:
    """Queue an L2 prefetch of `t`'s bytes on the current stream (CUDA, sm_90); nothing if `plan` refuses."""
    planned = plan(t)
    if planned is None:
        return
    nbytes, programs = planned
    _prefetch[(programs,)](t, nbytes, CHUNK=CHUNK, LANES=LANES, num_warps=1)


if triton is not None:
    @triton.jit
    def _prefetch(src, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr):
        start = (tl.program_id(0) * LANES + tl.arange(0, LANES)).to(tl.int64) * CHUNK
        size = tl.minimum(nbytes - start, CHUNK).to(tl.int32)  # <= 0: past the end, the lane issues nothing
        at = src.to(tl.pointer_type(tl.int8)) + start
        # a dummy output: inline PTX needs one; is_pure=False keeps the instruction
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [at, size], dtype=tl.int32, is_pure=False, pack=1)
