"""Block AttnRes phase 1: every site of a block against the completed blocks, in one batched pass (§5.4.2).

For each token row, the N completed block sums are scored by all Q pseudo-queries of the block's sites:
logits = q_eff . RMSNorm(block) (q_eff = query * key-norm weight); per site the online-softmax statistics
(max, denominator, accumulator) follow, which phase 2 (`merge_norm_triton`) folds the intra-block partial
sum into. The Q float32 accumulator rows per token are most of the bytes (at N=8, Q=24: 6x the block
reads), so everything is arranged around writing them at full speed:
- the softmax needs full-D dot products before any accumulator column can be written, so a scores kernel
  (partial dot products and sums of squares over D chunks, so that a few decode rows still occupy every
  SM) runs first, then an apply kernel per (`apply_rows` rows, D chunk) adds the chunks up, takes the
  softmax and writes the accumulators;
- `fused=True`: one program per row tile does both passes, re-reading its rows' blocks from L2 (HBM sees
  the blocks once). Measured slower on the H200 (docs/kernels.md): L2 does not keep the blocks against
  the accumulator stream, and every row tile re-reads all Q queries.
The accumulator of `apply_rows` rows is one product [Q * rows, rows * N] x [rows * N, D tile] with a
block-diagonal weight matrix (each row's sites see only that row's blocks). Both products multiply a
float32 matrix (queries, weights) by the blocks: bf16 blocks are exact in bf16, so the float32 side is cut
into three bf16 parts (24 mantissa bits) and three bf16 MMAs give float32 products (half the tensor-core
time of 3xTF32, which other dtypes take). Each D tile's scores are summed in float32 registers: one MMA
chain over all of D=7168 measured 1.1e-5 relative in the accumulators on the H200, per-tile sums 1.6e-6.
`logits=` (cached, `block_logits_triton`) skips the scores: the apply kernel alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from k3core.ops.attnres import OnlineSoftmax
from kernels._triton import next_pow2, require, sm_count, tl, triton

if triton is not None:

    @triton.jit
    def _block_tile(blocks, m0, d, N, M, D, BM: tl.constexpr, BN: tl.constexpr, REREAD: tl.constexpr):
        """blocks[n, m0 + r, d] as a [BM * BN, BD] tile, tile row j = r * BN + n (zeros outside)."""
        j = tl.arange(0, BM * BN)
        r, n = j // BN, j % BN
        ok = ((n < N) & (m0 + r < M))[:, None] & (d < D)[None, :]
        ptrs = blocks + (n[:, None] * M + m0 + r[:, None]) * D + d[None, :]
        if REREAD:  # the second (apply) pass: its last use
            return tl.load(ptrs, mask=ok, other=0.0, eviction_policy="evict_first")
        return tl.load(ptrs, mask=ok, other=0.0, eviction_policy="evict_last")

    @triton.jit
    def _partial_scores(queries, norm_w, blocks, m0, d_lo, d_hi, N, Q, M, D, HAS_NORM_W: tl.constexpr,
                        SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BQ: tl.constexpr,
                        BD: tl.constexpr):
        """q_eff . blocks[:, m0 + r] [BQ, BM * BN] and the blocks' sums of squares [BM * BN] over d_lo..d_hi."""
        qs = tl.arange(0, BQ)
        dots = tl.zeros([BQ, BM * BN], dtype=tl.float32)
        sq = tl.zeros([BM * BN], dtype=tl.float32)
        for d0 in range(d_lo, d_hi, BD):
            d = d0 + tl.arange(0, BD)
            q_ok = (qs < Q)[:, None] & (d < D)[None, :]
            blk = _block_tile(blocks, m0, d, N, M, D, BM, BN, False)
            q = tl.load(queries + qs[:, None] * D + d[None, :], mask=q_ok, other=0.0).to(tl.float32)
            if HAS_NORM_W:
                q = q * tl.load(norm_w + qs[:, None] * D + d[None, :], mask=q_ok, other=0.0).to(tl.float32)
            sq += tl.sum(blk.to(tl.float32) * blk.to(tl.float32), 1)
            # Each D tile's product summed in float32 registers: one tensor-core chain over all of D lost
            # 1.1e-5 relative at D=7168 on the H200 (docs/kernels.md, AttnRes round 2).
            dots += _dot_exact(q, tl.trans(blk), tl.zeros([BQ, BM * BN], dtype=tl.float32), SPLIT)
        return dots, sq

    @triton.jit
    def _dot_exact(a, b, acc, SPLIT: tl.constexpr):
        """acc + a @ b, a float32, to float32 accuracy. SPLIT 1: b is bf16 (exact there), a is cut into three
        bf16 parts (24 mantissa bits) for three bf16 MMAs; 2: the same parts as float32 (the interpreter's
        bf16 dot is wrong); 0: 3xTF32 (other dtypes)."""
        if SPLIT == 0:
            return tl.dot(a, b.to(tl.float32), acc, input_precision="tf32x3")
        hi = a.to(tl.bfloat16)
        rest = a - hi.to(tl.float32)
        mid = rest.to(tl.bfloat16)
        lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
        if SPLIT == 1:
            acc = tl.dot(lo, b, acc)
            acc = tl.dot(mid, b, acc)
            return tl.dot(hi, b, acc)
        bf = b.to(tl.float32)
        acc = tl.dot(lo.to(tl.float32), bf, acc, input_precision="ieee")
        acc = tl.dot(mid.to(tl.float32), bf, acc, input_precision="ieee")
        return tl.dot(hi.to(tl.float32), bf, acc, input_precision="ieee")

    @triton.jit
    def _partials_at(c, m0, M, BM: tl.constexpr, BN: tl.constexpr, BQ: tl.constexpr):
        """Where D chunk c's partial results of rows m0 .. m0 + BM live: offsets of the scores [BQ, BM * BN]
        in scores [chunks, M, BQ, BN] and of the sums of squares [BM * BN] in squares [chunks, M, BN] (column
        j = r * BN + n is row m0 + r, block n), and the mask of rows < M. The scores kernel writes there, the
        apply kernel reads."""
        j = tl.arange(0, BM * BN)
        r, n = j // BN, j % BN
        base = c * M + m0 + r  # [BM * BN]: the (chunk, row) of each column
        return (base[None, :] * BQ + tl.arange(0, BQ)[:, None]) * BN + n[None, :], base * BN + n, m0 + r < M

    @triton.jit
    def _scores_kernel(queries, norm_w, blocks, scores, squares, N, Q, M, D, CHUNK,
                       HAS_NORM_W: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                       BQ: tl.constexpr, BD: tl.constexpr):
        """scores[c, m, q, n] = q_eff[q] . blocks[n, m] and squares[c, m, n] over D chunk c."""
        m0 = tl.program_id(0).to(tl.int64) * BM
        c = tl.program_id(1).to(tl.int64)
        dots, sq = _partial_scores(queries, norm_w, blocks, m0, c * CHUNK, tl.minimum(c * CHUNK + CHUNK, D),
                                   N, Q, M, D, HAS_NORM_W, SPLIT, BM, BN, BQ, BD)
        score_offs, square_offs, ok = _partials_at(c, m0, M, BM, BN, BQ)
        tl.store(scores + score_offs, dots, mask=ok[None, :])
        tl.store(squares + square_offs, sq, mask=ok)

    @triton.jit
    def _apply_kernel(queries, norm_w, blocks, scores, squares, given, acc_out, max_out, denom_out, N, Q, M, D,
                      CHUNK, stride_gq, stride_gn, eps, FUSED: tl.constexpr, GIVEN: tl.constexpr,
                      CHUNKS: tl.constexpr, HAS_NORM_W: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr,
                      BN: tl.constexpr, BQ: tl.constexpr, BD_SCORES: tl.constexpr, BD: tl.constexpr,
                      STREAM_STORES: tl.constexpr):
        m0 = tl.program_id(0).to(tl.int64) * BM
        c = tl.program_id(1)
        j = tl.arange(0, BM * BN)
        r, n = j // BN, j % BN
        if GIVEN:  # logits [Q, N, M] (row stride 1) computed earlier, e.g. once per block by block_logits
            qs = tl.arange(0, BQ)
            in_range = (qs < Q)[:, None] & ((n < N) & (m0 + r < M))[None, :]
            logits = tl.load(given + qs[:, None] * stride_gq + n[None, :] * stride_gn + (m0 + r)[None, :],
                             mask=in_range, other=0.0)
        else:
            if FUSED:
                dots, sq = _partial_scores(queries, norm_w, blocks, m0, 0, D, N, Q, M, D, HAS_NORM_W, SPLIT, BM,
                                           BN, BQ, BD_SCORES)
            else:
                dots = tl.zeros([BQ, BM * BN], dtype=tl.float32)
                sq = tl.zeros([BM * BN], dtype=tl.float32)
                for part in tl.static_range(CHUNKS):
                    score_offs, square_offs, rows_in = _partials_at(part, m0, M, BM, BN, BQ)
                    dots += tl.load(scores + score_offs, mask=rows_in[None, :], other=0.0)
                    sq += tl.load(squares + square_offs, mask=rows_in, other=0.0)
            logits = dots * tl.rsqrt(sq / D + eps)[None, :]
        # Block-diagonal expansion: output row (q, r) weighs only row r's blocks.
        own = (r[None, None, :] == tl.arange(0, BM)[None, :, None]) & (n < N)[None, None, :]
        logits = tl.reshape(tl.where(own, logits[:, None, :], float("-inf")), (BQ * BM, BM * BN))
        top = tl.max(logits, 1)
        top = tl.where(top == float("-inf"), 0.0, top)  # padding rows: no NaN from -inf - -inf
        weights = tl.exp(logits - top[:, None])
        i = tl.arange(0, BQ * BM)
        row_ok = (i // BM < Q) & (m0 + i % BM < M)
        out_row = (i // BM) * M + m0 + i % BM  # [Q, M] position of output row (q, r)
        if c == 0:
            tl.store(max_out + out_row, top, mask=row_ok)
            tl.store(denom_out + out_row, tl.sum(weights, 1), mask=row_ok)
        for d0 in range(c * CHUNK, tl.minimum(c * CHUNK + CHUNK, D), BD):
            d = d0 + tl.arange(0, BD)
            blk = _block_tile(blocks, m0, d, N, M, D, BM, BN, True)
            acc = _dot_exact(weights, blk, tl.zeros([BQ * BM, BD], dtype=tl.float32), SPLIT)
            ptrs, in_bounds = acc_out + out_row[:, None] * D + d[None, :], row_ok[:, None] & (d < D)[None, :]
            if STREAM_STORES:  # written once, read by the next kernel: keep them from evicting the blocks
                tl.store(ptrs, acc, mask=in_bounds, cache_modifier=".cs")
            else:
                tl.store(ptrs, acc, mask=in_bounds)


def split_mode(dtype: torch.dtype) -> int:
    """The SPLIT constexpr of `_dot_exact` for blocks of `dtype`: 1 bf16 parts on bf16 MMAs, 2 the same parts
    multiplied as float32 (under the interpreter, whose bf16 dot is wrong), 0 3xTF32 (other dtypes)."""
    if dtype != torch.bfloat16:
        return 0
    return 2 if os.environ.get("TRITON_INTERPRET") == "1" else 1


def _chunks(programs: int, D: int, block_d: int, sms: int) -> int:
    """D chunks that give about two programs per SM (1 when the rows alone do), each >= 4 column blocks."""
    wanted = max(1, -(-2 * sms // programs))
    return max(1, min(wanted, D // (4 * block_d)))


@dataclass
class InterLaunch:
    """One phase-1 call, planned: its buffers and launch shapes. `run()` = `scores()` then `apply()` (the
    benchmark times the two kernels apart); in the fused form and with given logits `scores()` does nothing."""

    q: torch.Tensor
    w: torch.Tensor
    blocks: torch.Tensor  # [N, M, D]
    has_norm_w: bool
    eps: float
    rows: tuple
    fused: bool
    score_grid: tuple[int, int]
    apply_grid: tuple[int, int]
    score_chunk: int
    apply_chunk: int
    consts: dict  # constexprs shared by both kernels
    num_warps: int
    stream_stores: bool
    scores_buf: torch.Tensor
    squares_buf: torch.Tensor
    given: torch.Tensor | None  # logits [Q, N, M] computed earlier

    def scores(self) -> None:
        if self.fused or self.given is not None:
            return
        N, M, D = self.blocks.shape
        c = self.consts
        _scores_kernel[self.score_grid](
            self.q, self.w, self.blocks, self.scores_buf, self.squares_buf, N, self.q.shape[0], M, D,
            self.score_chunk, HAS_NORM_W=self.has_norm_w, SPLIT=c["SPLIT"], BM=c["BM_SCORES"], BN=c["BN"],
            BQ=c["BQ"], BD=c["BD_SCORES"], num_warps=self.num_warps,
        )

    def apply(self) -> OnlineSoftmax:
        N, M, D = self.blocks.shape
        Q, c = self.q.shape[0], self.consts
        acc = torch.empty(Q, M, D, dtype=torch.float32, device=self.blocks.device)
        top = torch.empty(Q, M, dtype=torch.float32, device=self.blocks.device)
        denom = torch.empty_like(top)
        given = self.given if self.given is not None else self.scores_buf
        _apply_kernel[self.apply_grid](
            self.q, self.w, self.blocks, self.scores_buf, self.squares_buf, given, acc, top, denom, N, Q, M, D,
            self.apply_chunk, *(given.stride()[:2] if self.given is not None else (0, 0)), self.eps,
            FUSED=self.fused, GIVEN=self.given is not None, CHUNKS=self.score_grid[1], HAS_NORM_W=self.has_norm_w,
            SPLIT=c["SPLIT"], BM=c["BM"], BN=c["BN"], BQ=c["BQ"], BD_SCORES=c["BD_SCORES"], BD=c["BD"],
            STREAM_STORES=self.stream_stores, num_warps=self.num_warps,
        )
        return OnlineSoftmax(top.reshape(Q, *self.rows), denom.reshape(Q, *self.rows), acc.reshape(Q, *self.rows, D))

    def run(self) -> OnlineSoftmax:
        self.scores()
        return self.apply()


def plan_inter(queries: torch.Tensor, blocks: torch.Tensor, norm_weights: torch.Tensor | None = None,
               eps: float = 1e-6, block_d: int = 64, score_rows: int | None = None, num_warps: int = 4,
               chunks: tuple[int, int] | None = None, apply_rows: int = 2, apply_block_d: int = 128,
               fused: bool = False, stream_stores: bool = True, logits: torch.Tensor | None = None) -> InterLaunch:
    """Checks the arguments of `attnres_inter` and plans its launches."""
    N, D = blocks.shape[0], blocks.shape[-1]
    Q = queries.shape[0]
    require(queries.dim() == 2 and queries.shape[1] == D, f"queries must be [Q, {D}], got {tuple(queries.shape)}")
    require(norm_weights is None or norm_weights.shape == queries.shape,
            f"norm_weights must be [{Q}, {D}] like queries")
    require(blocks.dtype != torch.float64 and queries.dtype != torch.float64, "float64 takes the reference")
    require(N >= 1 and blocks.dim() >= 2, "blocks must be [N >= 1, ..., D]")
    M, sms = blocks[0, ..., 0].numel(), sm_count(blocks.device, cpu=132)  # CPU: plan as on the H200
    if score_rows is None:  # H200: 16 rows per scores program at M=8192 (2.55 vs 2.74 ms), 8 at decode
        score_rows = 16 if M >= 32 * sms else 8
    for name, value in (("score_rows", score_rows), ("apply_rows", apply_rows)):
        require(value >= 1 and value == next_pow2(value), f"{name} must be a power of two, got {value}")
    flat = blocks.reshape(N, M, D).contiguous()
    q = queries.contiguous()
    if logits is not None:
        require(logits.dtype == torch.float32 and logits.shape == (Q, N, *blocks.shape[1:-1]),
                f"logits must be float32 [{Q}, {N}, {', '.join(map(str, blocks.shape[1:-1]))}]")
        logits = logits.reshape(Q, N, M)  # a view where the rows are dense (a slice of a logit cache)
        require(logits.stride(2) == 1 or M == 1, "logits must have unit stride along the rows")
    # Every tl.dot operand needs >= 16 along K: pad the block axis so that rows * blocks >= 16.
    BN = max(next_pow2(N), 16 // apply_rows, 1 if fused or logits is not None else 16 // score_rows)
    BQ, BD, BDA = max(16, next_pow2(Q)), min(block_d, next_pow2(D)), min(apply_block_d, next_pow2(D))
    split = split_mode(flat.dtype)
    apply_programs, row_blocks = triton.cdiv(M, apply_rows), triton.cdiv(M, score_rows)
    if fused or logits is not None:  # fused: one program per row tile does all of D
        score_chunks = 1
        apply_chunks = 1 if fused else chunks[1] if chunks else _chunks(apply_programs, D, BDA, sms)
        scores = squares = torch.empty(0, dtype=torch.float32, device=blocks.device)  # computed in registers
    else:
        score_chunks, apply_chunks = chunks or (_chunks(row_blocks, D, BD, sms), _chunks(apply_programs, D, BDA, sms))
        scores = torch.empty(score_chunks, M, BQ, BN, dtype=torch.float32, device=blocks.device)
        squares = torch.empty(score_chunks, M, BN, dtype=torch.float32, device=blocks.device)
    return InterLaunch(
        q, norm_weights.contiguous() if norm_weights is not None else q, flat, norm_weights is not None, eps,
        tuple(blocks.shape[1:-1]), fused, (row_blocks, score_chunks), (apply_programs, apply_chunks),
        triton.cdiv(triton.cdiv(D, score_chunks), BD) * BD, triton.cdiv(triton.cdiv(D, apply_chunks), BDA) * BDA,
        {"SPLIT": split, "BM": apply_rows, "BM_SCORES": score_rows, "BN": BN, "BQ": BQ, "BD_SCORES": BD, "BD": BDA},
        num_warps, stream_stores, scores, squares, logits,
    )


def attnres_inter(queries: torch.Tensor, blocks: torch.Tensor, norm_weights: torch.Tensor | None = None,
                  eps: float = 1e-6, block_d: int = 64, score_rows: int | None = None, num_warps: int = 4,
                  chunks: tuple[int, int] | None = None, apply_rows: int = 2, apply_block_d: int = 128,
                  fused: bool = False, stream_stores: bool = True, logits: torch.Tensor | None = None) -> OnlineSoftmax:
    """queries [Q, D] of all sites of a block, blocks [N, ..., D] -> float32 statistics [Q, ...] (max,
    denominator) and [Q, ..., D] (accumulator), as k3core.ops.attnres.attnres_inter.
    Tuning: `block_d` / `apply_block_d` the D tiles of the scores / accumulators, `score_rows` /
    `apply_rows` the rows per program of the scores / apply kernel (score_rows None: 16 for prefill-sized
    M, else 8), `chunks` the D chunks of the two kernels (None: about two programs per SM), `fused` one
    kernel per row tile that computes its own scores (measured slower: see docs/kernels.md),
    `stream_stores` streaming (.cs) stores of the accumulators.
    `logits` [Q, N, ...] float32 (rows dense), e.g. slices of a cache that `block_logits_triton` fills once
    per block: then only the apply kernel runs (k3core.ops.attnres.attnres_inter_from_logits)."""
    return plan_inter(queries, blocks, norm_weights, eps, block_d, score_rows, num_warps, chunks, apply_rows,
                      apply_block_d, fused, stream_stores, logits).run()
