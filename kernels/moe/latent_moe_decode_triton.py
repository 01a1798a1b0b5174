"""Routed-expert decode with MXFP4 weights streamed and dequantised on the fly (§5.4.2, WarpDecode idea).

At decode batch sizes a grouped GEMM degenerates into streaming weight matrices, so the work is cut by output
rows and by expert: the program of the first (token, expert) pair that names an expert serves every token
routed to it (the programs of later pairs exit at once), so an expert's weights leave DRAM and are dequantised
once per step however many tokens share it. The tokens of an expert, packed into BT = 16 slots, are the M side
of a tensor-core product whose N side is BR weight rows: each weight tile is decoded to bf16 in registers
(kernels.moe.mxfp4_tile_triton: 2^-32 x the weight, undone on the float32 accumulators) and multiplied once
for all of the expert's tokens. Activations that are not bf16 enter as a sum of 2-3 bf16 parts, so the
products keep the activations' precision.

Kernel 1: gate and up rows -> SiTU-GLU -> h, stored as bf16 parts [parts, T*k, F] with x's precision (the
operand format of kernel 2). Kernel 2: down rows times the router weight -> [splits, T*k, l] (rows of a
token's first pair that names the expert; the down tile's `splits` cut the reduction over F, so that few
experts still give enough programs). Kernel 3: a token's rows and splits summed into u [T, l] in x's dtype, in
a fixed order.

On CUDA with bf16 activations and T <= 16 (every decode batch), kernels 1 and 2 run as their Gluon forms
(kernels.moe.decode_gluon: the same computation with conflict-free activation staging and a deeper cp.async
ring, 1.37-1.39x at T = 1 / 4 / 16; docs/kernels.md, history 32), gate/up from as many (token, expert) pairs
as SMs on warpgroup MMAs (kernels.moe.decode_wgmma_gluon, history 35), from 48 pairs to fewer than SMs both in
one launch (kernels.moe.decode_fused_gluon, history 43-44); these Triton kernels serve the rest and are the
form the CPU interpreter tests.
"""

from __future__ import annotations

import torch

from kernels._triton import next_pow2, require, sm_count, tl, triton
from kernels.moe import (
    decode_fp8_down_gluon,
    decode_fp8_fused_gluon,
    decode_fp8_gluon,
    decode_fused_gluon,
    decode_gluon,
    decode_wgmma_gluon,
)
from kernels.moe.prepared_experts import PreparedExperts, prepare_experts
from kernels.moe.tiles import (
    FUSED_STAGES,
    FUSED_TILES,
    GLUON_DOWN_TILE,
    GLUON_STAGES,
    Tile,
    default_tiles,
    fused_by_default,
    wgmma_by_default,
)

if triton is not None:
    from kernels.moe.expert_slots_triton import expert_tokens, slots
    from kernels.moe.mxfp4_tile_triton import lane_group_columns, mxfp4_tile, unshift
    from kernels.moe.situ_glu_triton import situ_glu_values

    @triton.jit
    def _activations(rows_ptr, used, c0, BT: tl.constexpr, G: tl.constexpr):
        """[BT, 32 G] operand: columns c0 .. c0 + 32 G of the slots' activation rows, in `mxfp4_tile`'s column
        order (loaded contiguously, permuted in registers)."""
        a = tl.load(rows_ptr[:, None] + c0 + tl.arange(0, 32 * G)[None, :], mask=used[:, None], other=0.0)
        return lane_group_columns(a, G)

    @triton.jit
    def _mma(w, act, acc, USE_ASM: tl.constexpr):
        """acc [BT, BR] + act [BT, K] @ w^T for bf16 operands. The tokens are the product's M side (16 rows:
        warp-level MMAs, each warp on its own weight rows, fed from registers; measured faster than
        warpgroup MMAs with the weight rows as M, which stage the decoded tile through shared memory). The
        interpreter's dot mistakes bf16 for integers: float32 there, the same values."""
        if not USE_ASM:
            w, act = w.to(tl.float32), act.to(tl.float32)
        return tl.dot(act, tl.trans(w), acc)

    @triton.jit
    def _dot_parts(w, act, acc, PARTS: tl.constexpr, USE_ASM: tl.constexpr):
        """_mma with act split into PARTS bf16 parts (1: act is used as bf16)."""
        if PARTS == 1:
            return _mma(w, act.to(tl.bfloat16), acc, USE_ASM)
        rest = act.to(tl.float32)
        for _ in tl.static_range(PARTS):
            part = rest.to(tl.bfloat16)
            acc = _mma(w, part, acc, USE_ASM)
            rest = rest - part.to(tl.float32)
        return acc

    @triton.jit(do_not_specialize=["T"])  # one build for every decode batch (T = 1 would be a constant)
    def _gate_up_kernel(x, ids, wgu, mgu, h, T, K, F, beta1, beta2, L: tl.constexpr, BR: tl.constexpr,
                        G: tl.constexpr, TP: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
                        X_PARTS: tl.constexpr, HP: tl.constexpr, STAGES: tl.constexpr, USE_ASM: tl.constexpr):
        e, leader, first, _match, _index = expert_tokens(ids, tl.program_id(0), T, K, TP, BK)
        if leader:
            rows = tl.program_id(1) * BR + tl.arange(0, BR)
            ok = rows < F
            words, mults = wgu + e * (2 * F) * (L // 8), mgu + e * (2 * F) * (L // 32)
            for n0 in range(0, tl.sum((first < (1 << 30)).to(tl.int32)), BT):
                _hit, pair, used = slots(first, n0, BT)
                g = tl.zeros([BT, BR], dtype=tl.float32)
                u = tl.zeros([BT, BR], dtype=tl.float32)
                for g0 in tl.range(0, L // 32, G, num_stages=STAGES):
                    xt = _activations(x + (pair // K) * L, used, g0 * 32, BT, G)
                    gate = mxfp4_tile(words, mults, rows, ok, g0, L // 8, G, USE_ASM)
                    g = _dot_parts(gate, xt, g, X_PARTS, USE_ASM)
                    up = mxfp4_tile(words, mults, rows + F, ok, g0, L // 8, G, USE_ASM)
                    u = _dot_parts(up, xt, u, X_PARTS, USE_ASM)
                rest = situ_glu_values(unshift(g), unshift(u), beta1, beta2)
                for p in tl.static_range(HP):
                    part = rest.to(tl.bfloat16)
                    tl.store(h + (p * T * K + pair[:, None]) * F + rows[None, :], part,
                             mask=used[:, None] & ok[None, :])
                    rest = rest - part.to(tl.float32)

    @triton.jit(do_not_specialize=["T"])  # one build for every decode batch (T = 1 would be a constant)
    def _down_kernel(h, ids, weights, wd, md, partial, T, K, L, F: tl.constexpr, BR: tl.constexpr,
                     G: tl.constexpr, TP: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, HP: tl.constexpr,
                     SPLITS: tl.constexpr, STAGES: tl.constexpr, USE_ASM: tl.constexpr):
        e, leader, first, match, index = expert_tokens(ids, tl.program_id(0), T, K, TP, BK)
        if leader:
            rows = tl.program_id(1) * BR + tl.arange(0, BR)
            ok = rows < L
            split = tl.program_id(2)
            words, mults = wd + e * L * (F // 8), md + e * L * (F // 32)
            # A token that names the expert in several slots gets the sum of their router weights.
            p_tok = tl.sum(tl.load(weights + index, mask=match, other=0.0), 1)
            for n0 in range(0, tl.sum((first < (1 << 30)).to(tl.int32)), BT):
                hit, pair, used = slots(first, n0, BT)
                acc = tl.zeros([BT, BR], dtype=tl.float32)
                # This program's share of the reduction: groups split * F / (32 SPLITS) onwards.
                for g0 in tl.range(split * (F // (32 * SPLITS)), (split + 1) * (F // (32 * SPLITS)), G,
                                   num_stages=STAGES):
                    w = mxfp4_tile(words, mults, rows, ok, g0, F // 8, G, USE_ASM)
                    for p in tl.static_range(HP):
                        ht = _activations(h + (p * T * K + pair) * F, used, g0 * 32, BT, G)
                        acc = _mma(w, ht, acc, USE_ASM)
                p_slot = tl.sum(tl.where(hit, p_tok[None, :], 0.0), 1)
                tl.store(partial + (split * T * K + pair[:, None]) * L + rows[None, :],
                         unshift(acc) * p_slot[:, None], mask=used[:, None] & ok[None, :])

    @triton.jit
    def _sum_pairs_kernel(partial, ids, out, TK, K, L, SPLITS: tl.constexpr, BK: tl.constexpr,
                          BL: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BL + tl.arange(0, BL)
        slot = tl.arange(0, BK)
        mine = tl.load(ids + t * K + slot, mask=slot < K, other=-1)
        # A slot whose expert an earlier slot of the token names has no row: its weight went to that one.
        earlier = (mine[:, None] == mine[None, :]) & (slot[None, :] < slot[:, None])
        repeat = tl.sum(earlier.to(tl.int32), 1) > 0
        keep = ((slot < K) & (repeat == 0))[:, None] & (cols[None, :] < L)
        total = tl.zeros([BL], dtype=tl.float32)
        for split in tl.static_range(SPLITS):  # the down kernel's reduction splits, in a fixed order
            rows = tl.load(partial + (split * TK + t * K + slot[:, None]) * L + cols[None, :], mask=keep,
                           other=0.0)
            total += tl.sum(rows, 0)
        tl.store(out + t * L + cols, total.to(out.dtype.element_ty), mask=cols < L)


def _parts(dtype: torch.dtype) -> int:
    """bf16 parts that hold an activation of `dtype` exactly (bf16 8 bits, fp16 11, float32 24)."""
    return {torch.bfloat16: 1, torch.float16: 2}.get(dtype, 3)


def latent_moe_decode(
    x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor,
    gate_up_packed: torch.Tensor, gate_up_scales: torch.Tensor, down_packed: torch.Tensor,
    down_scales: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0, gate_up_tile: Tile | None = None,
    down_tile: Tile | None = None, token_block: int = 16, h_parts: int | None = None,
    gluon_stages: int | None = None, gluon_down_stages: int | None = None,
) -> torch.Tensor:
    """u = sum_j p_j E_{id_j}(x) per token (eq.11's routed sum, in the latent width l).

    x [T, l]; expert_ids, expert_weights [T, k]; gate_up_* for W_gate;W_up stacked [E, 2F, l] and down_*
    for W_down [E, l, F], both MXFP4-packed (k3core.quant.mxfp4). Returns u [T, l] in x's dtype. The packs
    are re-laid out on every call: a caller that keeps its experts calls `prepare_experts` once and
    `latent_moe_decode_prepared`. Tuning: see latent_moe_decode_prepared.
    """
    E, two_f, half_l = gate_up_packed.shape
    L = x.shape[-1]
    F = two_f // 2
    require(half_l * 2 == L, f"gate_up_packed must be [E, 2F, {L // 2}], got {tuple(gate_up_packed.shape)}")
    require(gate_up_scales.shape == (E, two_f, L // 32), f"gate_up_scales must be [{E}, {two_f}, {L // 32}]")
    require(down_packed.shape == (E, L, F // 2), f"down_packed must be [{E}, {L}, {F // 2}], got "
            f"{tuple(down_packed.shape)}")
    require(down_scales.shape == (E, L, F // 32), f"down_scales must be [{E}, {L}, {F // 32}]")
    experts = prepare_experts(gate_up_packed, gate_up_scales, down_packed, down_scales)
    return latent_moe_decode_prepared(x, expert_ids, expert_weights, experts, beta1, beta2, gate_up_tile,
                                      down_tile, token_block, h_parts, gluon_stages, gluon_down_stages)


def latent_moe_decode_prepared(
    x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor, experts: PreparedExperts,
    beta1: float = 4.0, beta2: float = 25.0, gate_up_tile: Tile | None = None, down_tile: Tile | None = None,
    token_block: int = 16, h_parts: int | None = None, gluon_stages: int | None = None,
    gluon_down_stages: int | None = None, gluon_wgmma: bool | None = None, gluon_down_wgmma: bool = False,
    gluon_fused: bool | None = None,
) -> torch.Tensor:
    """latent_moe_decode on `prepare_experts`' layout. Tuning: `gate_up_tile` and `down_tile`
    (kernels.moe.tiles.Tile; default: `default_tiles` by T k and the SM count), `token_block` tokens of one
    expert per product (>= 16; an expert chosen by more tokens takes several passes), `h_parts` bf16 parts
    of the SiTU-GLU output h in the down product (default: as many as x's dtype needs, so h keeps x's
    precision: 1 for bf16, 2 for fp16, 3 for float32). Each projection runs in Gluon
    (kernels.moe.decode_gluon) where it serves the call (CUDA, bf16, T <= 16, 128-column tiles: every decode
    batch with the default tiles; down: GLUON_DOWN_TILE unless `down_tile` is given), with `gluon_stages`
    (gate/up) and `gluon_down_stages` cp.async stages (default GLUON_STAGES; 0: that projection's Triton
    kernel), else in Triton; with no `gate_up_tile`, gate/up runs on warpgroup MMAs
    (kernels.moe.decode_wgmma_gluon, its own 64-row 4-warp tile) where `gluon_wgmma` (default: from as many
    (token, expert) pairs as SMs); down on warpgroup MMAs (`decode_wgmma_gluon.DOWN_TILE` unless `down_tile`
    is given) where `gluon_down_wgmma` (off: no gain at T = 16 in session 8's final run, history 35).
    `gluon_fused`: the mma.sync gate/up and the down in one launch (kernels.moe.decode_fused_gluon, at
    FUSED_TILES unless both tiles are given, FUSED_STAGES unless stages are) where it serves the call
    (default: `fused_by_default`). Experts prepared with `gate_up_fp8` take gate/up on FP8 warpgroup MMAs
    (kernels.moe.decode_fp8_gluon; CUDA, bf16, T <= 16; other calls are refused) and down as without it; with
    `down_fp8` too, both in one launch where `gluon_fused` (kernels.moe.decode_fp8_fused_gluon, their stages).
    """
    T, L = x.shape
    gu_words, gu_mults, d_words, d_mults = experts.tensors()
    fp8_gate_up = experts.gate_up_fp8
    E, two_f, l_words = gu_words.shape
    F = two_f // 2
    K = expert_ids.shape[1]
    require(x.is_contiguous(), "x must be contiguous")
    require(gu_words.dtype == torch.int32 and d_words.dtype == torch.int32, "prepared words are int32")
    require(l_words * 8 == L, f"gate_up_words must be [E, 2F, {L // 8}], got {tuple(gu_words.shape)}")
    require(gu_mults.shape == (E, two_f, L // 32), f"gate_up_mults must be [{E}, {two_f}, {L // 32}]")
    require(d_words.shape == (E, L, F // 8), f"down_words must be [{E}, {L}, {F // 8}], got "
            f"{tuple(d_words.shape)}")
    require(d_mults.shape == (E, L, F // 32), f"down_mults must be [{E}, {L}, {F // 32}]")
    require(expert_weights.shape == (T, K), f"expert_weights must be [{T}, {K}] like expert_ids")
    require(token_block >= 16 and token_block == next_pow2(token_block),
            f"token_block must be a power of two >= 16, got {token_block}")
    hp = h_parts or _parts(x.dtype)
    require(1 <= hp <= 3, f"h_parts must be 1, 2 or 3, got {h_parts}")
    sms = sm_count(x.device, cpu=132)
    require(not fp8_gate_up or decode_fp8_gluon.serves(x, F), "experts prepared with gate_up_fp8 serve CUDA bf16 calls of "
            "<= 16 tokens, l a power of two >= 256 and F % 64 == 0 (prepare them without gate_up_fp8 for others)")
    if gluon_fused is None:
        gluon_fused = (gate_up_tile is None and down_tile is None and gluon_wgmma is not True and not gluon_down_wgmma
                       and fused_by_default(T * K, sms))
    fused_tiles = (gate_up_tile, down_tile) if gate_up_tile and down_tile else FUSED_TILES
    fused_stages = [f if s is None else s for f, s in zip(FUSED_STAGES, (gluon_stages, gluon_down_stages), strict=True)]
    fused = (gluon_fused and not fp8_gate_up and min(fused_stages) >= 2 and token_block == 16
             and decode_fused_gluon.serves(x, F, hp, *fused_tiles))
    if fused:
        (gate_up_tile, down_tile), (stages, down_stages) = fused_tiles, fused_stages
    else:
        stages, down_stages = (GLUON_STAGES if s is None else s for s in (gluon_stages, gluon_down_stages))
    default_gu, default_down = default_tiles(T * K, sms)
    wgmma = (wgmma_by_default(T * K, sms) if gluon_wgmma is None else gluon_wgmma) and gate_up_tile is None
    gluon_gu_tile = gate_up_tile or (decode_wgmma_gluon.GATE_UP_TILE if wgmma else default_gu)
    gluon_gate_up = bool(stages) and token_block == 16 and decode_gluon.serves_gate_up(x, F, gluon_gu_tile)
    gu_tile = gluon_gu_tile if gluon_gate_up else (gate_up_tile or default_gu)
    gluon_tile = down_tile or (decode_wgmma_gluon.DOWN_TILE if gluon_down_wgmma else GLUON_DOWN_TILE)
    down_wgmma = gluon_down_wgmma and decode_wgmma_gluon.serves_down_tile(gluon_tile)
    gluon_down = bool(down_stages) and token_block == 16 and decode_gluon.serves_down(x, F, hp, gluon_tile)
    d_tile = gluon_tile if gluon_down else (down_tile or default_down)
    fp8_down = experts.down_fp8  # the FP8 down: its own 128-row 4-warp programs; a down_tile gives its splits
    if fp8_down:
        d_tile = down_tile or Tile(splits=1)
        require(fp8_gate_up and decode_fp8_down_gluon.serves(x, F, d_tile.splits), "experts prepared with down_fp8 "
                f"need gate_up_fp8, l % 128 == 0 and F % {128 * d_tile.splits} == 0 in >= 2 steps of 128 a split")
    h_scale = decode_fp8_down_gluon.h_scale(beta1, beta2) if fp8_down else None  # h as e4m3 hi + e5m2 lo bytes
    fp8_fused = gluon_fused and fp8_down and decode_fp8_fused_gluon.serves(x, F, d_tile.splits)  # at its stages
    require(gu_tile.splits == 1, f"gate/up tiles cannot split the reduction (SiTU-GLU needs whole sums), got "
            f"splits={gu_tile.splits}")
    gu_groups, d_groups = gu_tile.groups(L), d_tile.groups(F)
    ids = expert_ids.contiguous()
    # Token tiles of at least 16 rows: one build serves every decode batch up to 16.
    common = {"TP": max(16, next_pow2(T)), "BK": next_pow2(K), "BT": token_block, "HP": hp,
              "USE_ASM": x.is_cuda}
    h = (torch.empty(T * K, 2, F, dtype=torch.uint8, device=x.device) if fp8_down
         else torch.empty(hp, T * K, F, dtype=torch.bfloat16, device=x.device))
    partial = torch.empty(d_tile.splits, T * K, L, dtype=torch.float32, device=x.device)
    weights = expert_weights.contiguous()
    gu_words, gu_mults, d_words, d_mults = (t.contiguous() for t in experts.tensors())
    if fused:  # gate/up and down in one launch
        decode_fused_gluon.gate_up_down(x, ids, weights, (gu_words, gu_mults, d_words, d_mults), h, partial, beta1,
                                        beta2, gu_tile, d_tile, stages, down_stages)
    elif fp8_fused:  # the FP8 gate/up and down in one launch
        decode_fp8_fused_gluon.gate_up_down(x, ids, weights, (gu_words, gu_mults, d_words, d_mults), h, partial,
                                            beta1, beta2, h_scale, stages, down_stages)
    else:
        if fp8_gate_up:
            decode_fp8_gluon.gate_up(x, ids, gu_words, gu_mults, h, beta1, beta2, stages, h_scale)
        elif gluon_gate_up and wgmma:
            decode_wgmma_gluon.gate_up(x, ids, gu_words, gu_mults, h, beta1, beta2, stages)
        elif gluon_gate_up:
            decode_gluon.gate_up(x, ids, gu_words, gu_mults, h, beta1, beta2, gu_tile, stages)
        else:
            _gate_up_kernel[(T * K, triton.cdiv(F, gu_tile.rows))](
                x, ids, gu_words, gu_mults, h, T, K, F, beta1, beta2, L=L, X_PARTS=_parts(x.dtype), BR=gu_tile.rows,
                G=gu_groups, STAGES=gu_tile.stages, **common, **gu_tile.launch_options(),
            )
        if fp8_down:
            decode_fp8_down_gluon.down(h, ids, weights, d_words, d_mults, partial, h_scale, down_stages)
        elif gluon_down and down_wgmma:
            decode_wgmma_gluon.down(h, ids, weights, d_words, d_mults, partial, d_tile, down_stages)
        elif gluon_down:
            decode_gluon.down(h, ids, weights, d_words, d_mults, partial, d_tile, down_stages)
        else:
            _down_kernel[(T * K, triton.cdiv(L, d_tile.rows), d_tile.splits)](
                h, ids, weights, d_words, d_mults, partial, T, K, L, F=F, BR=d_tile.rows, G=d_groups,
                SPLITS=d_tile.splits, STAGES=d_tile.stages, **common, **d_tile.launch_options(),
            )
    out = torch.empty(T, L, dtype=x.dtype, device=x.device)
    _sum_pairs_kernel[(T, triton.cdiv(L, 128))](partial, ids, out, T * K, K, L, SPLITS=d_tile.splits,
                                                  BK=next_pow2(K), BL=128)
    return out
