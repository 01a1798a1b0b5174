"""Paged MLA decode on the latent cache with split-KV (FlashDecoding-style), weight-absorbed queries.

Every head of a sequence attends to the same latent rows [c_kv (R) | k_pe (P)], so one program loads a tile
of rows once and scores all heads against it with tensor-core dots (MQA in latent space). Long contexts are
cut into NUM_SPLITS ranges per sequence so that even a small batch fills the GPU; a second kernel merges the
per-split partial outputs through their log-sum-exp. The pool can hand over any view of [num_pages,
page_tokens, R + P]: when the page size is a multiple of the tile (32 rows), a tile is BN consecutive rows
of one page, found with one page-table read (48 -> 60 % of copy bandwidth at B=64, 4K; 59 -> 80 % at 64K);
otherwise rows are gathered token by token through the page table. The latent (512) and rope (64) parts
are separate tiles, so no row is padded to a power of two.

Pipelining (Triton 3.6, the device's): a tile's loads depend on a page-table load, and the pipeliner spends
one stage per level of that chain, so up to 4 stages give the tile one buffer (tile i+1's copy is issued after
tile i's dots), 5 stages two. The default, 32-row tiles with 5 stages, holds two tiles in flight per program in
93 KB, two programs per SM: 4 splits at B=64 are one wave (docs/kernels.md, MLA history, session 9).
"""

from __future__ import annotations

import math

import torch

from kernels._triton import next_pow2, require, tl, triton

if triton is not None:

    @triton.jit
    def _mla_split_kernel(
        q, cache, page_table, lengths, o_part, lse_part,
        H, max_pages, page_tokens, page_stride, row_stride, sm_scale_log2,
        NUM_SPLITS: tl.constexpr, R: tl.constexpr, P: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
        TOKENS_MAJOR: tl.constexpr, PAGE_TILES: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1)
        heads = tl.arange(0, BH)
        offs_r = tl.arange(0, R)
        offs_p = tl.arange(0, P)
        length = tl.load(lengths + b)
        chunk = tl.cdiv(tl.cdiv(length, NUM_SPLITS), BN) * BN
        start = split * chunk
        end = tl.minimum(start + chunk, length)
        q_rows = q + (b * H + heads[:, None]) * (R + P)
        head_ok = heads[:, None] < H
        q_lat = tl.load(q_rows + offs_r[None, :], mask=head_ok, other=0.0)
        q_pe = tl.load(q_rows + R + offs_p[None, :], mask=head_ok, other=0.0)
        m = tl.full([BH], float("-inf"), dtype=tl.float32)
        denom = tl.zeros([BH], dtype=tl.float32)
        if TOKENS_MAJOR:
            acc_t = tl.zeros([R, BH], dtype=tl.float32)
        else:
            acc = tl.zeros([BH, R], dtype=tl.float32)
        for n0 in range(start, end, BN):
            n = n0 + tl.arange(0, BN)
            valid = n < end
            if PAGE_TILES:
                # The tile lies inside one page: one page-table read, BN consecutive rows of that page.
                page = tl.load(page_table + b * max_pages + n0 // page_tokens).to(tl.int64)
                rows = cache + page * page_stride + (n0 % page_tokens + tl.arange(0, BN)) * row_stride
            else:
                page = tl.load(page_table + b * max_pages + n // page_tokens, mask=valid, other=0).to(tl.int64)
                rows = cache + page * page_stride + (n % page_tokens) * row_stride
            kv = tl.load(rows[:, None] + offs_r[None, :], mask=valid[:, None], other=0.0)
            kpe = tl.load(rows[:, None] + R + offs_p[None, :], mask=valid[:, None], other=0.0)
            if TOKENS_MAJOR:
                # Scores as [tokens, heads]: the tile's BN rows are the MMA's M side (wgmma-sized) and
                # the few heads its N side, instead of a 16-row M that only fits the older mma path.
                s = tl.dot(kv, tl.trans(q_lat)) + tl.dot(kpe, tl.trans(q_pe))
                s = tl.where(valid[:, None], s * sm_scale_log2, float("-inf"))
                m_new = tl.maximum(m, tl.max(s, 0))
                alpha = tl.exp2(m - m_new)
                p = tl.exp2(s - m_new[None, :])
                denom = denom * alpha + tl.sum(p, 0)
                acc_t = acc_t * alpha[None, :] + tl.dot(tl.trans(kv), p.to(kv.dtype))
            else:
                s = tl.dot(q_lat, tl.trans(kv)) + tl.dot(q_pe, tl.trans(kpe))
                s = tl.where(valid[None, :], s * sm_scale_log2, float("-inf"))
                m_new = tl.maximum(m, tl.max(s, 1))
                alpha = tl.exp2(m - m_new)
                p = tl.exp2(s - m_new[:, None])
                denom = denom * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv)
            m = m_new
        if TOKENS_MAJOR:
            acc = tl.trans(acc_t)
        out = (b * NUM_SPLITS + split) * H + heads
        has_rows = denom > 0
        o = acc / tl.where(has_rows, denom, 1.0)[:, None]
        tl.store(o_part + out[:, None] * R + offs_r[None, :], o, mask=head_ok)
        lse = tl.where(has_rows, m + tl.log2(tl.where(has_rows, denom, 1.0)), float("-inf"))
        tl.store(lse_part + out, lse, mask=heads < H)

    @triton.jit
    def _mla_combine_kernel(o_part, lse_part, o, H, NUM_SPLITS: tl.constexpr, BS: tl.constexpr,
                            R: tl.constexpr, CHUNK: tl.constexpr):
        """Merge the splits of one (sequence, head) by their LSE, CHUNK partial rows at a time."""
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        offs_r = tl.arange(0, R)
        lse = tl.load(lse_part + (b * NUM_SPLITS + tl.arange(0, BS)) * H + h, mask=tl.arange(0, BS) < NUM_SPLITS,
                      other=float("-inf"))
        top = tl.max(lse, 0)
        total = tl.sum(tl.where(lse > float("-inf"), tl.exp2(lse - top), 0.0), 0)
        res = tl.zeros([R], dtype=tl.float32)
        for s0 in range(0, NUM_SPLITS, CHUNK):
            rows = (b * NUM_SPLITS + s0 + tl.arange(0, CHUNK)) * H + h
            ok = s0 + tl.arange(0, CHUNK) < NUM_SPLITS
            part_lse = tl.load(lse_part + rows, mask=ok, other=float("-inf"))
            w = tl.where(part_lse > float("-inf"), tl.exp2(part_lse - top), 0.0)
            parts = tl.load(o_part + rows[:, None] * R + offs_r[None, :], mask=ok[:, None], other=0.0)
            res += tl.sum(parts * w[:, None], 0)
        tl.store(o + (b * H + h) * R + offs_r, (res / total).to(o.dtype.element_ty))


def default_splits(batch: int, capacity: int, block: int, sms: int = 132) -> int:
    """About two (sequence, split) programs per SM, rounded to a power of two (measured best on the H200, where
    two programs fit an SM: 4 splits at B=64 for 1K-64K, 16 at B=16), then capped at capacity // (4 * block)
    so that no split has fewer than 4 tiles: a capped count need not be a power of two (3 sequences over 640
    tokens in 32-row tiles: 5 splits)."""
    wanted = 1 << max(0, round(math.log2(2 * sms / batch)))
    return max(1, min(wanted, capacity // (4 * block)))


def mla_decode_paged(
    q: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor, lengths: torch.Tensor, scale: float,
    latent_dim: int = 512, num_splits: int | None = None, block_n: int = 32, num_warps: int = 4,
    num_stages: int = 5, tokens_major: bool = False, page_tiles: bool | None = None,
) -> torch.Tensor:
    """q [B, H, R+P] (absorbed q_nope W_uk | q_pe); cache [num_pages, page_tokens, R+P]; page_table
    [B, max_pages] int; lengths [B] int (tokens cached per sequence, >= 1). Returns the latent-space output
    softmax(scale * q . row) . c_kv as [B, H, R] in q's dtype (the caller applies W_uv and the gate)."""
    B, H, width = q.shape
    R, P = latent_dim, width - latent_dim
    require(cache.dim() == 3 and cache.shape[-1] == width, f"cache must be [pages, tokens, {width}], got "
            f"{tuple(cache.shape)}")
    require(cache.stride(-1) == 1 and q.is_contiguous(), "cache rows and q must be contiguous")
    require(R == next_pow2(R) and P == next_pow2(P), f"latent ({R}) and rope ({P}) dims must be powers of two")
    require(page_table.dim() == 2 and page_table.shape[0] == B, f"page_table must be [{B}, max_pages]")
    require(lengths.shape == (B,), f"lengths must be [{B}], got {tuple(lengths.shape)}")
    capacity = page_table.shape[1] * cache.shape[1]
    splits = num_splits or default_splits(B, capacity, block_n)
    # Tiles start at multiples of block_n (split chunks are rounded to it), so a page size that is a
    # multiple of the tile keeps every tile inside one page: one page-table read per tile, not per row.
    tiles_in_pages = cache.shape[1] % block_n == 0
    require(not page_tiles or tiles_in_pages, f"page_tiles needs page_tokens ({cache.shape[1]}) to be a "
            f"multiple of block_n ({block_n})")
    page_tiles = tiles_in_pages if page_tiles is None else page_tiles
    o_part = torch.empty(B, splits, H, R, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(B, splits, H, dtype=torch.float32, device=q.device)
    _mla_split_kernel[(B, splits)](
        q, cache, page_table, lengths, o_part, lse_part,
        H, page_table.shape[1], cache.shape[1], cache.stride(0), cache.stride(1), scale * math.log2(math.e),
        NUM_SPLITS=splits, R=R, P=P, BH=max(16, next_pow2(H)), BN=block_n, TOKENS_MAJOR=tokens_major,
        PAGE_TILES=page_tiles, num_warps=num_warps, num_stages=num_stages,
    )
    o = torch.empty(B, H, R, dtype=q.dtype, device=q.device)
    _mla_combine_kernel[(B, H)](o_part, lse_part, o, H, NUM_SPLITS=splits, BS=next_pow2(splits), R=R,
                                CHUNK=min(8, next_pow2(splits)))
    return o
