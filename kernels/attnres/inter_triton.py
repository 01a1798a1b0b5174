"""Block AttnRes phase 1: every site of a block against the completed blocks, in one batched pass (§5.4.2).

For each token row, the N completed block sums are scored by all Q pseudo-queries of the block's sites:
logits = q_eff . RMSNorm(block) (q_eff = query * key-norm weight); per site the online-softmax statistics
(max, denominator, accumulator) follow, which phase 2 (`merge_norm_triton`) folds the intra-block partial
sum into. The accumulators (Q float32 rows per token) are most of the bytes, so the work is split in two
kernels that each stream well:
- scores: a skinny GEMM [Q, D] x [D, rows * N] per program of `score_rows` rows (the queries are read
  once for all of them) and the blocks' sums of squares; at decode the D axis is also cut into chunks
  whose partial sums the next kernel adds, so that a few rows still occupy every SM;
- apply: one program per (row, D chunk) turns the scores into softmax weights and writes the row's Q
  accumulators for its chunk, [Q, N] x [N, chunk], re-reading the block vectors but never the queries.
All products run on the tensor cores in 3xTF32 (float32-accurate).
"""

from __future__ import annotations

import torch

from k3core.ops.attnres import OnlineSoftmax
from kernels._triton import next_pow2, require, tl, triton

if triton is not None:

    @triton.jit
    def _scores_kernel(queries, norm_w, blocks, scores, squares, N, Q, M, D, CHUNK,
                       HAS_NORM_W: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BQ: tl.constexpr,
                       BD: tl.constexpr):
        """scores[c, m, q, n] = q_eff[q] . blocks[n, m] and squares[c, m, n] over D chunk c."""
        m0 = tl.program_id(0).to(tl.int64) * BM
        c = tl.program_id(1).to(tl.int64)
        qs = tl.arange(0, BQ)
        j = tl.arange(0, BM * BN)  # (row, block) pairs flattened as j = r * BN + n
        r, n = j // BN, j % BN
        j_ok = (n < N) & (m0 + r < M)
        q_ok = qs < Q
        dots = tl.zeros([BQ, BM * BN], dtype=tl.float32)
        sq = tl.zeros([BM * BN], dtype=tl.float32)
        for d0 in range(c * CHUNK, tl.minimum(c * CHUNK + CHUNK, D), BD):
            d = d0 + tl.arange(0, BD)
            d_ok = d < D
            blk = tl.load(blocks + (n[:, None] * M + m0 + r[:, None]) * D + d[None, :],
                          mask=j_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            q = tl.load(queries + qs[:, None] * D + d[None, :], mask=q_ok[:, None] & d_ok[None, :],
                        other=0.0).to(tl.float32)
            if HAS_NORM_W:
                q = q * tl.load(norm_w + qs[:, None] * D + d[None, :], mask=q_ok[:, None] & d_ok[None, :],
                                other=0.0).to(tl.float32)
            sq += tl.sum(blk * blk, 1)
            dots = tl.dot(q, tl.trans(blk), dots, input_precision="tf32x3")
        base = c * M + m0 + r  # [BM * BN]: the (chunk, row) of each column
        tl.store(scores + (base[None, :] * BQ + qs[:, None]) * BN + n[None, :], dots, mask=(m0 + r < M)[None, :])
        tl.store(squares + base * BN + n, sq, mask=m0 + r < M)

    @triton.jit
    def _apply_kernel(blocks, scores, squares, acc_out, max_out, denom_out, N, Q, M, D, CHUNK, eps,
                      CHUNKS: tl.constexpr, BN: tl.constexpr, BQ: tl.constexpr, BD: tl.constexpr):
        m = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        qs, nb = tl.arange(0, BQ), tl.arange(0, BN)
        dots = tl.zeros([BQ, BN], dtype=tl.float32)
        sq = tl.zeros([BN], dtype=tl.float32)
        for part in tl.static_range(CHUNKS):
            dots += tl.load(scores + ((part * M + m) * BQ + qs[:, None]) * BN + nb[None, :])
            sq += tl.load(squares + (part * M + m) * BN + nb)
        logits = tl.where((nb < N)[None, :], dots * tl.rsqrt(sq / D + eps)[None, :], float("-inf"))
        top = tl.max(logits, 1)
        weights = tl.exp(logits - top[:, None])
        q_ok = qs < Q
        if c == 0:
            tl.store(max_out + qs * M + m, top, mask=q_ok)
            tl.store(denom_out + qs * M + m, tl.sum(weights, 1), mask=q_ok)
        for d0 in range(c * CHUNK, tl.minimum(c * CHUNK + CHUNK, D), BD):
            d = d0 + tl.arange(0, BD)
            d_ok = d < D
            blk = tl.load(blocks + (nb[:, None] * M + m) * D + d[None, :], mask=(nb < N)[:, None] & d_ok[None, :],
                          other=0.0).to(tl.float32)
            acc = tl.dot(weights, blk, input_precision="tf32x3")
            tl.store(acc_out + (qs[:, None] * M + m) * D + d[None, :], acc, mask=q_ok[:, None] & d_ok[None, :])


def _chunks(programs: int, D: int, block_d: int, sms: int = 132) -> int:
    """D chunks that give about two programs per SM (1 when the rows alone do), each >= 4 column blocks."""
    wanted = max(1, -(-2 * sms // programs))
    return max(1, min(wanted, D // (4 * block_d)))


def attnres_inter(queries: torch.Tensor, blocks: torch.Tensor, norm_weights: torch.Tensor | None = None,
                  eps: float = 1e-6, block_d: int = 64, score_rows: int = 8, num_warps: int = 4,
                  chunks: tuple[int, int] | None = None) -> OnlineSoftmax:
    """queries [Q, D] of all sites of a block, blocks [N, ..., D] -> float32 statistics [Q, ...] (max,
    denominator) and [Q, ..., D] (accumulator), as k3core.ops.attnres.attnres_inter. `chunks`: the D
    chunks of the scores and of the apply kernel (None: enough for about two programs per SM)."""
    N, D = blocks.shape[0], blocks.shape[-1]
    Q = queries.shape[0]
    require(queries.dim() == 2 and queries.shape[1] == D, f"queries must be [Q, {D}], got {tuple(queries.shape)}")
    require(norm_weights is None or norm_weights.shape == queries.shape,
            f"norm_weights must be [{Q}, {D}] like queries")
    require(blocks.dtype != torch.float64 and queries.dtype != torch.float64, "float64 takes the reference")
    require(N >= 1, "blocks must hold at least one completed block")
    require(score_rows == next_pow2(score_rows), f"score_rows must be a power of two, got {score_rows}")
    rows = blocks.shape[1:-1]
    M = blocks[0, ..., 0].numel()
    flat = blocks.reshape(N, M, D).contiguous()
    q = queries.contiguous()
    BN, BQ, BD = max(16, next_pow2(N)), max(16, next_pow2(Q)), min(block_d, next_pow2(D))
    row_blocks = triton.cdiv(M, score_rows)
    score_chunks, apply_chunks = chunks or (_chunks(row_blocks, D, BD), _chunks(M, D, BD))
    score_chunk = triton.cdiv(triton.cdiv(D, score_chunks), BD) * BD
    scores = torch.empty(score_chunks, M, BQ, BN, dtype=torch.float32, device=blocks.device)
    squares = torch.empty(score_chunks, M, BN, dtype=torch.float32, device=blocks.device)
    _scores_kernel[(row_blocks, score_chunks)](
        q, norm_weights.contiguous() if norm_weights is not None else q, flat, scores, squares, N, Q, M, D,
        score_chunk, HAS_NORM_W=norm_weights is not None, BM=score_rows, BN=BN, BQ=BQ, BD=BD, num_warps=num_warps,
    )
    acc = torch.empty(Q, M, D, dtype=torch.float32, device=blocks.device)
    top = torch.empty(Q, M, dtype=torch.float32, device=blocks.device)
    denom = torch.empty_like(top)
    _apply_kernel[(M, apply_chunks)](
        flat, scores, squares, acc, top, denom, N, Q, M, D, triton.cdiv(triton.cdiv(D, apply_chunks), BD) * BD, eps,
        CHUNKS=score_chunks, BN=BN, BQ=BQ, BD=BD, num_warps=num_warps,
    )
    return OnlineSoftmax(top.reshape(Q, *rows), denom.reshape(Q, *rows), acc.reshape(Q, *rows, D))
