"""Block AttnRes merge + RMSNorm, and fused SiTU-GLU, on the H200: ours vs the torch composition."""

from __future__ import annotations

from functools import partial

import torch

from k3core.ops.attnres import attnres_inter
from kernels._triton import tl, triton
from kernels.attnres import inter_triton, merge_norm_triton
from kernels.attnres import naive as attnres_naive
from kernels.moe import naive as moe_naive
from kernels.moe import situ_glu_triton
from kernels.perf.harness import Row, max_err, rel_err, time_ms

D, BLOCKS, SITES = 7168, 8, 24
BF16 = torch.bfloat16


MERGE_VARIANTS = (4,)  # num_warps (8: same at decode, 93 vs 98 % at prefill)
# Phase 1 launcher arguments timed per shape (decode: M=64; prefill: the rest); {} is the default. The
# defaults combine the winners of the last run's variants (docs/kernels.md, AttnRes history).
INTER_VARIANTS = {
    "decode": ({}, {"stream_stores": False}, {"score_rows": 16}, {"chunks": (14, 9)}),
    "prefill": ({}, {"stream_stores": False, "score_rows": 8}, {"score_rows": 32}, {"fused": True}),
}


@triton.jit
def _empty_kernel(x):
    tl.store(x + tl.program_id(0), 0)


def launch_floor_rows() -> list[Row]:
    """The time of an empty kernel launch in the same harness: the floor under any decode-sized kernel."""
    x = torch.empty(132, device="cuda", dtype=torch.int32)
    ms, how = time_ms(lambda: _empty_kernel[(132,)](x))
    return [Row("launch_floor", "grid=132", "empty Triton kernel", ms, 0.0, note=how)]


def attnres_rows(tokens: tuple[int, ...] = (64, 8192), variants: tuple = MERGE_VARIANTS,
                 inter_variants: dict = INTER_VARIANTS) -> list[Row]:
    rows: list[Row] = launch_floor_rows()
    for M in tokens:
        blocks = torch.randn(BLOCKS, M, D, device="cuda", dtype=BF16)
        queries = torch.randn(SITES, D, device="cuda", dtype=BF16) * D**-0.5
        stats = attnres_inter(queries[:1], blocks).row(0)  # one site's statistics, float32
        args = (stats.max, stats.denom, stats.acc.contiguous(), queries[0],
                torch.randn(M, D, device="cuda", dtype=BF16), torch.rand(D, device="cuda", dtype=BF16) + 0.5)
        ref = attnres_naive.attnres_merge_norm(*args)
        moved = M * D * (4 + 2 + 2 + 2) + M * 8  # acc f32 + partial in; h + normed out; max, denom
        shape = f"M={M},D={D}"
        for nw in variants:
            run = partial(merge_norm_triton.attnres_merge_norm, *args, num_warps=nw)
            ours = run()
            err = {"h_max_abs": max_err(ours[0], ref[0]), "normed_max_abs": max_err(ours[1], ref[1])}
            ms, how = time_ms(run)
            rows.append(Row("attnres_merge_norm", shape, f"ours(w={nw})", ms, moved, note=how, extra=err))
        ms, how = time_ms(partial(attnres_naive.attnres_merge_norm, *args))
        rows.append(Row("attnres_merge_norm", shape, "torch k3core.ops composition", ms, moved, note=how))
        rows += _inter_rows(blocks, queries, inter_variants["decode" if M <= 64 else "prefill"])
        del blocks, args, stats
        torch.cuda.empty_cache()
    rows += _situ_rows()
    return rows


def _inter_rows(blocks: torch.Tensor, queries: torch.Tensor, variants: tuple) -> list[Row]:
    """Phase 1 for all SITES sites of a block against BLOCKS completed blocks (bf16 in, float32 stats out)."""
    rows: list[Row] = []
    N, M, _ = blocks.shape
    norm_w = (torch.rand(SITES, D, device="cuda") + 0.5).to(BF16)
    ref = attnres_inter(queries, blocks, norm_w)
    moved = N * M * D * 2 + SITES * M * (D + 2) * 4 + SITES * D * 2 * 2
    shape = f"M={M},D={D},N={N},Q={SITES}"
    for kwargs in variants:
        run = partial(inter_triton.attnres_inter, queries, blocks, norm_w, **kwargs)
        ours = run()
        err = {"acc_rel": rel_err(ours.acc, ref.acc), "max_abs": max_err(ours.max, ref.max),
               "denom_rel": rel_err(ours.denom, ref.denom)}
        ms, how = time_ms(run)
        label = ",".join(f"{k}={v}" for k, v in kwargs.items()) or "default"
        rows.append(Row("attnres_inter", shape, f"ours({label})", ms, moved, note=how, extra=err))
        del ours
    ms, how = time_ms(partial(attnres_inter, queries, blocks, norm_w))
    rows.append(Row("attnres_inter", shape, "torch k3core.ops.attnres_inter", ms, moved, note=how))
    plan = inter_triton.plan_inter(queries, blocks, norm_w)  # the default's two kernels, timed apart
    block_bytes = N * M * D * 2
    for kernel, run, nbytes in (("attnres_inter_scores", plan.scores, block_bytes + SITES * D * 2 * 2),
                                ("attnres_inter_apply", plan.apply, block_bytes + SITES * M * (D + 2) * 4)):
        ms, how = time_ms(run)
        rows.append(Row(kernel, shape, "ours(default), this kernel alone", ms, nbytes, note=how))
    return rows


def _situ_rows() -> list[Row]:
    rows: list[Row] = []
    for T, F in ((16, 2048), (8192, 2048)):
        gu = torch.randn(T, 2 * F, device="cuda", dtype=BF16) * 4
        err = {"max_abs": max_err(situ_glu_triton.situ_glu_fused(gu), moe_naive.situ_glu_fused(gu))}
        moved = T * 3 * F * 2
        for block, nw in ((1024, 4), (2048, 8)):
            ms, how = time_ms(partial(situ_glu_triton.situ_glu_fused, gu, block=block, num_warps=nw))
            rows.append(Row("situ_glu", f"T={T},F={F}", f"ours(block={block},w={nw})", ms, moved, note=how,
                            extra=err))
        ms, how = time_ms(partial(moe_naive.situ_glu_fused, gu))
        rows.append(Row("situ_glu", f"T={T},F={F}", "torch k3core.ops.situ_glu", ms, moved, note=how))
    return rows
