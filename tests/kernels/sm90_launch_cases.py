"""The launchers of every Triton / Gluon kernel called as the serving path calls them, at the `mini` preset's
shapes, on empty CPU tensors (bf16, served layouts: pool views, row-strided projection slices), for
test_sm90_compile.py to record and compile for sm_90 (and for other tests that record launches).

CASES: the default configuration of each launcher at decode (batch 1 and 64) and prefill; `bench_variants()`:
the tuning variants the benches time (kernels/perf/*_cases.py). A kernel that some module under kernels/
launches but no case reaches fails test_sm90_compile's `test_every_launched_kernel_is_covered`: add a case
for it here.
"""

from __future__ import annotations

import torch

from k3core.cache.layout import plan_layout, shape_from_config
from k3core.cache.pool_views import PoolViews
from k3core.presets import preset
from kernels import compile_check
from kernels.attnres import block_logits_triton, inter_triton, merge_norm_triton
from kernels.fused import (
    expert_gemm_triton,
    gated_heads_triton,
    greedy_argmax_triton,
    lookahead_prologue_triton,
    mla_latent_write_triton,
    moe_align_triton,
    moe_combine_triton,
    moe_router_triton,
    rms_norm_rows_triton,
    routed_expert_gemm_triton,
    skinny_gemm_triton,
)
from kernels.kda import decode_step_triton, decode_triton, prefill_triton, verify_triton
from kernels.mla import decode_triton as mla_decode
from kernels.moe import (
    decode_fp8_down_gluon,
    decode_fp8_fused_gluon,
    decode_fp8_gluon,
    decode_fused_gluon,
    decode_gluon,
    decode_wgmma_gluon,
    latent_moe_decode_triton,
    prepared_experts,
    situ_glu_triton,
)
from kernels.moe.tiles import FUSED_STAGES, FUSED_TILES, GLUON_DOWN_TILE, GLUON_STAGES, default_tiles
from kernels.perf import attnres_cases, kda_decode_cases, kda_prefill_tuning, mla_cases, moe_cases
from services.engine import fast_ffn
from services.engine.decode_inputs import DecodeInputs
from services.engine.fast_decoder import distinct_projections, mla_index_int32

BF16, F32, I32, I64 = torch.bfloat16, torch.float32, torch.int32, torch.int64
MINI = preset("mini")
LAYOUT = plan_layout(shape_from_config(MINI, "mini"))
H, D, W = MINI.kda_num_heads, MINI.kda_head_dim, MINI.short_conv_kernel_size
R, P, MLA_HEADS = MINI.kv_lora_rank, MINI.qk_rope_head_dim, MINI.num_attention_heads
E, TOP_K, F_MOE, LATENT = MINI.num_experts, MINI.num_experts_per_token, MINI.moe_intermediate_size, \
    MINI.routed_expert_hidden_size
HIDDEN, SITES = MINI.hidden_size, 2 * MINI.attn_res_block_size  # AttnRes: two sites per layer of a block
DECODE_BATCHES, PREFILL_TOKENS, CONTEXT = (1, 64), 4096, 8192


def empty(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def pool(pages: int) -> PoolViews:
    """The serving pool of `mini`, as the fast path's views see it."""
    return PoolViews(torch.empty(pages, LAYOUT.page_bytes, dtype=torch.uint8), LAYOUT)


def step_inputs(batch: int, max_pages: int = CONTEXT // LAYOUT.tokens_per_block, ahead: bool = False) -> DecodeInputs:
    """The fast path's int64 step inputs (slots, page tables, lengths, rows; with `ahead` the look-ahead's source
    and stops): views of one flat buffer."""
    sizes = (batch, LAYOUT.num_kda_groups, LAYOUT.num_mla_groups, max_pages, ahead)
    return DecodeInputs.view(torch.zeros(DecodeInputs.numel(*sizes), dtype=I64), *sizes)


def kda_tokens(batch: int, length: int | None = None) -> tuple[torch.Tensor, ...]:
    """q, k, v, z, beta, gate as the fast path passes them: row-strided slices of one projection output."""
    lead = (batch,) if length is None else (batch, length)
    wide = empty(*lead, 5 * H * D + H + 8)
    q, k, v, z, gate = (wide[..., i * H * D : (i + 1) * H * D].unflatten(-1, (H, D)) for i in range(5))
    return q, k, v, z, wide[..., 5 * H * D : 5 * H * D + H], gate


def kda_params() -> tuple[torch.Tensor, ...]:
    return empty(3, H * D, W), empty(H), empty(H * D), empty(D)


def kda_pool(batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    views = pool(2 * batch)
    return views.kda_state(1), views.kda_conv(1), step_inputs(batch).kda_slots[1]


def kda_decode(batch: int) -> None:
    decode_step_triton.kda_decode_step(*kda_tokens(batch), *kda_params(), *kda_pool(batch))


def kda_verify(batch: int, drafts: int = 3) -> None:
    """services/engine/verify_replay: the accepted drafts replayed, then each row's last kept token (its
    state committed); services/engine/fast_verify: a window of drafts on the pool, nothing committed."""
    projected = tuple(t.contiguous() for t in kda_tokens(batch, drafts + 1))
    kept = tuple(t[:, :1].clone() for t in projected[:5])
    state, conv, slots = kda_pool(batch)
    verify_triton.kda_verify_replay(*kept, torch.zeros_like(kept[0]), *kda_params(), state, conv,
                                    torch.arange(batch), previous_drafts=projected[:5],
                                    n_accepted=torch.zeros(batch, dtype=I64), scale=D**-0.5)
    decode_triton.fused_kda_recurrent(*projected, *kda_params(), state, conv, slots, n_commit=0)


def kda_prefill(**tuning) -> None:
    """A fresh prompt (B=1), and packed prompts continuing cached prefixes (state and conv given)."""
    x = tuple(t.contiguous() for t in kda_tokens(1, PREFILL_TOKENS))
    prefill_triton.kda_prefill_block(*x, *kda_params(), **tuning)
    seqs = 12
    cu = torch.tensor([i * PREFILL_TOKENS // seqs for i in range(seqs)] + [PREFILL_TOKENS], dtype=I32)
    prefill_triton.kda_prefill_block(*x, *kda_params(), initial_state=empty(seqs, H, D, D, dtype=F32),
                                     initial_conv=empty(seqs, 3, H, D, W - 1), cu_seqlens=cu, **tuning)


def mla_step(batch: int, **tuning) -> None:
    """services/engine/fast_attention.MlaDecode: q_a norm, latent write, paged decode (the step's int32 page
    table and lengths, fast_decoder.mla_index_int32), gated heads."""
    inputs, views = step_inputs(batch), pool(batch * CONTEXT // LAYOUT.tokens_per_block)
    parts = empty(batch, MINI.q_lora_rank + R + P + MLA_HEADS * MINI.v_head_dim)  # [q_a | kv_a | gate]
    kv, gate = parts[:, MINI.q_lora_rank : MINI.q_lora_rank + R + P], parts[:, MINI.q_lora_rank + R + P :]
    rms_norm_rows_triton.rms_norm_rows(parts[:, : MINI.q_lora_rank], empty(MINI.q_lora_rank), 1e-6)
    mla_latent_write_triton.mla_latent_write(kv, empty(R), 1e-6, views.mla_rows(), inputs.row_base[1])
    inputs = mla_index_int32(inputs)
    mla_decode.mla_decode_paged(empty(batch, MLA_HEADS, R + P), views.mla_cache(0), inputs.page_table[1],
                                inputs.lengths, 0.07, latent_dim=R, **tuning)
    gated_heads_triton.gated_heads(empty(MLA_HEADS, batch, MINI.v_head_dim), gate)


def attnres(tokens: int) -> None:
    """services/engine/fast_decoder: a block's sites and the final site, then the merges with and without a
    partial sum; phase 1 from cached logits after a block's logits against the sites after it (this block's
    and the final one; many, as early in a forward)."""
    blocks = empty(3, tokens, HIDDEN)
    for sites in (SITES, 1):
        inter_triton.attnres_inter(empty(sites, HIDDEN), blocks, empty(sites, HIDDEN), 1e-6)
        inter_triton.attnres_inter(empty(sites, HIDDEN), blocks, empty(sites, HIDDEN), 1e-6,
                                   logits=empty(sites, 3, tokens, dtype=F32))
    for later in (SITES + 1, 4 * SITES + 1):
        for copy_to in (None, empty(tokens, HIDDEN)):  # the block also copied into the block buffer
            block_logits_triton.attnres_block_logits(empty(later, HIDDEN), blocks[0], empty(later, HIDDEN), 1e-6,
                                                     parts=empty(2, later, HIDDEN), copy_to=copy_to)
    stats = (empty(tokens, dtype=F32), empty(tokens, dtype=F32), empty(tokens, HIDDEN, dtype=F32))
    for partial in (empty(tokens, HIDDEN), None):
        for launch in ({}, {"store_h": False}):
            merge_norm_triton.attnres_merge_norm(*stats, empty(HIDDEN), partial, empty(HIDDEN),
                                                 key_norm_weight=empty(HIDDEN), out_dtype=BF16, **launch)
    for merge_stats in (stats, (None, None, None)):  # the decode path's merge folding the newest block in
        for partial in (empty(tokens, HIDDEN), None):
            merge_norm_triton.attnres_merge_norm(*merge_stats, empty(HIDDEN), partial, empty(HIDDEN),
                                                 key_norm_weight=empty(HIDDEN), out_dtype=BF16,
                                                 newest=empty(tokens, HIDDEN))


def moe_step(tokens: int) -> None:
    """services/engine/fast_ffn.MoeDecode (latent MoE): routing, grouped or dense expert rows, the fused tail."""
    weights, ids = moe_router_triton.moe_route(empty(tokens, HIDDEN), empty(E, HIDDEN), empty(E), TOP_K)
    h = empty(tokens, LATENT + 2 * 2 * F_MOE)  # [z | shared experts' gate_up]: one GEMM's output
    shared = h[:, LATENT:]
    _, _, position = moe_align_triton.moe_align(ids, E)
    situ_glu_triton.situ_glu_fused(empty(tokens * TOP_K, 2 * F_MOE))
    moe_combine_triton.moe_combine(empty(tokens * TOP_K, LATENT), position, weights, 1, 0, empty(LATENT), 1e-6,
                                   shared, out_dtype=BF16)
    for gate_up, down in fast_ffn.DENSE_FORMS.values():  # the dense experts' forms (K3_DENSE_EXPERTS)
        expert_gemm_triton.expert_gate_up_glu(h[:, :LATENT], empty(E, 2 * F_MOE, LATENT), **gate_up)
        expert_gemm_triton.expert_down(empty(E, tokens, F_MOE), empty(E, LATENT, F_MOE), **(down or {}))
    moe_combine_triton.moe_combine(empty(E * tokens, LATENT), ids, weights, tokens, 1, empty(LATENT), 1e-6, shared,
                                   out_dtype=BF16)


def dense_expert_tilings(tokens: int) -> None:
    """The dense experts' gate|up and down tilings bench.serve_glue times (bench/serve_glue_gemms.py)."""
    from bench import serve_glue_gemms as glue

    h = empty(tokens, LATENT + 2 * 2 * F_MOE)
    for n, k, warps, stages, tma in glue.EXPERT_CONFIGS:
        expert_gemm_triton.expert_gate_up_glu(h[:, :LATENT], empty(E, 2 * F_MOE, LATENT), block_n=n, block_k=k,
                                              num_warps=warps, num_stages=stages, tma=tma)
    for n, k, warps, stages, tma in glue.DOWN_CONFIGS:
        expert_gemm_triton.expert_down(empty(E, tokens, F_MOE), empty(E, LATENT, F_MOE), block_n=n, block_k=k,
                                       num_warps=warps, num_stages=stages, tma=tma)


def routed_experts(tokens: int, gate_up: list[tuple] | None = None, down: list[tuple] | None = None,
                   padded: bool = False) -> None:
    """The routed experts' gate|up and down (fast_ffn's routed form) in the given tilings (bench/serve_glue_gemms.py's
    tuples; None: the launchers' defaults); `padded`: with a decode step's padding marker (the KDA slots)."""
    ids, z = torch.zeros(tokens, TOP_K, dtype=I64), empty(tokens, LATENT + 2 * 2 * F_MOE)[:, :LATENT]
    padding = (torch.zeros(tokens, dtype=I64), 5) if padded else None
    for n, t, k, warps, stages, tma in gate_up or [(64, 0, 64, 4, 4, True)]:
        routed_expert_gemm_triton.routed_expert_gate_up_glu(z, empty(E, 2 * F_MOE, LATENT), ids, block_n=n,
                                                            block_t=t, block_k=k, num_warps=warps, num_stages=stages,
                                                            tma=tma, padding=padding)
    for n, t, k, warps, stages, tma in down or [(64, 0, 64, 4, 4, True)]:
        routed_expert_gemm_triton.routed_expert_down(empty(tokens * TOP_K, F_MOE), empty(E, LATENT, F_MOE), ids,
                                                     block_n=n, block_t=t, block_k=k, num_warps=warps,
                                                     num_stages=stages, tma=tma, padding=padding)


def latent_moe(tokens: int, experts: int = E, latent: int = LATENT, width: int = F_MOE, top_k: int = TOP_K,
               **tuning) -> None:
    """The MXFP4 routed-expert decode (kernels/moe) on prepared experts (int32 words, uint8 multipliers)."""
    u8 = torch.uint8
    experts_ = prepared_experts.PreparedExperts(
        empty(experts, 2 * width, latent // 8, dtype=I32), empty(experts, 2 * width, latent // 32, dtype=u8),
        empty(experts, latent, width // 8, dtype=I32), empty(experts, latent, width // 32, dtype=u8))
    latent_moe_decode_triton.latent_moe_decode_prepared(empty(tokens, latent), torch.zeros(tokens, top_k, dtype=I64),
                                                        empty(tokens, top_k, dtype=F32), experts_, **tuning)


def latent_moe_gluon(tokens: int, experts: int = E, latent: int = LATENT, width: int = F_MOE,
                     top_k: int = TOP_K) -> None:
    """The Gluon forms of the MXFP4 routed-expert decode (kernels/moe/decode_gluon.py, decode_wgmma_gluon.py)
    with the tiles and stages the launcher gives them on CUDA for bf16 activations (it takes them only there,
    so `latent_moe` cannot reach them from CPU tensors)."""
    u8, pairs, stages = torch.uint8, tokens * top_k, GLUON_STAGES
    x, ids, h = empty(tokens, latent), torch.zeros(tokens, top_k, dtype=I64), empty(1, pairs, width)
    gate_up = (empty(experts, 2 * width, latent // 8, dtype=I32), empty(experts, 2 * width, latent // 32, dtype=u8))
    down = (empty(tokens, top_k, dtype=F32), empty(experts, latent, width // 8, dtype=I32),
            empty(experts, latent, width // 32, dtype=u8), empty(1, pairs, latent, dtype=F32))
    decode_gluon.gate_up(x, ids, *gate_up, h, 4.0, 25.0, default_tiles(pairs, compile_check.H200_SMS)[0], stages)
    decode_wgmma_gluon.gate_up(x, ids, *gate_up, h, 4.0, 25.0, stages)
    decode_fp8_gluon.gate_up(x, ids, *gate_up, h, 4.0, 25.0, stages)  # experts prepared with gate_up_fp8: N = 8 at T = 1, 16 at 16
    decode_wgmma_gluon.down(h, ids, *down, decode_wgmma_gluon.DOWN_TILE, stages)
    decode_gluon.down(h, ids, *down, GLUON_DOWN_TILE, stages)
    decode_fused_gluon.gate_up_down(x, ids, down[0], (*gate_up, *down[1:3]), h, down[3], 4.0, 25.0,
                                    *FUSED_TILES, *FUSED_STAGES)
    hq, s = empty(pairs, 2, width, dtype=torch.uint8), decode_fp8_down_gluon.h_scale(4.0, 25.0)  # opt-in FP8 down
    decode_fp8_gluon.gate_up(x, ids, *gate_up, hq, 4.0, 25.0, stages, s)
    decode_fp8_down_gluon.down(hq, ids, *down, s, stages)
    decode_fp8_fused_gluon.gate_up_down(x, ids, down[0], (*gate_up, *down[1:3]), hq, down[3], 4.0, 25.0, s, stages, stages)


def skinny_gemm(tokens: int, tilings=lambda n, k: [skinny_gemm_triton.default_tiling(n, k)]) -> None:
    """The decode projections (services/engine/fast_*.py through dispatch.skinny_linear: fast_decoder's
    `distinct_projections`): the routed tiling and the launcher's default of every mini projection shape."""
    for n, k, residual in distinct_projections(MINI).values():
        routed = skinny_gemm_triton.ROUTES.get((n, k, skinny_gemm_triton.block_rows(tokens)))
        for tiling in dict.fromkeys([*tilings(n, k), *([routed] if routed else [])]):
            skinny_gemm_triton.skinny_gemm(empty(tokens, k), empty(n, k), empty(tokens, n) if residual else None,
                                           tiling)


def greedy_draw(batch: int) -> None:
    """services/engine/sampler: the greedy draw's argmax over the step's logits rows (mini's vocabulary)."""
    greedy_argmax_triton.greedy_argmax(empty(batch, MINI.vocab_size))


def lookahead_prologue(batch: int) -> None:
    """services/engine/decode_inputs.DecodeInputs.resolve_on_device: a look-ahead step's prologue in its graph."""
    inp = step_inputs(batch, ahead=True)
    lookahead_prologue_triton.lookahead_prologue(inp.tokens, inp.kda_slots, inp.row_base, inp.source, inp.stops,
                                                 torch.zeros(batch, dtype=I64), 0, 0)


def launch_floor() -> None:
    attnres_cases._empty_kernel[(132,)](empty(132, dtype=I32))


CASES = {
    **{f"kda decode B={b}": lambda b=b: kda_decode(b) for b in DECODE_BATCHES},
    **{f"kda verify B={b}": lambda b=b: kda_verify(b) for b in DECODE_BATCHES},
    "kda prefill": kda_prefill,
    **{f"mla decode B={b}": lambda b=b: mla_step(b) for b in DECODE_BATCHES},
    **{f"attnres M={m}": lambda m=m: attnres(m) for m in (*DECODE_BATCHES, PREFILL_TOKENS)},
    **{f"moe T={t}": lambda t=t: moe_step(t) for t in DECODE_BATCHES},
    **{f"latent moe T={t}": lambda t=t: latent_moe(t) for t in DECODE_BATCHES},
    **{f"routed experts T={t}": lambda t=t: routed_experts(t) for t in DECODE_BATCHES},
    "routed experts padded T=128": lambda: routed_experts(128, padded=True),  # a decode graph bucket's padding
    **{f"skinny gemm T={t}": lambda t=t: skinny_gemm(t) for t in DECODE_BATCHES},
    **{f"greedy argmax B={b}": lambda b=b: greedy_draw(b) for b in DECODE_BATCHES},
    **{f"lookahead prologue B={b}": lambda b=b: lookahead_prologue(b) for b in DECODE_BATCHES},
    "launch floor": launch_floor,
}


def bench_variants() -> dict:
    """The tuning variants kernels/perf times, each at the shapes above."""
    cases = {}
    for v in kda_decode_cases.DECODE_VARIANTS:
        cases[f"kda decode {v}"] = lambda v=v: [decode_step_triton.kda_decode_split(
            *kda_tokens(b), *kda_params(), *kda_pool(b), -5.0, None, 1e-6, 1e-6, v.block_v, v.warps, v.evict_first,
            v.stream_store, v.heads_first) for b in DECODE_BATCHES]
    for label, tuning, *_ in kda_prefill_tuning.VARIANTS:
        cases[f"kda prefill {label}"] = lambda t=tuning: kda_prefill(**t)
    for v in mla_cases.VARIANTS:
        cases[f"mla decode {v}"] = lambda v=v: [mla_step(b, **v) for b in DECODE_BATCHES]
    for gate_up, down in moe_cases.SWEEP:  # the tile sweep (default_tiles' two choices first), at the bench's shape:
        # some tiles do not divide mini's widths
        cases[f"latent moe {gate_up.label()} | {down.label()}"] = lambda g=gate_up, d=down: [
            latent_moe(n, moe_cases.E, moe_cases.L, moe_cases.F, moe_cases.TOP_K, gate_up_tile=g, down_tile=d)
            for n in DECODE_BATCHES]
    cases["skinny gemm tilings"] = lambda: skinny_gemm(64, skinny_gemm_triton.candidate_tilings)
    cases["dense experts' tilings"] = lambda: dense_expert_tilings(64)
    from bench import serve_glue_gemms as glue

    cases["routed experts' tilings"] = lambda: routed_experts(64, glue.ROUTED_CONFIGS, glue.ROUTED_DOWN_CONFIGS)
    return cases
