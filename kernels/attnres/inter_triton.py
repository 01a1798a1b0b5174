"""Block AttnRes phase 1: every site of a block against the completed blocks, in one batched pass (§5.4.2).

For each token row, the N completed block sums are read once and scored by all Q pseudo-queries of the
block's sites: logits = q_eff . RMSNorm(block) (q_eff = query * key-norm weight), then per site the online-
softmax statistics (max, denominator, accumulator) that phase 2 (`merge_norm_triton`) folds the intra-block
partial sum into. One program per `block_rows` rows (the queries are read once for all of them): pass 1
streams the rows' block vectors in column chunks for the dot products and the sums of squares, pass 2
re-reads them (from cache) and writes the Q accumulators of each row. Both passes are products on the
tensor cores in 3xTF32 (float32-accurate): [Q, chunk] x [chunk, rows * N], then per row [Q, N] x [N, chunk].
"""

from __future__ import annotations

import torch

from k3core.ops.attnres import OnlineSoftmax
from kernels._triton import next_pow2, require, tl, triton

if triton is not None:

    @triton.jit
    def _inter_kernel(queries, norm_w, blocks, acc_out, max_out, denom_out, N, Q, M, D, eps,
                      HAS_NORM_W: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BQ: tl.constexpr,
                      BD: tl.constexpr):
        m0 = tl.program_id(0).to(tl.int64) * BM
        qs = tl.arange(0, BQ)
        # (row, block) pairs flattened as j = r * BN + n, so one product scores all BM rows at once.
        j = tl.arange(0, BM * BN)
        r, n = j // BN, j % BN
        j_ok = (n < N) & (m0 + r < M)
        q_ok = qs < Q
        dots = tl.zeros([BQ, BM * BN], dtype=tl.float32)
        squares = tl.zeros([BM * BN], dtype=tl.float32)
        for d0 in range(0, D, BD):
            d = d0 + tl.arange(0, BD)
            d_ok = d < D
            blk = tl.load(blocks + (n[:, None] * M + m0 + r[:, None]) * D + d[None, :],
                          mask=j_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            q = tl.load(queries + qs[:, None] * D + d[None, :], mask=q_ok[:, None] & d_ok[None, :],
                        other=0.0).to(tl.float32)
            if HAS_NORM_W:
                q = q * tl.load(norm_w + qs[:, None] * D + d[None, :], mask=q_ok[:, None] & d_ok[None, :],
                                other=0.0).to(tl.float32)
            squares += tl.sum(blk * blk, 1)
            dots = tl.dot(q, tl.trans(blk), dots, input_precision="tf32x3")
        logits = dots * tl.rsqrt(squares / D + eps)[None, :]
        logits = tl.reshape(tl.where((n < N)[None, :], logits, float("-inf")), (BQ, BM, BN))
        top = tl.max(logits, 2)  # [BQ, BM]
        weights = tl.exp(logits - top[:, :, None])
        rows = m0 + tl.arange(0, BM)
        out_ok = q_ok[:, None] & (rows < M)[None, :]
        tl.store(max_out + qs[:, None] * M + rows[None, :], top, mask=out_ok)
        tl.store(denom_out + qs[:, None] * M + rows[None, :], tl.sum(weights, 2), mask=out_ok)
        weights = tl.permute(weights, (1, 0, 2))  # [BM, BQ, BN]
        r3, n3 = tl.arange(0, BM)[:, None, None], tl.arange(0, BN)[None, :, None]
        q3 = qs[None, :, None]
        for d0 in range(0, D, BD):
            d3 = d0 + tl.arange(0, BD)[None, None, :]
            blk = tl.load(blocks + (n3 * M + m0 + r3) * D + d3, mask=(n3 < N) & (m0 + r3 < M) & (d3 < D),
                          other=0.0).to(tl.float32)
            acc = tl.dot(weights, blk, input_precision="tf32x3")  # [BM, BQ, BD]
            tl.store(acc_out + (q3 * M + m0 + r3) * D + d3, acc, mask=(q3 < Q) & (m0 + r3 < M) & (d3 < D))


def attnres_inter(queries: torch.Tensor, blocks: torch.Tensor, norm_weights: torch.Tensor | None = None,
                  eps: float = 1e-6, block_d: int = 64, block_rows: int = 4, num_warps: int = 4) -> OnlineSoftmax:
    """queries [Q, D] of all sites of a block, blocks [N, ..., D] -> float32 statistics [Q, ...] (max,
    denominator) and [Q, ..., D] (accumulator), as k3core.ops.attnres.attnres_inter."""
    N, D = blocks.shape[0], blocks.shape[-1]
    Q = queries.shape[0]
    require(queries.dim() == 2 and queries.shape[1] == D, f"queries must be [Q, {D}], got {tuple(queries.shape)}")
    require(norm_weights is None or norm_weights.shape == queries.shape,
            f"norm_weights must be [{Q}, {D}] like queries")
    require(blocks.dtype != torch.float64 and queries.dtype != torch.float64, "float64 takes the reference")
    require(N >= 1, "blocks must hold at least one completed block")
    require(block_rows == next_pow2(block_rows), f"block_rows must be a power of two, got {block_rows}")
    rows = blocks.shape[1:-1]
    M = blocks[0, ..., 0].numel()
    flat = blocks.reshape(N, M, D).contiguous()
    acc = torch.empty(Q, M, D, dtype=torch.float32, device=blocks.device)
    top = torch.empty(Q, M, dtype=torch.float32, device=blocks.device)
    denom = torch.empty_like(top)
    q = queries.contiguous()
    _inter_kernel[(triton.cdiv(M, block_rows),)](
        q, norm_weights.contiguous() if norm_weights is not None else q, flat, acc, top, denom, N, Q, M, D, eps,
        HAS_NORM_W=norm_weights is not None, BM=block_rows, BN=max(16, next_pow2(N)), BQ=max(16, next_pow2(Q)),
        BD=min(block_d, next_pow2(D)), num_warps=num_warps,
    )
    return OnlineSoftmax(top.reshape(Q, *rows), denom.reshape(Q, *rows), acc.reshape(Q, *rows, D))
