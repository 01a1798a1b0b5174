"""The grouped-GEMM bookkeeping of the routed pairs in one launch (replaces ~10 torch launches per MoE layer:
arange, the key arithmetic, sort, the count's zero fill and scatter-add, cumsum, the token division, the
inverse permutation's scatter).

One program, two passes over the T*k pairs in CHUNK slices, O(pairs x experts) work with no sort: pass 1
counts the pairs per expert (their exclusive prefix sum is where each expert's rows start; the inclusive
one is the grouped GEMM's `offs`); pass 2 gives each pair its row, its expert's start plus the pairs of
the same expert before it (a cumulative sum of the one-hot [CHUNK, E] matrix down the pairs, plus the
counts of earlier slices), and writes the pair's token into that row. Ties go by pair id, so the order
equals the reference's sort of unique keys (expert * n + pair).
"""

from __future__ import annotations

import torch

from kernels._triton import next_pow2, require, tl, triton

if triton is not None:

    @triton.jit
    def _align_kernel(indices, sorted_token, offsets, position, N, E, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
                      CHUNK: tl.constexpr):
        experts = tl.arange(0, BLOCK_E)
        counts = tl.zeros([BLOCK_E], dtype=tl.int32)
        for start in range(0, N, CHUNK):
            pairs = start + tl.arange(0, CHUNK)
            expert = tl.load(indices + pairs, mask=pairs < N, other=-1)
            counts += tl.sum((expert[:, None] == experts[None, :]).to(tl.int32), axis=0)
        ends = tl.cumsum(counts, axis=0)
        tl.store(offsets + experts, ends, mask=experts < E)
        seen = ends - counts  # rows before each expert's first, then before its next pair
        for start in range(0, N, CHUNK):
            pairs = start + tl.arange(0, CHUNK)
            ok = pairs < N
            expert = tl.load(indices + pairs, mask=ok, other=-1)
            onehot = (expert[:, None] == experts[None, :]).to(tl.int32)  # [CHUNK, BLOCK_E]
            row = tl.sum((tl.cumsum(onehot, axis=0) - 1 + seen[None, :]) * onehot, axis=1)
            seen += tl.sum(onehot, axis=0)
            tl.store(position + pairs, row.to(tl.int64), mask=ok)
            tl.store(sorted_token + row, (pairs // TOP_K).to(tl.int64), mask=ok)


def moe_align(indices: torch.Tensor, experts: int, chunk: int = 256, num_warps: int = 4
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as kernels.fused.naive.moe_align (indices [T, k] of ids in [0, experts))."""
    require(indices.dim() == 2, f"indices must be [T, k], got {tuple(indices.shape)}")
    flat = indices.contiguous().view(-1)
    n = flat.numel()
    sorted_token = torch.empty(n, dtype=torch.int64, device=indices.device)
    offsets = torch.empty(experts, dtype=torch.int32, device=indices.device)
    position = torch.empty(n, dtype=torch.int64, device=indices.device)
    _align_kernel[(1,)](flat, sorted_token, offsets, position, n, experts, TOP_K=indices.shape[1],
                        BLOCK_E=next_pow2(experts), CHUNK=min(chunk, next_pow2(max(n, 1))), num_warps=num_warps)
    return sorted_token, offsets, position.view(indices.shape)
