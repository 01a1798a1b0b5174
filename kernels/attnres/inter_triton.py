"""Block AttnRes phase 1: every site of a block against the completed blocks, in one batched pass (§5.4.2).

For each token row, the N completed block sums are scored by all Q pseudo-queries of the block's sites:
logits = q_eff . RMSNorm(block) (q_eff = query * key-norm weight); per site the online-softmax statistics
(max, denominator, accumulator) follow, which phase 2 (`merge_norm_triton`) folds the intra-block partial
sum into. The bytes that must move are the blocks (read once) and the Q float32 accumulator rows per token
(written once; at N=8, Q=24 they are 6x the block reads). The softmax needs full-D dot products before any
accumulator column can be written, so the work is cut into (row tile, D chunk) programs, each in two phases:
- scores: partial dot products and sums of squares of its `score_rows` rows over its D chunk (so a few
  decode rows still occupy every SM, and the queries are read once per row tile), stored for its peers;
- barrier: the chunk programs of a row tile are launched next to each other; each counts itself in on the
  tile's counter and waits until all have (the cross-CTA reduction of the softmax statistics);
- apply: per `apply_rows` rows, the chunks' partials are added up, the softmax taken and the accumulators of
  its D chunk written, from the block columns that this program read moments ago (L2, not HBM).
So HBM sees the blocks once, in one launch. Waiting on peers is deadlock-free because CTAs are dispatched in
launch order and a tile has at most one SM's worth of chunks: the lowest unfinished tile's programs are
always resident (see `plan_inter`). The counter is reset by the tile's last program to leave, so it is zero
between calls. The interpreter runs programs one after another, so there (and with `barrier=False`) the
same kernel is launched twice instead: scores for all programs, then apply.
The accumulator of `apply_rows` rows is one product [Q * rows, rows * N] x [rows * N, D tile] with a
block-diagonal weight matrix (each row's sites see only that row's blocks). Both products multiply a
float32 matrix (queries, weights) by the blocks: bf16 blocks are exact in bf16, so the float32 side is cut
into three bf16 parts (24 mantissa bits) and three bf16 MMAs give float32 products (half the tensor-core
time of 3xTF32, which other dtypes take). Tensor-core accumulation over one D chunk (<= `chunk_d` columns)
keeps the accumulators within ~1e-6 of float32 math (one chain over D=7168 measured 1.1e-5).
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
        if REREAD:  # the apply phase: its last use
            return tl.load(ptrs, mask=ok, other=0.0, eviction_policy="evict_first")
        return tl.load(ptrs, mask=ok, other=0.0, eviction_policy="evict_last")  # kept for the apply phase

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
    def _partials_at(c, m0, Q, M, BM: tl.constexpr, BN: tl.constexpr, BQ: tl.constexpr):
        """Where D chunk c's partial results of rows m0 .. m0 + BM live: offsets of the scores [BQ, BM * BN]
        in scores [chunks, M, Q, BN] and of the sums of squares [BM * BN] in squares [chunks, M, BN] (column
        j = r * BN + n is row m0 + r, block n), their masks (rows < M; and sites < Q). The scores phase
        writes there, the apply phase reads (every program of a tile reads all its chunks' partials, so
        the padding sites are not stored)."""
        j = tl.arange(0, BM * BN)
        qs = tl.arange(0, BQ)
        r, n = j // BN, j % BN
        base = c * M + m0 + r  # [BM * BN]: the (chunk, row) of each column
        rows_in = m0 + r < M
        return ((base[None, :] * Q + qs[:, None]) * BN + n[None, :], (qs < Q)[:, None] & rows_in[None, :],
                base * BN + n, rows_in)

    @triton.jit
    def _query_parts_kernel(queries, norm_w, parts, Q, D, HAS_NORM_W: tl.constexpr, SPLIT: tl.constexpr,
                            BQ: tl.constexpr, BD: tl.constexpr):
        """parts [3, Q, D]: q_eff = query * key-norm weight cut into three bf16 parts (SPLIT 1; float32
        copies of them for the interpreter, SPLIT 2), or q_eff itself in part 0 (SPLIT 0)."""
        qs = tl.arange(0, BQ)
        d = tl.program_id(0) * BD + tl.arange(0, BD)
        ok = (qs < Q)[:, None] & (d < D)[None, :]
        offs = qs[:, None] * D + d[None, :]
        q = tl.load(queries + offs, mask=ok, other=0.0).to(tl.float32)
        if HAS_NORM_W:
            q = q * tl.load(norm_w + offs, mask=ok, other=0.0).to(tl.float32)
        if SPLIT == 0:
            tl.store(parts + offs, q, mask=ok)
        else:
            hi = q.to(tl.bfloat16)
            rest = q - hi.to(tl.float32)
            mid = rest.to(tl.bfloat16)
            lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
            tl.store(parts + offs, hi.to(parts.dtype.element_ty), mask=ok)
            tl.store(parts + Q * D + offs, mid.to(parts.dtype.element_ty), mask=ok)
            tl.store(parts + 2 * Q * D + offs, lo.to(parts.dtype.element_ty), mask=ok)

    @triton.jit
    def _scores(parts, blocks, scores, squares, m0, c, d_lo, d_hi, N, Q, M, D, SPLIT: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BQ: tl.constexpr, BD: tl.constexpr):
        """Stores q_eff . blocks[:, m0 + r] [BQ, BM * BN] and the blocks' sums of squares over d_lo..d_hi.
        The loop is a plain tiled product whose loads feed the dots directly, so the compiler pipelines
        them. The queries are the product's rows (32: mma.sync): with the blocks as the rows (64: wgmma,
        Triton 3.6) the H200 returned wrong partial dots now and then at 16 steps per chunk."""
        qs = tl.arange(0, BQ)
        dots = tl.zeros([BQ, BM * BN], dtype=tl.float32)
        sq = tl.zeros([BM * BN], dtype=tl.float32)
        for d0 in range(d_lo, d_hi, BD):
            d = d0 + tl.arange(0, BD)
            blk = _block_tile(blocks, m0, d, N, M, D, BM, BN, False)
            sq += tl.sum(blk.to(tl.float32) * blk.to(tl.float32), 1)
            q_ptrs = parts + qs[:, None] * D + d[None, :]  # [BQ, BD]
            q_ok = (qs < Q)[:, None] & (d < D)[None, :]
            if SPLIT == 0:
                dots = tl.dot(tl.load(q_ptrs, mask=q_ok, other=0.0), tl.trans(blk.to(tl.float32)), dots,
                              input_precision="tf32x3")
            elif SPLIT == 1:  # smallest part first
                for p in tl.static_range(2, -1, -1):
                    dots = tl.dot(tl.load(q_ptrs + p * Q * D, mask=q_ok, other=0.0), tl.trans(blk), dots)
            else:
                for p in tl.static_range(2, -1, -1):
                    dots = tl.dot(tl.load(q_ptrs + p * Q * D, mask=q_ok, other=0.0), tl.trans(blk.to(tl.float32)),
                                  dots, input_precision="ieee")
        score_offs, score_ok, square_offs, rows_in = _partials_at(c, m0, Q, M, BM, BN, BQ)
        tl.store(scores + score_offs, dots, mask=score_ok)
        tl.store(squares + square_offs, sq, mask=rows_in)

    @triton.jit
    def _wait_for_peers(counter, CHUNKS):
        """Count this program in on its row tile's counter and wait until all CHUNKS have; the last one to
        leave resets it. The CTA barrier orders every thread's partial stores before the (single-thread)
        release, and the acquire before any thread's loads of the peers' partials."""
        tl.debug_barrier()
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") + 1
        while arrived < CHUNKS:
            arrived = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
        if tl.atomic_add(counter, 1, sem="relaxed", scope="gpu") == 2 * CHUNKS - 1:
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
        tl.debug_barrier()

    @triton.jit
    def _apply(blocks, scores, squares, acc_out, max_out, denom_out, m0, c, d_lo, d_hi, N, Q, M, D, CHUNKS,
               eps, SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BQ: tl.constexpr,
               BD: tl.constexpr, STREAM_STORES: tl.constexpr):
        """Rows m0 .. m0 + BM: add up the chunks' partials, softmax, write the accumulators of d_lo..d_hi
        (and max, denominator from chunk 0)."""
        j = tl.arange(0, BM * BN)
        r, n = j // BN, j % BN
        dots = tl.zeros([BQ, BM * BN], dtype=tl.float32)
        sq = tl.zeros([BM * BN], dtype=tl.float32)
        for part in range(CHUNKS):  # .cg: written by other programs, so never from this SM's L1
            score_offs, score_ok, square_offs, rows_in = _partials_at(part, m0, Q, M, BM, BN, BQ)
            dots += tl.load(scores + score_offs, mask=score_ok, other=0.0, cache_modifier=".cg")
            sq += tl.load(squares + square_offs, mask=rows_in, other=0.0, cache_modifier=".cg")
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
        for d0 in range(d_lo, d_hi, BD):
            d = d0 + tl.arange(0, BD)
            blk = _block_tile(blocks, m0, d, N, M, D, BM, BN, True)
            acc = _dot_exact(weights, blk, tl.zeros([BQ * BM, BD], dtype=tl.float32), SPLIT)
            ptrs, in_bounds = acc_out + out_row[:, None] * D + d[None, :], row_ok[:, None] & (d < D)[None, :]
            if STREAM_STORES:  # written once, read by the next kernel: keep them from evicting the blocks
                tl.store(ptrs, acc, mask=in_bounds, cache_modifier=".cs")
            else:
                tl.store(ptrs, acc, mask=in_bounds)

    @triton.jit
    def _inter_kernel(parts, blocks, scores, squares, counters, acc_out, max_out, denom_out, N, Q, M, D, CHUNK,
                      CHUNKS, eps, PHASE: tl.constexpr, SPLIT: tl.constexpr,
                      BM_S: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BQ: tl.constexpr,
                      BD_S: tl.constexpr, BD: tl.constexpr, STREAM_STORES: tl.constexpr):
        """Program (row tile, D chunk), chunks of a tile adjacent. PHASE 0: scores, barrier, apply (one
        launch); 1: scores only; 2: apply only (the two-launch form)."""
        pid = tl.program_id(0)
        tile, c = pid // CHUNKS, pid % CHUNKS
        m_tile = tile.to(tl.int64) * BM_S
        d_lo = c * CHUNK
        d_hi = tl.minimum(d_lo + CHUNK, D)
        if PHASE != 2:
            _scores(parts, blocks, scores, squares, m_tile, c, d_lo, d_hi, N, Q, M, D, SPLIT, BM_S, BN, BQ, BD_S)
        if PHASE == 0:
            _wait_for_peers(counters + tile, CHUNKS)
        if PHASE != 1:
            for sub in range(0, BM_S, BM):
                _apply(blocks, scores, squares, acc_out, max_out, denom_out, m_tile + sub, c, d_lo, d_hi, N, Q,
                       M, D, CHUNKS, eps, SPLIT, BM, BN, BQ, BD, STREAM_STORES)


_COUNTERS: dict[tuple, torch.Tensor] = {}


def _tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 barrier counters, one per row tile, kept per (device, stream): the kernel leaves them
    zero, so they are allocated (and zeroed) only when a call needs more than any before it on that stream."""
    key = (device, torch.cuda.current_stream(device).cuda_stream)
    have = _COUNTERS.get(key)
    if have is None or have.numel() < tiles:
        have = _COUNTERS[key] = torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device)
    return have


def _split_mode(dtype: torch.dtype) -> int:
    """How the scores multiply by q_eff: see `_dot_exact`'s SPLIT."""
    return 0 if dtype != torch.bfloat16 else 2 if os.environ.get("TRITON_INTERPRET") == "1" else 1


def query_parts(queries: torch.Tensor, norm_weights: torch.Tensor | None, blocks_dtype: torch.dtype,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """q_eff = queries [Q, D] * key-norm weights, cut into the parts the scores multiply by ([3, Q, D] bf16
    for bf16 blocks; [1, Q, D] float32 q_eff otherwise): one small launch per `attnres_inter` call, or done
    once by a caller whose queries are weights (then passed as `parts`)."""
    Q, D = queries.shape
    split = _split_mode(blocks_dtype)
    if out is None:
        out = torch.empty(3 if split else 1, Q, D, dtype=torch.bfloat16 if split == 1 else torch.float32,
                          device=queries.device)
    BD = min(128, next_pow2(D))
    q = queries.contiguous()
    _query_parts_kernel[(triton.cdiv(D, BD),)](
        q, norm_weights.contiguous() if norm_weights is not None else q, out, Q, D,
        HAS_NORM_W=norm_weights is not None, SPLIT=split, BQ=next_pow2(Q), BD=BD,
    )
    return out


@dataclass
class InterLaunch:
    """One phase-1 call, planned: its buffers and launch shape. `run()` = the query parts (unless given),
    then one launch with the barrier, or `scores()` then `apply()` (the interpreter; `barrier=False`; the
    benchmark times them apart)."""

    queries: torch.Tensor
    norm_w: torch.Tensor | None
    parts: torch.Tensor  # [3 or 1, Q, D]
    parts_given: bool
    blocks: torch.Tensor  # [N, M, D]
    eps: float
    rows: tuple
    barrier: bool
    grid: tuple[int]
    chunk: int
    chunks: int
    consts: dict  # constexprs
    num_warps: int
    scores_buf: torch.Tensor
    squares_buf: torch.Tensor
    out: OnlineSoftmax  # max, denom [Q, M]; acc [Q, M, D]

    def _launch(self, phase: int) -> None:
        N, M, D = self.blocks.shape
        tiles = self.grid[0] // self.chunks
        counters = _tile_counters(self.blocks.device, tiles) if phase == 0 else self.squares_buf
        _inter_kernel[self.grid](
            self.parts, self.blocks, self.scores_buf, self.squares_buf, counters, self.out.acc, self.out.max,
            self.out.denom, N, self.parts.shape[1], M, D, self.chunk, self.chunks, self.eps, PHASE=phase,
            **self.consts, num_warps=self.num_warps,
        )

    def prepare(self) -> None:
        if not self.parts_given:
            query_parts(self.queries, self.norm_w, self.blocks.dtype, out=self.parts)

    def scores(self) -> None:
        self._launch(1)

    def apply(self) -> OnlineSoftmax:
        self._launch(2)
        return self.result()

    def result(self) -> OnlineSoftmax:
        Q, D = self.parts.shape[1:]
        o = self.out
        return OnlineSoftmax(o.max.reshape(Q, *self.rows), o.denom.reshape(Q, *self.rows),
                             o.acc.reshape(Q, *self.rows, D))

    def run(self) -> OnlineSoftmax:
        self.prepare()
        if not self.barrier:
            self.scores()
            return self.apply()
        self._launch(0)
        return self.result()


def _chunks(tiles: int, D: int, step: int, chunk_d: int, sms: int) -> int:
    """D chunks per row tile: at most `chunk_d` columns each (so the blocks a program re-reads are still in
    L2), more while the grid has fewer than about two programs per SM, never more than one SM's worth."""
    columns = D // step
    wanted = max(-(-D // chunk_d), -(-2 * sms // tiles))
    return max(1, min(wanted, columns, sms))


def plan_inter(queries: torch.Tensor, blocks: torch.Tensor, norm_weights: torch.Tensor | None = None,
               eps: float = 1e-6, block_d: int | None = None, score_rows: int | None = None, num_warps: int = 4,
               chunks: int | None = None, apply_rows: int = 2, apply_block_d: int = 128, chunk_d: int = 1024,
               stream_stores: bool = True, barrier: bool = True, parts: torch.Tensor | None = None) -> InterLaunch:
    """Checks the arguments of `attnres_inter` and plans its launch."""
    N, D = blocks.shape[0], blocks.shape[-1]
    Q = queries.shape[0]
    require(queries.dim() == 2 and queries.shape[1] == D, f"queries must be [Q, {D}], got {tuple(queries.shape)}")
    require(norm_weights is None or norm_weights.shape == queries.shape,
            f"norm_weights must be [{Q}, {D}] like queries")
    require(blocks.dtype != torch.float64 and queries.dtype != torch.float64, "float64 takes the reference")
    require(N >= 1 and blocks.dim() >= 2, "blocks must be [N >= 1, ..., D]")
    M, sms = blocks[0, ..., 0].numel(), sm_count(blocks.device, cpu=132)  # CPU: plan as on the H200
    if score_rows is None:  # every program of a tile reads all its chunks' partials: few chunks per tile
        score_rows = 8 if M >= 32 * sms else apply_rows  # (prefill), few rows (decode: the SMs need chunks)
    for name, value in (("apply_rows", apply_rows), ("score_rows", score_rows)):
        require(value >= 1 and value == next_pow2(value), f"{name} must be a power of two, got {value}")
    require(apply_rows <= score_rows, f"apply_rows ({apply_rows}) must not exceed score_rows ({score_rows})")
    if block_d is None:
        block_d = 64
    require(chunks is None or 1 <= chunks <= sms, f"chunks must be 1..{sms} (one SM's worth), got {chunks}")
    flat = blocks.reshape(N, M, D).contiguous()
    split = _split_mode(flat.dtype)
    if parts is not None:
        require(parts.shape == (3 if split else 1, Q, D), f"parts must be query_parts' [3 or 1, {Q}, {D}]")
    # Every tl.dot operand needs >= 16 along K: pad the block axis so that rows * blocks >= 16.
    BN = max(next_pow2(N), 16 // apply_rows)
    BQ, BD, BDA = max(16, next_pow2(Q)), min(block_d, next_pow2(D)), min(apply_block_d, next_pow2(D))
    tiles = triton.cdiv(M, score_rows)
    step = max(BD, BDA)  # both D tiles are powers of two: a chunk is a multiple of each
    n_chunks = chunks or _chunks(tiles, D, step, chunk_d, sms)
    chunk = triton.cdiv(triton.cdiv(D, n_chunks), step) * step
    n_chunks = triton.cdiv(D, chunk)
    device = blocks.device
    out = OnlineSoftmax(torch.empty(Q, M, dtype=torch.float32, device=device),
                        torch.empty(Q, M, dtype=torch.float32, device=device),
                        torch.empty(Q, M, D, dtype=torch.float32, device=device))
    if parts is None:
        parts_given, parts = False, torch.empty(3 if split else 1, Q, D, device=device,
                                                dtype=torch.bfloat16 if split == 1 else torch.float32)
    else:
        parts_given = True
    return InterLaunch(
        queries, norm_weights, parts, parts_given, flat, eps, tuple(blocks.shape[1:-1]),
        barrier and os.environ.get("TRITON_INTERPRET") != "1", (tiles * n_chunks,), chunk, n_chunks,
        {"SPLIT": split, "BM_S": score_rows, "BM": apply_rows, "BN": BN, "BQ": BQ, "BD_S": BD, "BD": BDA,
         "STREAM_STORES": stream_stores},
        num_warps, torch.empty(n_chunks, M, Q, BN, dtype=torch.float32, device=device),
        torch.empty(n_chunks, M, BN, dtype=torch.float32, device=device), out,
    )


def attnres_inter(queries: torch.Tensor, blocks: torch.Tensor, norm_weights: torch.Tensor | None = None,
                  eps: float = 1e-6, block_d: int | None = None, score_rows: int | None = None, num_warps: int = 4,
                  chunks: int | None = None, apply_rows: int = 2, apply_block_d: int = 128, chunk_d: int = 1024,
                  stream_stores: bool = True, barrier: bool = True, parts: torch.Tensor | None = None
                  ) -> OnlineSoftmax:
    """queries [Q, D] of all sites of a block, blocks [N, ..., D] -> float32 statistics [Q, ...] (max,
    denominator) and [Q, ..., D] (accumulator), as k3core.ops.attnres.attnres_inter.
    Tuning: `block_d` / `apply_block_d` the D tiles of the scores / accumulators, `score_rows` /
    `apply_rows` the rows per program / per apply step, `chunks` the D chunks per row tile (None: at most
    `chunk_d` columns each, and about two programs per SM), `stream_stores` streaming (.cs) stores of the
    accumulators, `barrier` one launch whose chunk programs wait for each other (False: two launches).
    `parts`: `query_parts(queries, norm_weights, blocks.dtype)` computed beforehand (saves a launch)."""
    return plan_inter(queries, blocks, norm_weights, eps, block_d, score_rows, num_warps, chunks, apply_rows,
                      apply_block_d, chunk_d, stream_stores, barrier, parts).run()
