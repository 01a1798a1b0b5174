"""Block AttnRes: one completed block's logits against every later site, computed once per block.

A site's logit for block b is q_eff . RMSNorm(b) (q_eff = pseudo-query * key-norm weight, eq.8-9 of the K3
report): the sites' parameters and the block alone, nothing that depends on the site's own input. So once
a block is complete its logits for all later sites (those of later blocks and the final one) can be
produced in one pass over the block and kept ([sites, rows] float32: 4 bytes per row and site, against
2 x D per row for the block itself). Each later block's phase 1 then only softmaxes those logits and
writes the accumulators (`inter_triton.attnres_inter(..., logits=...)`), which runs at copy speed; the
block is read once for its logits instead of once per later block's scores pass.

One program per (rows tile, sites tile, D chunk): the product [sites, D] x [D, rows] by the same exact
split-float32 MMAs as the phase-1 scores, and the rows' sums of squares. With few rows (decode) D is cut
into chunks so that the GPU fills; the last chunk program of a tile to finish (a counter per tile, reset
by that program) adds the chunks' partials in a fixed order, so the result does not depend on timing.
"""

from __future__ import annotations

import torch

from kernels._triton import next_pow2, require, sm_count, tl, triton
from kernels.attnres.inter_triton import _block_tile, _chunks, _partial_scores, split_mode
from kernels.attnres.query_parts import query_part_count
from kernels.fused.split_scratch import split_scratch

if triton is not None:

    @triton.jit
    def _parts_scores(parts, block, copy_to, copy_rows, m0, d_lo, d_hi, S_left, stride_p, M, D, PARTS: tl.constexpr,
                      SPLIT: tl.constexpr, COPY: tl.constexpr, BM: tl.constexpr, BS: tl.constexpr,
                      BD: tl.constexpr):
        """q_eff . block[m0 + r] [BS, BM] and the rows' sums of squares [BM] over d_lo..d_hi, q_eff given as
        PARTS bf16 parts [PARTS, sites, D] (`parts` at this tile's first site, S_left sites from there, parts
        stride_p apart): one bf16 MMA per part, smallest first. COPY: each block tile's rows < `copy_rows` (M or
        0) are also stored into `copy_to` (same [M, D] layout) from the registers they were loaded into."""
        qs = tl.arange(0, BS)
        rows = m0 + tl.arange(0, BM)
        dots = tl.zeros([BS, BM], dtype=tl.float32)
        sq = tl.zeros([BM], dtype=tl.float32)
        for d0 in range(d_lo, d_hi, BD):
            d = d0 + tl.arange(0, BD)
            blk = _block_tile(block, m0, d, 1, M, D, BM, 1, False)
            if COPY:
                tl.store(copy_to + rows[:, None] * D + d[None, :], blk,
                         mask=(rows < copy_rows)[:, None] & (d < D)[None, :])
            sq += tl.sum(blk.to(tl.float32) * blk.to(tl.float32), 1)
            q_ok = (qs < S_left)[:, None] & (d < D)[None, :]
            tile = tl.zeros([BS, BM], dtype=tl.float32)
            for i in tl.static_range(PARTS):
                part = tl.load(parts + (PARTS - 1 - i) * stride_p + qs[:, None] * D + d[None, :], mask=q_ok,
                               other=0.0)
                if SPLIT == 1:
                    tile = tl.dot(part, tl.trans(blk), tile)
                else:  # the interpreter's bf16 dot is wrong: the same products in float32
                    tile = tl.dot(part.to(tl.float32), tl.trans(blk).to(tl.float32), tile, input_precision="ieee")
            dots += tile
        return dots, sq

    @triton.jit
    def _block_logits_kernel(queries, norm_w, parts, block, copy_to, out, part_dots, part_sq, counters, S, M, D,
                             CHUNK, stride_p, stride_os, eps, CHUNKS: tl.constexpr, HAS_NORM_W: tl.constexpr,
                             PARTS: tl.constexpr, SPLIT: tl.constexpr, COPY: tl.constexpr, BM: tl.constexpr,
                             BS: tl.constexpr, BD: tl.constexpr):
        m0 = tl.program_id(0).to(tl.int64) * BM
        s0 = tl.program_id(1).to(tl.int64) * BS
        c = tl.program_id(2)
        d_lo, d_hi = c * CHUNK, tl.minimum(c * CHUNK + CHUNK, D)
        if PARTS > 0:  # q_eff's bf16 parts cut once, ahead; the first sites tile copies the block if asked
            copy_rows = tl.where(tl.program_id(1) == 0, M, 0)
            dots, sq = _parts_scores(parts + s0 * D, block, copy_to, copy_rows, m0, d_lo, d_hi, S - s0,
                                     stride_p, M, D, PARTS, SPLIT, COPY, BM, BS, BD)
        else:  # q_eff formed and cut in every D step
            dots, sq = _partial_scores(queries + s0 * D, norm_w + s0 * D, block, m0, d_lo, d_hi, 1, S - s0, M, D,
                                       HAS_NORM_W, SPLIT, BM, 1, BS, BD)  # [BS, BM], [BM]
        sites, rows = s0 + tl.arange(0, BS), m0 + tl.arange(0, BM)
        last = True
        if CHUNKS > 1:
            tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
            tiles = tl.num_programs(0) * tl.num_programs(1)
            dot_offs = (tile * BS + tl.arange(0, BS)[:, None]) * BM + tl.arange(0, BM)[None, :]
            tl.store(part_dots + c * tiles * BS * BM + dot_offs, dots)
            tl.store(part_sq + (c * tiles + tile) * BM + tl.arange(0, BM), sq)
            # Every thread's partial stores precede the (single-thread) release; the acquire precedes the
            # last program's loads of its peers' partials.
            tl.debug_barrier()
            last = tl.atomic_add(counters + tile, 1, sem="acq_rel", scope="gpu") == CHUNKS - 1
            if last:
                dots = tl.zeros([BS, BM], dtype=tl.float32)
                sq = tl.zeros([BM], dtype=tl.float32)
                for k in tl.static_range(CHUNKS):  # fixed order: the same sums whatever finished first
                    dots += tl.load(part_dots + k * tiles * BS * BM + dot_offs, cache_modifier=".cg")
                    sq += tl.load(part_sq + (k * tiles + tile) * BM + tl.arange(0, BM), cache_modifier=".cg")
                tl.atomic_xchg(counters + tile, 0, sem="relaxed", scope="gpu")  # ready for the next launch
        if last:
            logits = dots * tl.rsqrt(sq / D + eps)[None, :]
            ok = (sites < S)[:, None] & (rows < M)[None, :]
            tl.store(out + sites[:, None] * stride_os + rows[None, :], logits, mask=ok)


def _counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed tile counters that the kernel leaves zeroed: the split kernels' shared ones (`split_scratch`:
    outgrown counters stay allocated for the graphs captured with them, and none is sized inside a capture)."""
    return split_scratch(0, tiles, device)[1]


def attnres_block_logits(queries: torch.Tensor, block: torch.Tensor, norm_weights: torch.Tensor | None = None,
                         eps: float = 1e-6, out: torch.Tensor | None = None, rows: int | None = None,
                         sites: int | None = None, block_d: int = 64, chunks: int | None = None,
                         num_warps: int = 4, parts: torch.Tensor | None = None,
                         copy_to: torch.Tensor | None = None) -> torch.Tensor:
    """queries [S, D] (and key-norm weights [S, D]) of later sites, one block [..., D] -> logits [S, ...]
    float32 = k3core.ops.attnres.attnres_logits(queries, block[None], norm_weights)[:, 0].
    `out`: where to write them ([S, ...] float32 with dense rows, e.g. one block's column of a logit cache).
    `parts`: `query_parts.query_parts(queries, norm_weights)` (or its [:, first:] slice for queries[first:]),
    cut once ahead (used for bf16 blocks).
    Tuning: `rows` / `sites` per program (None: 64 / up to 64 at prefill-sized M, 16 rows at decode),
    `block_d` the D step, `chunks` the D chunks (None: about two programs per SM).
    `copy_to`: a dense tensor shaped like `block` (e.g. its slot in a buffer of completed blocks) that gets a
    copy of the block: with `parts` and D chunks (decode) from the block tiles the kernel loads anyway (no
    launch of its own), otherwise by torch first."""
    S, D = queries.shape[0], block.shape[-1]
    require(queries.dim() == 2 and queries.shape[1] == D, f"queries must be [S, {D}], got {tuple(queries.shape)}")
    require(norm_weights is None or norm_weights.shape == queries.shape, f"norm_weights must be [{S}, {D}]")
    require(block.dtype != torch.float64 and queries.dtype != torch.float64, "float64 takes the reference")
    M, sms = block[..., 0].numel(), sm_count(block.device, cpu=132)
    if out is None:
        out = torch.empty(S, *block.shape[:-1], dtype=torch.float32, device=block.device)
    require(out.dtype == torch.float32 and out.shape == (S, *block.shape[:-1]),
            f"out must be float32 [{S}, {', '.join(map(str, block.shape[:-1]))}]")
    require(out.is_contiguous() or out[0].is_contiguous(), "out must be dense along the rows")
    flat_out = out.view(S, M)
    BM = rows or (64 if M >= 32 * sms else 16)  # H200, M=8192: 64 rows 0.11 ms, 32 rows 0.25 ms
    BS = sites or min(64, max(16, next_pow2(S)))
    for name, value in (("rows", BM), ("sites", BS)):
        require(value >= 16 and value == next_pow2(value), f"{name} must be a power of two >= 16, got {value}")
    BD = min(block_d, next_pow2(D))
    grid_tiles = (triton.cdiv(M, BM), triton.cdiv(S, BS))
    tiles = grid_tiles[0] * grid_tiles[1]
    n_chunks = chunks or _chunks(tiles, D, BD, sms)
    chunk = triton.cdiv(triton.cdiv(D, n_chunks), BD) * BD
    n_chunks = triton.cdiv(D, chunk)
    part_dots = torch.empty(n_chunks * tiles * BS * BM if n_chunks > 1 else 0, dtype=torch.float32,
                            device=block.device)
    part_sq = torch.empty(n_chunks * tiles * BM if n_chunks > 1 else 0, dtype=torch.float32, device=block.device)
    q = queries.contiguous()
    flat = block.reshape(M, D).contiguous()
    split = split_mode(flat.dtype)
    if parts is not None:
        P = query_part_count(queries, norm_weights)
        require(parts.dtype == torch.bfloat16 and parts.shape == (P, S, D) and parts[0].is_contiguous(),
                f"parts must be bf16 [{P}, {S}, {D}], each part dense (query_parts.query_parts, or a slice of it)")
    use_parts = parts is not None and split != 0  # other blocks take 3xTF32 on q_eff
    # The copy rides the parts loop of a D-chunked (decode-sized) launch, where a copy launch of its own is
    # mostly latency (H200: 1.5 us a block at M=64). Unchunked (prefill) it would take the kernel from 96 to
    # 140 registers at 64-row tiles (sm_90a), not timed: there torch copies first.
    fused_copy = copy_to is not None and use_parts and n_chunks > 1
    if copy_to is not None:
        require(copy_to.shape == block.shape and copy_to.dtype == block.dtype and copy_to.is_contiguous(),
                f"copy_to must be a contiguous {block.dtype} tensor shaped {tuple(block.shape)}")
        if not fused_copy:
            copy_to.copy_(block)
    counters = _counters(block.device, tiles if n_chunks > 1 else 1)  # unchunked, the kernel counts nothing
    _block_logits_kernel[(*grid_tiles, n_chunks)](
        q, norm_weights.contiguous() if norm_weights is not None else q, parts if use_parts else q, flat,
        copy_to if fused_copy else flat, flat_out, part_dots, part_sq, counters, S, M, D, chunk,
        parts.stride(0) if use_parts else 0, flat_out.stride(0), eps, CHUNKS=n_chunks,
        HAS_NORM_W=norm_weights is not None, PARTS=parts.shape[0] if use_parts else 0, SPLIT=split,
        COPY=fused_copy, BM=BM, BS=BS, BD=BD, num_warps=num_warps,
    )
    return out
