"""A decode step's projection GEMM at few rows (M <= 64): out = x @ W^T, or residual += x @ W^T in place.

Why: at batch 64 a projection is a weight read, and cuBLAS streams `mini`'s 8-10 MB output GEMMs at ~1.4
TB/s of a 4.2 TB/s copy on the H200 (bench.serve's profile).
Layout (swap-AB): each program multiplies one [BLOCK_N, K / SPLITS] block of W by x^T, so the weight is the
MMA's wide side and the few token rows its narrow one; N tiles x K splits give about one program per SM.
Unlike an earlier split-K attempt, nothing along K is masked: the launcher requires K % (SPLITS * BLOCK_K)
== 0 (shapes come from the model config), so every load is a 16-byte cp.async the pipeliner keeps
`num_stages` deep. Rows past M and, when N % BLOCK_N != 0, columns past N are masked per row only, which
keeps the loads vectorised along K.
Splits: each program parks its float32 tile in `split_scratch`; the last to arrive at the tile's counter
sums the partials in split order (deterministic), adds the residual, rounds once to the output dtype (as
cuBLAS's beta-add epilogue does) and resets the counter.
Measured (docs/serving.md "Measured" item 10): unsplit it streams at 3.1-3.4 TB/s and beats cuBLAS slightly
on the wide KDA input GEMM; split, the partials and the reduction tail cost more than the split gains, so
cuBLAS stays faster on the output GEMMs. `skinny_linear` takes this kernel only for the shapes in ROUTES.
Session 8 (item 15 there) tried the splits summed by float32 atomics into a self-cleaning L2 tile and wider
or narrower N tiles: 0.2-0.5 us faster than the split-order sum at 48-64 rows, still 0.6-1.4 us behind
cuBLAS on the output GEMMs (and tied at 16 rows, where the reduction is small), so removed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels._triton import next_pow2, require, tl, triton
from kernels.fused.naive import skinny_linear as torch_linear
from kernels.fused.split_scratch import split_scratch

MAX_ROWS = 64

if triton is not None:

    @triton.jit
    def _finish(acc, res, out, rows, cols, tile_ok, stride_rm, stride_om, HAS_RES: tl.constexpr):
        """acc [BLOCK_N, BLOCK_M] (+ residual) -> out, rounded once."""
        if HAS_RES:
            acc += tl.load(res + rows[None, :] * stride_rm + cols[:, None], mask=tile_ok, other=0.0).to(tl.float32)
        tl.store(out + rows[None, :] * stride_om + cols[:, None], acc.to(out.dtype.element_ty), mask=tile_ok)

    @triton.jit
    def _skinny_gemm_kernel(x, w, res, out, partials, counters, M, N, K_SPLIT, stride_xm, stride_wn, stride_rm,
                            stride_om, SPLITS: tl.constexpr, HAS_RES: tl.constexpr, EVEN_N: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_n, split = tl.program_id(0), tl.program_id(1)
        rows = tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = split * K_SPLIT + tl.arange(0, BLOCK_K)
        row_ok, col_ok = rows < M, cols < N
        w_at = w + cols[:, None] * stride_wn + ks[None, :]  # [BLOCK_N, BLOCK_K]
        x_at = x + rows[None, :] * stride_xm + ks[:, None]  # x^T: [BLOCK_K, BLOCK_M]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for _ in range(0, K_SPLIT, BLOCK_K):
            if EVEN_N:
                weight = tl.load(w_at)
            else:
                weight = tl.load(w_at, mask=col_ok[:, None], other=0.0)
            acc = tl.dot(weight, tl.load(x_at, mask=row_ok[None, :], other=0.0), acc, input_precision="ieee")
            w_at += BLOCK_K
            x_at += BLOCK_K
        tile_ok = row_ok[None, :] & col_ok[:, None]
        if SPLITS == 1:
            _finish(acc, res, out, rows, cols, tile_ok, stride_rm, stride_om, HAS_RES)
        else:
            local = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + rows[None, :]
            tile_partials = partials + pid_n * (SPLITS * BLOCK_N * BLOCK_M)
            tl.store(tile_partials + split * (BLOCK_N * BLOCK_M) + local, acc)
            tl.debug_barrier()  # every thread's partial is written before the release below
            arrived = tl.atomic_add(counters + pid_n, 1)  # acq_rel: the siblings' partials happen before
            if arrived == SPLITS - 1:  # the last program of the tile finishes it
                total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
                for s in tl.static_range(SPLITS):  # in split order: the sum does not depend on who came last
                    # .cg: the siblings' partials from L2, never a stale L1 line
                    total += tl.load(tile_partials + s * (BLOCK_N * BLOCK_M) + local, cache_modifier=".cg")
                tl.atomic_xchg(counters + pid_n, 0)  # ready for the next launch
                _finish(total, res, out, rows, cols, tile_ok, stride_rm, stride_om, HAS_RES)


class Tiling(NamedTuple):
    block_n: int
    block_k: int
    splits: int
    num_warps: int = 4
    num_stages: int = 4


# (N, K, BLOCK_M) of `mini`'s decode projections (services.engine.fast_decoder.distinct_projections) -> the
# tiling measured faster than cuBLAS on the H200 (bench.serve_glue --groups skinny;
# bench/results/serve_glue_skinny.json and docs/serving.md "Measured"), at 16 rows for the 16-row tile and
# at 48 and 64 rows for the 64-row one. Routed only for rows in the upper
# half of a tile (9-16, 33-64: the measured side); everything else stays on cuBLAS, which won at every other
# projection (the K-split output GEMMs by 1.2-1.3x: their reduction tail costs more than the split gains).
# us at 16 / 48 / 64 rows, ours vs cuBLAS: KDA input 10.2 / 10.8 / 10.9 vs 11.3 / 11.7 / 11.1; KDA f_b 2.2 /
# 2.3 / 2.4 vs 2.6 / 2.7 / 2.6; MLP down + residual 9.3 / 10.6 / 10.7 vs 10.6 / 11.2 / 10.9.
ROUTES: dict[tuple[int, int, int], Tiling] = {
    **{(8336, 2048, m): Tiling(64, 128, 1) for m in (16, 64)},
    **{(2048, 128, m): Tiling(64, 128, 1, num_stages=3) for m in (16, 64)},
    **{(2048, 5632, m): Tiling(64, 128, 4) for m in (16, 64)},
}


def block_rows(rows: int) -> int:
    """The token tile of `rows` rows (the MMA's narrow side: 16 at least)."""
    return max(16, next_pow2(rows))


MAX_SPLITS = 8  # the last program of a tile reads every split's float32 partial: many splits make a long tail


def most_splits(n: int, k: int, block_n: int, block_k: int, programs: int, max_splits: int = 4) -> int:
    """The most K splits (whole block_k steps each, at most `max_splits`) with N tiles x splits <= `programs`."""
    steps, tiles = k // block_k, triton.cdiv(n, block_n)
    fits = [s for s in range(1, min(steps, max_splits) + 1) if steps % s == 0 and tiles * s <= programs]
    return max(fits or [1])


def default_tiling(n: int, k: int, sms: int = 132) -> Tiling:
    """64-wide N tiles, 128-deep K steps where K allows, 4 stages (128 KiB of shared memory: one program per
    SM), split up to 4 ways within one program per SM."""
    block_k = 128 if k % 128 == 0 else 64
    return Tiling(64, block_k, most_splits(n, k, 64, block_k, sms))


def candidate_tilings(n: int, k: int, sms: int = 132) -> list[Tiling]:
    """What bench.serve_glue times: the default and it with 6 stages; 32-wide N tiles and 3 stages (two
    programs per SM); 64-wide with 3 stages and up to 8 splits (two per SM); 128-wide with 8 warps (one per
    SM); 64-deep K steps with 6 stages; at most 2 splits (a short reduction tail) with 32- and 64-wide N
    tiles; the ones that do not divide K left out."""
    default = default_tiling(n, k, sms)
    found = [default, default._replace(num_stages=6)]
    if k % 128 == 0:
        found += [Tiling(32, 128, most_splits(n, k, 32, 128, 2 * sms), num_stages=3),
                  Tiling(64, 128, most_splits(n, k, 64, 128, 2 * sms, MAX_SPLITS), num_stages=3),
                  Tiling(128, 128, most_splits(n, k, 128, 128, sms), num_warps=8),
                  Tiling(32, 128, most_splits(n, k, 32, 128, sms, 2)),
                  Tiling(64, 128, most_splits(n, k, 64, 128, sms, 2))]
    found.append(Tiling(64, 64, most_splits(n, k, 64, 64, sms), num_stages=6))
    return list(dict.fromkeys(t for t in found if k % (t.splits * t.block_k) == 0))


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None,
                tiling: Tiling | None = None) -> torch.Tensor:
    """The Triton kernel itself: x [M <= 64, K] (row-strided allowed), weight [N, K] -> x @ weight^T [M, N] in
    x's dtype, or `residual` [M, N] += x @ weight^T in place (returned); float32 accumulation rounded once."""
    require(x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1],
            f"x must be [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    require(x.stride(1) == 1 and weight.stride(1) == 1, "x and weight need a unit stride along K")
    require(x.dtype == weight.dtype, f"x and weight must share a dtype, got {x.dtype} and {weight.dtype}")
    (rows, depth), n = x.shape, weight.shape[0]
    require(rows <= MAX_ROWS, f"x has {rows} rows, the skinny GEMM takes at most {MAX_ROWS}")
    tiling = tiling or default_tiling(n, depth)
    require(depth % (tiling.splits * tiling.block_k) == 0,
            f"K={depth} must be a multiple of splits x block_k = {tiling.splits} x {tiling.block_k}")
    if residual is not None:
        require(residual.shape == (rows, n) and residual.stride(1) == 1 and residual.dtype == x.dtype,
                f"residual must be [{rows}, {n}] {x.dtype} with a unit column stride, got "
                f"{tuple(residual.shape)} {residual.dtype}")
    out = residual if residual is not None else torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block_m, tiles = block_rows(rows), triton.cdiv(n, tiling.block_n)
    partials, counters = out, out  # unused without a split: no scratch (nothing to size before a graph capture)
    if tiling.splits > 1:
        partials, counters = split_scratch(tiles * tiling.splits * tiling.block_n * block_m, tiles, x.device)
    _skinny_gemm_kernel[(tiles, tiling.splits)](
        x, weight, out, out, partials, counters, rows, n, depth // tiling.splits, x.stride(0), weight.stride(0),
        out.stride(0), out.stride(0), SPLITS=tiling.splits, HAS_RES=residual is not None,
        EVEN_N=n % tiling.block_n == 0, BLOCK_M=block_m, BLOCK_N=tiling.block_n, BLOCK_K=tiling.block_k,
        num_warps=tiling.num_warps, num_stages=tiling.num_stages)
    return out


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as kernels.fused.naive.skinny_linear: the Triton kernel for a routed (N, K, BLOCK_M) with
    rows in the tile's upper half, cuBLAS otherwise."""
    rows = x.shape[0]
    routed = rows <= MAX_ROWS and 2 * rows > block_rows(rows)
    tiling = ROUTES.get((*weight.shape, block_rows(rows))) if routed else None
    if tiling is None or x.stride(1) != 1 or weight.stride(1) != 1 or x.dtype != weight.dtype:
        return torch_linear(x, weight, residual)
    return skinny_gemm(x, weight, residual, tiling)

