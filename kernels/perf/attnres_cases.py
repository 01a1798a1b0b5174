"""Block AttnRes merge + RMSNorm, and fused SiTU-GLU, on the H200: ours vs the torch composition."""

from __future__ import annotations

from functools import partial

import torch

from k3core.ops.attnres import attnres_inter
from kernels.attnres import merge_norm_triton
from kernels.attnres import naive as attnres_naive
from kernels.moe import naive as moe_naive
from kernels.moe import situ_glu_triton
from kernels.perf.harness import Row, max_err, time_ms

D, BLOCKS, SITES = 7168, 8, 24
BF16 = torch.bfloat16


def attnres_rows(tokens: tuple[int, ...] = (64, 8192)) -> list[Row]:
    rows: list[Row] = []
    for M in tokens:
        blocks = torch.randn(BLOCKS, M, D, device="cuda", dtype=BF16)
        queries = torch.randn(SITES, D, device="cuda", dtype=BF16) * D**-0.5
        stats = attnres_inter(queries[:1], blocks).row(0)  # one site's statistics, float32
        args = (stats.max, stats.denom, stats.acc.contiguous(), queries[0],
                torch.randn(M, D, device="cuda", dtype=BF16), torch.rand(D, device="cuda", dtype=BF16) + 0.5)
        ours = merge_norm_triton.attnres_merge_norm(*args)
        ref = attnres_naive.attnres_merge_norm(*args)
        err = {"h_max_abs": max_err(ours[0], ref[0]), "normed_max_abs": max_err(ours[1], ref[1])}
        moved = M * D * (4 + 2 + 2 + 2) + M * 8  # acc f32 + partial in; h + normed out; max, denom
        shape = f"M={M},D={D}"
        for nw in (4, 8):
            ms, how = time_ms(partial(merge_norm_triton.attnres_merge_norm, *args, num_warps=nw))
            rows.append(Row("attnres_merge_norm", shape, f"ours(w={nw})", ms, moved, note=how, extra=err))
        ms, how = time_ms(partial(attnres_naive.attnres_merge_norm, *args))
        rows.append(Row("attnres_merge_norm", shape, "torch k3core.ops composition", ms, moved, note=how))
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
