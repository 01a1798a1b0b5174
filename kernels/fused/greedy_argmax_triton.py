"""The greedy draw's argmax over the logits rows, as two Triton passes on CUDA.

It sits on the decode step's critical path (the forward ends, the argmax runs, the tokens go to the host,
the next step launches): torch's `argmax(-1)` of 64 bf16 rows of a 163,840-token vocabulary took 22 us on
the H200, ~4x its bandwidth bound, since it reduces a row in few blocks. Here each row is cut into chunks
of `CHUNK` columns, one program per (row, chunk) finds the chunk's maximum and its first index, and one
program per row combines its chunks. Same answer as `torch.argmax`: float32 comparisons of the (exactly
widened) values, the lowest index among equal maxima, and a NaN beats every number (the first NaN wins).
With K3_GREEDY_ARGMAX=torch it is `torch.argmax` (the reference, naive.py) on CUDA too; the CPU path is
the reference (`kernels.dispatch.greedy_argmax`).
"""

from __future__ import annotations

import os

import torch

from kernels._triton import next_pow2, tl, triton
from kernels.fused import naive

ENV = "K3_GREEDY_ARGMAX"  # "torch": torch.argmax on CUDA too
CHUNK = 8192  # columns per program: 16 KB of bf16 (a fixed size: one compiled kernel per vocabulary)
BLOCK = 2048  # columns per load
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def greedy_argmax(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """logits [R, V] -> int64 [R]: `logits.argmax(-1)`, through `argmax_triton` (the reference for a layout or
    dtype it does not take, or under K3_GREEDY_ARGMAX=torch); written into `out` (int64 [R], contiguous) if
    given."""
    if (os.environ.get(ENV, "") != "torch" and logits.dim() == 2 and logits.dtype in _DTYPES
            and logits.stride(-1) == 1 and logits.shape[0] > 0):
        return argmax_triton(logits, out=out)
    return naive.greedy_argmax(logits, out=out)


def argmax_triton(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """logits [R, V] (unit column stride) -> int64 [R] (into `out` if given), in two launches (any device
    Triton runs on)."""
    rows, cols = logits.shape
    parts = triton.cdiv(cols, CHUNK)
    values = torch.empty(rows, parts, dtype=torch.float32, device=logits.device)
    indices = torch.empty(rows, parts, dtype=torch.int32, device=logits.device)
    _chunk_argmax[(rows, parts)](logits, logits.stride(0), cols, values, indices, parts,
                                 CHUNK=CHUNK, BLOCK=BLOCK, num_warps=4)
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    elif out.shape != (rows,) or out.dtype != torch.int64 or not out.is_contiguous():
        raise ValueError(f"out: expected a contiguous int64 tensor of shape ({rows},), "
                         f"got {out.dtype} {tuple(out.shape)}")
    _combine[(rows,)](values, indices, out, parts, PARTS=next_pow2(parts), num_warps=1)
    return out


if triton is not None:
    @triton.jit
    def _chunk_argmax(x_ptr, row_stride, cols, values_ptr, indices_ptr, parts,
                      CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        row, part = tl.program_id(0), tl.program_id(1)
        none = 2147483647  # no index yet
        lanes = tl.arange(0, BLOCK)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_at = tl.full([BLOCK], none, tl.int32)
        first_nan = tl.full([BLOCK], none, tl.int32)
        base = x_ptr + row.to(tl.int64) * row_stride
        for start in tl.static_range(0, CHUNK, BLOCK):
            at = part * CHUNK + start + lanes
            inside = at < cols
            x = tl.load(base + at, mask=inside, other=float("-inf")).to(tl.float32)
            first_nan = tl.minimum(first_nan, tl.where(x != x, at, none))
            # strictly greater keeps a lane's first maximum; a lane's first column in range starts it (-inf too)
            better = (x > best) | ((best_at == none) & inside)
            best = tl.where(better, x, best)
            best_at = tl.where(better, at, best_at)
        top = tl.max(best, axis=0)
        at = tl.min(tl.where(best == top, best_at, none), axis=0)  # the lowest lane-first index of the maximum
        nan_at = tl.min(first_nan, axis=0)
        has_nan = nan_at != none
        tl.store(values_ptr + row * parts + part, tl.where(has_nan, float("nan"), top))
        tl.store(indices_ptr + row * parts + part, tl.where(has_nan, nan_at, at))

    @triton.jit
    def _combine(values_ptr, indices_ptr, out_ptr, parts, PARTS: tl.constexpr):
        row = tl.program_id(0)
        none = 2147483647
        k = tl.arange(0, PARTS)
        inside = k < parts
        v = tl.load(values_ptr + row * parts + k, mask=inside, other=float("-inf"))
        at = tl.load(indices_ptr + row * parts + k, mask=inside, other=none)
        nan_at = tl.min(tl.where(v != v, at, none), axis=0)  # chunks are in column order: the first NaN
        top = tl.max(tl.where(inside, v, float("-inf")), axis=0)
        best = tl.min(tl.where((v == top) & inside, at, none), axis=0)
        tl.store(out_ptr + row, tl.where(nan_at != none, nan_at, best).to(tl.int64))
