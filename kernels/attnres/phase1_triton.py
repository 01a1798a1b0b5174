"""Block AttnRes: a block completes and the next phase 1 runs, in one launch (opt-in; measured slower).

In serving order (services/engine/fast_decoder.py) a completed block's logits against every later site go
into the logit cache (`block_logits_triton`) and the phase 1 that follows softmaxes the cached logits of
all completed blocks (`inter_triton`'s apply kernel). At decode the logits pass is a dependent launch of
~7 us (latency: one wave of loads, then the D chunks' reduction) in front of a ~15 us apply. Here one
launch does both, with the same jitted functions (so the same numbers, bit for bit). On the H200 it is
slower at decode than the two launches (29.3 vs 22.8 us at K3's last block, B=64; 251 vs 220 us for a K3
forward's nine phases) and equal at prefill, so serving keeps the two launches (docs/kernels.md, AttnRes
history 24); it stays for the next attempt (`bench.kernels --only attnres_phase1` times both). The form:
- every program takes a ticket from an atomic counter as it starts; the first tickets do one logits work
  item each (rows tile x sites tile x D chunk), those of this phase's own sites first; the later tickets
  one apply work item each (rows tile x D chunk), after waiting until the logits items of this phase's
  sites are done. Tickets follow start order, so a waiting program only waits for programs that have
  started (every logits ticket is lower than its own) and that wait for nothing: no deadlock, whatever the
  GPU schedules and however few programs fit. (Were a program to do a logits item and then wait, more
  logits items than fit on the GPU at once would deadlock: the first wave waits for items that no slot
  is left to run; it hung on the H200 at 514 items);
- the logits of later phases' sites and the copy of the block into the block buffer (`copy=True`) are
  not waited for (the apply reads the newest block from its source);
- the last program to finish sets the counters back to zero for the next launch.
Under the interpreter, whose programs run one after another, the two roles run as two launches.
"""

from __future__ import annotations

import os

import torch

from k3core.ops.attnres import OnlineSoftmax
from kernels._triton import require, tl, triton
from kernels.attnres.block_logits_triton import _block_logits_tile, _counters, plan_block_logits
from kernels.attnres.inter_triton import _apply_tile, plan_inter

SYNC_COUNTERS = 3  # tickets, finished logits items of this phase's sites, finished programs

if triton is not None:

    @triton.jit
    def _copy_tile(src, dst, tile_m, c, M, D, CHUNK, BM: tl.constexpr, BD: tl.constexpr):
        """dst[rows tile tile_m, D chunk c] = src[...] (both [M, D] dense)."""
        rows = tile_m.to(tl.int64) * BM + tl.arange(0, BM)
        for d0 in range(c * CHUNK, tl.minimum(c * CHUNK + CHUNK, D), BD):
            d = d0 + tl.arange(0, BD)
            ok = (rows < M)[:, None] & (d < D)[None, :]
            offs = rows[:, None] * D + d[None, :]
            tl.store(dst + offs, tl.load(src + offs, mask=ok), mask=ok)

    @triton.jit
    def _phase1_kernel(queries, norm_w, parts, block, new_logits, part_dots, part_sq, counters, S, M, D, CHUNK_A,
                       stride_p, stride_os, eps, blocks, given, acc_out, max_out, denom_out, N, Q, CHUNK_B,
                       stride_gq, stride_gn, sync, copy_to, tiles_m, tiles_s, wait_s, b_rows, programs,
                       ROLE: tl.constexpr, COPY: tl.constexpr, CHUNKS_A: tl.constexpr, HAS_NORM_W: tl.constexpr,
                       PARTS: tl.constexpr, SPLIT: tl.constexpr, BM_A: tl.constexpr, BS: tl.constexpr,
                       BD_A: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BQ: tl.constexpr, BD: tl.constexpr,
                       STREAM_STORES: tl.constexpr):
        """ROLE 0: both roles, by ticket; 1: the logits items alone, 2: the apply items alone (interpreter)."""
        if ROLE == 0:
            ticket = tl.atomic_add(sync, 1, sem="relaxed", scope="gpu")
        else:
            ticket = tl.program_id(0)
        per_site_tile = tiles_m * CHUNKS_A
        logits_items = tiles_s * per_site_tile
        if ROLE != 2:
            if ticket < logits_items:  # sites tile slowest: this phase's sites come first
                tile_s = ticket // per_site_tile
                tile_m = ticket % per_site_tile // CHUNKS_A
                c = ticket % CHUNKS_A
                _block_logits_tile(queries, norm_w, parts, block, new_logits, part_dots, part_sq, counters, tile_m,
                                   tile_s, c, tiles_s, tiles_m * tiles_s, S, M, D, CHUNK_A, stride_p, stride_os, eps,
                                   CHUNKS_A, HAS_NORM_W, PARTS, SPLIT, BM_A, BS, BD_A)
                if ROLE == 0:
                    if tile_s < wait_s:
                        tl.debug_barrier()  # every thread's logit stores precede the release
                        tl.atomic_add(sync + 1, 1, sem="release", scope="gpu")
                if COPY and tile_s == 0:
                    _copy_tile(block, copy_to, tile_m, c, M, D, CHUNK_A, BM_A, BD_A)
        if ROLE != 1:
            item = ticket - logits_items if ROLE == 0 else ticket  # ROLE 0: the tickets after the logits items
            if item >= 0:
                if ROLE == 0:
                    # acquire: the loads below come after the stores the logits items released
                    while tl.atomic_add(sync + 1, 0, sem="acquire", scope="gpu") < wait_s * per_site_tile:
                        pass
                _apply_tile(queries, norm_w, blocks, block, part_dots, part_sq, given, acc_out, max_out, denom_out,
                            item % b_rows, item // b_rows, N, Q, M, D, CHUNK_B, stride_gq, stride_gn, eps, False,
                            True, 1, HAS_NORM_W, SPLIT, BM, BN, BQ, BD, BD, STREAM_STORES, True)
        if ROLE == 0:
            tl.debug_barrier()
            if tl.atomic_add(sync + 2, 1, sem="acq_rel", scope="gpu") == programs - 1:  # everyone is past the wait
                tl.atomic_xchg(sync, 0, sem="relaxed", scope="gpu")
                tl.atomic_xchg(sync + 1, 0, sem="relaxed", scope="gpu")
                tl.atomic_xchg(sync + 2, 0, sem="relaxed", scope="gpu")


def attnres_inter_with_newest(later_queries: torch.Tensor, block: torch.Tensor, blocks: torch.Tensor,
                              logits: torch.Tensor, later_norm_weights: torch.Tensor | None = None, eps: float = 1e-6,
                              sites: int | None = None, parts: torch.Tensor | None = None, copy: bool = False,
                              logits_rows: int | None = None, logits_block_d: int = 64,
                              logits_chunks: int | None = None, apply_rows: int = 2, apply_block_d: int = 128,
                              apply_chunks: int | None = None, num_warps: int = 4) -> OnlineSoftmax:
    """A block completes, then phase 1 of the first `sites` (None: all) of the sites after it, in one launch,
    with the same results as the launches
        blocks[N - 1].copy_(block)                     # only with copy=True
        attnres_block_logits(later_queries, block, later_norm_weights, eps, out=logits[:, N - 1], parts=parts)
        return attnres_inter(later_queries[:sites], blocks, later_norm_weights[:sites], eps, logits=logits[:sites])
    later_queries / later_norm_weights [S, D]: the sites after the block (this phase's first); block [..., D];
    blocks [N, ..., D] contiguous, the completed blocks, the newest last (without `copy`, blocks[N - 1] must
    already hold it); logits [S, N, ...] float32 with dense rows: the logit cache's rows of those sites
    (columns < N - 1 read, column N - 1 written); parts: `query_parts` of the later sites.
    Tuning: `logits_*` as `attnres_block_logits`' rows / block_d / chunks, `apply_*` as `attnres_inter`'s
    apply_rows / apply_block_d / chunks[1]."""
    S, N = later_queries.shape[0], blocks.shape[0]
    Q = S if sites is None else sites
    require(1 <= Q <= S, f"sites must be in 1..{S} (the later sites), got {sites}")
    require(blocks.shape[1:] == block.shape and blocks.dtype == block.dtype and blocks.is_contiguous(),
            f"blocks must be contiguous [N, {', '.join(map(str, block.shape))}] of the block's dtype")
    require(logits.dim() >= 2 and logits.shape[:2] == (S, N) and logits[0, 0].is_contiguous(),
            f"logits must be float32 [{S}, {N}, ...] (sites, blocks) with dense rows")
    logits_plan, _ = plan_block_logits(later_queries, block, later_norm_weights, eps, logits[:, N - 1], logits_rows,
                                       None, logits_block_d, logits_chunks, parts, extra_counters=SYNC_COUNTERS)
    weights = later_norm_weights[:Q] if later_norm_weights is not None else None
    apply = plan_inter(later_queries[:Q], blocks, weights, eps, num_warps=num_warps, apply_rows=apply_rows,
                       apply_block_d=apply_block_d, chunks=(1, apply_chunks) if apply_chunks else None,
                       logits=logits[:Q])
    sync = _counters(block.device, SYNC_COUNTERS)[:SYNC_COUNTERS]  # the scratch the plan above sized
    M, D = apply.blocks.shape[1:]
    acc = torch.empty(Q, M, D, dtype=torch.float32, device=block.device)
    top = torch.empty(Q, M, dtype=torch.float32, device=block.device)
    denom = torch.empty_like(top)
    tiles_m, tiles_s = logits_plan.tiles
    wait_s = triton.cdiv(Q, logits_plan.consts["BS"])  # the sites tiles holding this phase's sites
    b_rows, b_chunks = apply.apply_grid
    stats_args = (apply.blocks, apply.given, acc, top, denom, N, Q, apply.apply_chunk, *apply.given.stride()[:2], sync,
                  blocks[N - 1].view(M, D), tiles_m, tiles_s, wait_s, b_rows)
    c = logits_plan.consts
    consts = {"COPY": copy, "CHUNKS_A": c["CHUNKS"], "HAS_NORM_W": c["HAS_NORM_W"], "PARTS": c["PARTS"],
              "SPLIT": c["SPLIT"], "BM_A": c["BM"], "BS": c["BS"], "BD_A": c["BD"], "BM": apply.consts["BM"],
              "BN": apply.consts["BN"], "BQ": apply.consts["BQ"], "BD": apply.consts["BD"],
              "STREAM_STORES": apply.stream_stores}
    items = (tiles_m * tiles_s * logits_plan.chunks, b_rows * b_chunks)
    if os.environ.get("TRITON_INTERPRET") == "1":  # programs run in order: a waiting one would wait forever
        for role, programs in ((1, items[0]), (2, items[1])):
            _phase1_kernel[(programs,)](*logits_plan.args, *stats_args, programs, ROLE=role, **consts,
                                        num_warps=num_warps)
    else:
        programs = sum(items)
        _phase1_kernel[(programs,)](*logits_plan.args, *stats_args, programs, ROLE=0, **consts, num_warps=num_warps)
    rows = tuple(block.shape[:-1])
    return OnlineSoftmax(top.reshape(Q, *rows), denom.reshape(Q, *rows), acc.reshape(Q, *rows, D))
