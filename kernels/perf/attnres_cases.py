"""Block AttnRes merge + RMSNorm, and fused SiTU-GLU, on the H200: ours vs the torch composition."""

from __future__ import annotations

from functools import partial

import torch

from k3core.ops.attnres import OnlineSoftmax, attnres_inter, attnres_logits
from k3core.presets import preset
from kernels._triton import tl, triton
from kernels.attnres import block_logits_triton, inter_triton, merge_norm_triton
from kernels.attnres import naive as attnres_naive
from kernels.attnres.query_parts import query_parts
from kernels.moe import naive as moe_naive
from kernels.moe import situ_glu_triton
from kernels.perf.harness import Row, max_err, rel_err, time_ms

D, BLOCKS, SITES = 7168, 8, 24
BF16 = torch.bfloat16


MERGE_WARPS = 4  # the merge's num_warps (8: same at decode, 93 vs 98 % at prefill)
# Phase 1 (direct and from cached logits, and the newest block's logits) is timed at its launchers' defaults
# only: they combine the winners of earlier runs' variants (docs/kernels.md, AttnRes history); session 5's
# sweeps of the cached form (apply_block_d 64, apply_rows 4; block_d 128, 56 chunks, parts cut in the loop,
# 128 rows) were all slower (history 22).
MID_FORWARD_SITES = 163  # K3: the sites after its first layer block (93 layers x 2 + 1 - 24)


@triton.jit
def _empty_kernel(x):
    tl.store(x + tl.program_id(0), 0)


def launch_floor_rows() -> list[Row]:
    """The time of an empty kernel launch in the same harness: the floor under any decode-sized kernel."""
    x = torch.empty(132, device="cuda", dtype=torch.int32)
    ms, how = time_ms(lambda: _empty_kernel[(132,)](x))
    return [Row("launch_floor", "grid=132", "empty Triton kernel", ms, 0.0, note=how)]


def attnres_rows(tokens: tuple[int, ...] = (64, 8192)) -> list[Row]:
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
        run = partial(merge_norm_triton.attnres_merge_norm, *args, num_warps=MERGE_WARPS)
        ours = run()
        err = {"h_max_abs": max_err(ours[0], ref[0]), "normed_max_abs": max_err(ours[1], ref[1])}
        ms, how = time_ms(run)
        rows.append(Row("attnres_merge_norm", shape, f"ours(w={MERGE_WARPS})", ms, moved, note=how, extra=err))
        ms, how = time_ms(partial(attnres_naive.attnres_merge_norm, *args))
        rows.append(Row("attnres_merge_norm", shape, "torch k3core.ops composition", ms, moved, note=how))
        rows += _inter_rows(blocks, queries)  # the cached form: `phase1_rows`
        del blocks, args, stats
        torch.cuda.empty_cache()
    rows += _situ_rows()
    return rows


def _stats_errors(ours: OnlineSoftmax, ref: OnlineSoftmax) -> dict:
    """A phase 1's statistics (`OnlineSoftmax`) against the torch reference's, as a row's error entries."""
    return {"acc_rel": rel_err(ours.acc, ref.acc), "max_abs": max_err(ours.max, ref.max),
            "denom_rel": rel_err(ours.denom, ref.denom)}


def _inter_rows(blocks: torch.Tensor, queries: torch.Tensor) -> list[Row]:
    """Phase 1 for all SITES sites of a block against BLOCKS completed blocks (bf16 in, float32 stats out)."""
    rows: list[Row] = []
    N, M, _ = blocks.shape
    norm_w = (torch.rand(SITES, D, device="cuda") + 0.5).to(BF16)
    ref = attnres_inter(queries, blocks, norm_w)
    moved = N * M * D * 2 + SITES * M * (D + 2) * 4 + SITES * D * 2 * 2
    shape = f"M={M},D={D},N={N},Q={SITES}"
    run = partial(inter_triton.attnres_inter, queries, blocks, norm_w)
    err = _stats_errors(run(), ref)
    ms, how = time_ms(run)
    rows.append(Row("attnres_inter", shape, "ours(default)", ms, moved, note=how, extra=err))
    ms, how = time_ms(partial(attnres_inter, queries, blocks, norm_w))
    rows.append(Row("attnres_inter", shape, "torch k3core.ops.attnres_inter", ms, moved, note=how))
    plan = inter_triton.plan_inter(queries, blocks, norm_w)  # the default's two kernels, timed apart
    block_bytes = N * M * D * 2
    for kernel, run, nbytes in (("attnres_inter_scores", plan.scores, block_bytes + SITES * D * 2 * 2),
                                ("attnres_inter_apply", plan.apply, block_bytes + SITES * M * (D + 2) * 4)):
        ms, how = time_ms(run)
        rows.append(Row(kernel, shape, "ours(default), this kernel alone", ms, nbytes, note=how))
    return rows


def _cached_rows(blocks: torch.Tensor, queries: torch.Tensor) -> list[Row]:
    """Phase 1 the cached way, per block of the forward: the newest block's logits against the sites after
    it (this block's SITES and the final site), written once into the logit cache, then the apply kernel
    over the cached logits of all N blocks: two launches. Bytes: `phase1_bytes`."""
    rows: list[Row] = []
    N, M, _ = blocks.shape
    later = SITES + 1
    gen = torch.Generator(device="cuda").manual_seed(1)
    norm_w = (torch.rand(SITES, D, device="cuda", generator=gen) + 0.5).to(BF16)
    later_q = torch.cat([queries, torch.randn(1, D, device="cuda", dtype=BF16) * D**-0.5])
    later_w = torch.cat([norm_w, torch.ones(1, D, device="cuda", dtype=BF16)])
    cache = torch.empty(later, N, M, device="cuda")
    for n in range(N):  # the earlier blocks' columns, filled when those blocks completed
        block_logits_triton.attnres_block_logits(later_q, blocks[n], later_w, out=cache[:, n])
    ref = attnres_inter(queries, blocks, norm_w)
    logits_ref = attnres_logits(later_q, blocks[-1:], later_w)[:, 0]
    shape = f"M={M},D={D},N={N},Q={SITES}"
    later_parts = query_parts(later_q, later_w)  # a derived weight in the serving path: not timed
    newest = partial(block_logits_triton.attnres_block_logits, later_q, blocks[-1], later_w, out=cache[:, N - 1],
                     parts=later_parts)
    newest()
    err = {"logits_rel": rel_err(cache[:, N - 1], logits_ref)}
    ms, how = time_ms(newest)
    rows.append(Row("attnres_block_logits", f"M={M},D={D},S={later}", "ours(default), newest block", ms,
                    M * D * 2 + later * M * 4 + later * D * 2 * 2, note=how, extra=err))
    if M <= 64:  # a block early in the forward has many more sites after it
        many_q = torch.randn(MID_FORWARD_SITES, D, device="cuda", dtype=BF16) * D**-0.5
        many_w = (torch.rand(MID_FORWARD_SITES, D, device="cuda") + 0.5).to(BF16)
        ms, how = time_ms(partial(block_logits_triton.attnres_block_logits, many_q, blocks[0], many_w,
                                  parts=query_parts(many_q, many_w)))
        rows.append(Row("attnres_block_logits", f"M={M},D={D},S={MID_FORWARD_SITES}", "ours(default)", ms,
                        M * D * 2 + MID_FORWARD_SITES * (M + D) * 4, note=how))
    apply = partial(inter_triton.attnres_inter, queries, blocks, norm_w, logits=cache[:SITES])
    err = _stats_errors(apply(), ref)
    ms, how = time_ms(lambda: (newest(), apply()))
    rows.append(Row("attnres_inter", shape, "cached: newest block's logits + apply(default)", ms,
                    phase1_bytes(M, D, N, SITES, later), note=how, extra=err))
    ms, how = time_ms(apply)
    rows.append(Row("attnres_inter_apply_cached", shape, "ours(default), this kernel alone", ms,
                    N * M * D * 2 + SITES * M * (D + 2) * 4 + SITES * N * M * 4, note=how))
    return rows


def phase1_bytes(M: int, D: int, N: int, Q: int, S: int, parts: int = 2, copy: bool = False) -> int:
    """The least bytes of a phase 1 in serving form (blocks [N, M, D] bf16, the newest without cached logits;
    Q sites of the S after it): each block read once, the float32 accumulators, max and denominators written,
    the older blocks' cached logits read, the newest block's logits written for all S later sites, the
    later sites' q_eff parts read; `copy`: the newest block also written into the block buffer. Re-reads
    (the newest block by both passes, its logits through L2) are not counted."""
    return (N * M * D * 2 + Q * M * (D + 2) * 4 + Q * (N - 1) * M * 4 + S * M * 4 + parts * S * D * 2
            + (M * D * 2 if copy else 0))


def forward_phases(name: str) -> list[tuple[int, int, int]]:
    """(N completed blocks, Q sites, S sites after the newest block) of each phase 1 in a decode forward of
    preset `name`, as services/engine/fast_decoder runs them: one per layer block, then the final site."""
    config = preset(name)
    layers, size = config.num_hidden_layers, config.attn_res_block_size
    n_sites, n_blocks = 2 * layers + 1, -(-layers // size)
    phases = [(b + 1, 2 * min(size, layers - b * size), n_sites - 2 * b * size) for b in range(n_blocks)]
    return [*phases, (n_blocks + 1, 1, 1)]


def phase1_rows(tokens: tuple[int, ...] = (64, 8192), forwards: tuple[str, ...] = ("k3", "mini"),
                batch: int = 64) -> list[Row]:
    """Phase 1 from cached logits as served (two launches: the newest block's logits, then the apply), at
    the fixed shape of `attnres_rows` (then, at decode, as served: the block also copied into the block
    buffer), and every phase 1 of a decode forward of each preset in `forwards` at `batch` rows, as served."""
    rows: list[Row] = launch_floor_rows()
    for M in tokens:
        blocks = torch.randn(BLOCKS, M, D, device="cuda", dtype=BF16)
        queries = torch.randn(SITES, D, device="cuda", dtype=BF16) * D**-0.5
        rows += _cached_rows(blocks, queries)
        if M <= 64:  # the serving path is decode's
            for fused_copy in (False, True):
                rows += _served_rows(f"M={M},D={D},N={BLOCKS},Q={SITES}", D, M, [(BLOCKS, SITES, SITES + 1)],
                                     fused_copy)
        del blocks
        torch.cuda.empty_cache()
    for name in forwards:
        config = preset(name)
        for fused_copy in (False, True):
            rows += _served_rows(f"{name} forward, B={batch}", config.hidden_size, batch, forward_phases(name),
                                 fused_copy)
    return rows


def _served_rows(shape: str, dim: int, M: int, phases: list[tuple[int, int, int]], fused_copy: bool) -> list[Row]:
    """`phases` ((N, Q, S) each, in forward order: the blocks' and sites' layout of fast_decoder) as served
    (per phase: the newest block copied into the buffer, its logits, the apply); `fused_copy`: the copy done
    by the logits kernel (`copy_to`) instead of a launch of its own."""
    n_blocks, n_sites = phases[-1][0], phases[0][2]
    gen = torch.Generator(device="cuda").manual_seed(M + dim)
    sources = torch.randn(n_blocks, M, dim, device="cuda", dtype=BF16, generator=gen)
    site_q = torch.randn(n_sites, dim, device="cuda", dtype=BF16, generator=gen) * dim**-0.5
    site_w = (torch.rand(n_sites, dim, device="cuda", generator=gen) + 0.5).to(BF16)
    parts = query_parts(site_q, site_w)
    stacked = sources.clone()
    cache = torch.zeros(n_sites, n_blocks, M, device="cuda")
    for n in range(phases[0][0] - 1):  # blocks completed before the first phase timed: their logits cached
        block_logits_triton.attnres_block_logits(site_q, sources[n], site_w, out=cache[:, n], parts=parts)

    def served() -> list:
        out = []
        for N, Q, S in phases:
            first = n_sites - S
            if not fused_copy:
                stacked[N - 1].copy_(sources[N - 1])
            block_logits_triton.attnres_block_logits(site_q[first:], sources[N - 1], site_w[first:],
                                                     out=cache[first:, N - 1], parts=parts[:, first:],
                                                     copy_to=stacked[N - 1] if fused_copy else None)
            out.append(inter_triton.attnres_inter(site_q[first:first + Q], stacked[:N], site_w[first:first + Q],
                                                  logits=cache[first:first + Q, :N]))
        return out

    for N, _, _ in phases:  # each phase must copy its newest block in itself
        stacked[N - 1].fill_(float("nan"))
    got = served()
    N, Q, S = phases[-1]
    ref = attnres_inter(site_q[n_sites - S:][:Q], sources[:N], site_w[n_sites - S:][:Q])  # torch float32
    err = {"last_acc_rel_vs_torch": rel_err(got[-1].acc, ref.acc), "phases": len(phases)}
    del got
    moved = sum(phase1_bytes(M, dim, N, Q, S, copy=True) for N, Q, S in phases)
    ms, how = time_ms(served)
    impl = ("as served: logits (+ block copy) + apply" if fused_copy else "copy launch + logits + apply") + " per phase"
    return [Row("attnres_phase1_served", shape, impl, ms, moved, note=how, extra=err)]


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
