"""The latent-MoE decode's gate/up and down kernels in Gluon (GPU only: Gluon has no CPU interpreter).

The same computations as `latent_moe_decode_triton._gate_up_kernel` and `_down_kernel` for bf16 activations
(h in one bf16 part) and up to 16 tokens, 128-column steps, on the blocks of kernels.moe.mxfp4_stream_gluon
(conflict-free activation staging, a cp.async ring refilled after one barrier a step). `serves_*` say which
calls they take; the launcher keeps the Triton kernels for the rest (the CPU interpreter included).
"""

from __future__ import annotations

import torch

from kernels._triton import next_pow2, require
from kernels.moe.mxfp4_stream_gluon import COLS, SLOTS, gluon
from kernels.moe.tiles import Tile

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

    from kernels.moe.mxfp4_stream_gluon import (
        UNSHIFT,
        act_operand,
        act_ring,
        act_rows,
        block_tile,
        copy_act,
        copy_tile,
        expert_tokens,
        fields_ring,
        mma_layout,
        slots,
        small_layout,
        weight_operand,
        words_ring,
    )

    @gluon.jit
    def _sigmoid(v):
        return 1.0 / (1.0 + gl.exp(-v))

    @gluon.jit
    def situ_glu(g, u, beta1, beta2):
        """kernels.moe.situ_glu_triton.situ_glu_values, in Gluon (both gate/up kernels' epilogue)."""
        gate = beta1 * (2 * _sigmoid(2 * g / beta1) - 1) * _sigmoid(g)
        return gate * (beta2 * (2 * _sigmoid(2 * u / beta2) - 1))

    @gluon.jit
    def gate_up_rows(x, ids, wgu, mgu, h, pair, row0, T, K, F, beta1, beta2, L: gl.constexpr, TP: gl.constexpr,
                     BK: gl.constexpr, HP: gl.constexpr, ROWS: gl.constexpr, WARPS: gl.constexpr,
                     STAGES: gl.constexpr):
        """One gate/up program's work: rows row0 .. row0 + ROWS of h for the tokens of `pair`'s expert, where
        `pair` leads it (both gate_up_kernel and decode_fused_gluon's one-launch kernel)."""
        WORDS: gl.constexpr = L // 8
        STEPS: gl.constexpr = L // 128
        e, leader, first, _match, _index = expert_tokens(ids, pair, T, K, TP, BK, WARPS)
        if leader:
            _hit, slot_pair, used = slots(first, WARPS)
            gate_words, gate_fields = block_tile(row0, WORDS, ROWS, WARPS)
            words = wgu + e * (2 * F) * WORDS + gate_words
            fields = mgu + e * (2 * F) * (WORDS // 4) + gate_fields
            up_words, up_fields = words + F * WORDS, fields + F * (WORDS // 4)  # rows F below (F % 32 == 0)
            x_rows, x_used = act_rows(x, slot_pair, used, K, L, WARPS)
            act_s = act_ring(STAGES)
            gate_s, gate_f = words_ring(STAGES, ROWS), fields_ring(STAGES, ROWS)
            up_s, up_f = words_ring(STAGES, ROWS), fields_ring(STAGES, ROWS)
            for s in gl.static_range(STAGES - 1):
                if s < STEPS:
                    copy_act(act_s, s, x_rows, x_used, s * 128, WARPS)
                    copy_tile(gate_s, gate_f, s, words, fields, s)
                    copy_tile(up_s, up_f, s, up_words, up_fields, s)
                async_copy.commit_group()  # empty past the last step: wait_group counts groups
            g = gl.zeros([16, ROWS], gl.float32, mma_layout(WARPS))
            u = gl.zeros([16, ROWS], gl.float32, mma_layout(WARPS))
            for i in range(STEPS):
                async_copy.wait_group(STAGES - 2)  # this thread's copies of step i have landed
                gl.thread_barrier()  # everyone's have, and everyone is done reading the stage refilled next
                nxt = i + STAGES - 1
                if nxt < STEPS:
                    copy_act(act_s, nxt % STAGES, x_rows, x_used, nxt * 128, WARPS)
                    copy_tile(gate_s, gate_f, nxt % STAGES, words, fields, nxt)
                    copy_tile(up_s, up_f, nxt % STAGES, up_words, up_fields, nxt)
                async_copy.commit_group()
                buf = i % STAGES
                xt = act_operand(act_s, buf, WARPS)
                g = mma_v2(xt, weight_operand(gate_s, gate_f, buf, WARPS), g)
                u = mma_v2(xt, weight_operand(up_s, up_f, buf, WARPS), u)
            rest = situ_glu(g * UNSHIFT, u * UNSHIFT, beta1, beta2)
            pairs = gl.convert_layout(slot_pair, gl.SliceLayout(1, mma_layout(WARPS)))
            ok = gl.convert_layout(used, gl.SliceLayout(1, mma_layout(WARPS)))
            rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(0, mma_layout(WARPS)))
            for p in gl.static_range(HP):
                part = rest.to(gl.bfloat16)
                gl.store(h + (p * T * K + pairs[:, None]) * F + rows[None, :], part,
                         mask=ok[:, None] & (rows < F)[None, :])
                rest = rest - part.to(gl.float32)

    @gluon.jit(do_not_specialize=["T"])
    def gate_up_kernel(x, ids, wgu, mgu, h, T, K, F, beta1, beta2, L: gl.constexpr, TP: gl.constexpr,
                       BK: gl.constexpr, HP: gl.constexpr, ROWS: gl.constexpr, WARPS: gl.constexpr,
                       STAGES: gl.constexpr):
        """Grid (T k, F / ROWS): as _gate_up_kernel (x bf16 [T, l], h [HP, T k, F] bf16 parts)."""
        gate_up_rows(x, ids, wgu, mgu, h, gl.program_id(0), gl.program_id(1) * ROWS, T, K, F, beta1, beta2, L, TP,
                     BK, HP, ROWS, WARPS, STAGES)

    @gluon.jit
    def _h_arrived(arrivals, need):
        """Spin (plain loads) until the counter at `arrivals` reaches `need`, then acquire what its releases
        published: one RMW read (its value used, so it stays) and the barrier after it."""
        while gl.load(arrivals, volatile=True) < need:
            pass
        while gl.atomic_add(arrivals, 0, sem="acquire", scope="gpu") < need:
            pass
        gl.thread_barrier()

    @gluon.jit
    def down_rows(h, ids, weights, wd, md, partial, pair, row0, split, T, K, L, F: gl.constexpr, TP: gl.constexpr,
                  BK: gl.constexpr, ROWS: gl.constexpr, WARPS: gl.constexpr, SPLITS: gl.constexpr,
                  STAGES: gl.constexpr, arrivals, NEED: gl.constexpr):
        """One down program's work (rows row0 .. of split `split`, where `pair` leads its expert). NEED > 0
        (decode_fused_gluon): the ring's first weight stages are issued before waiting for the counter at
        `arrivals` to reach NEED (the expert's h published), and only then its h stages."""
        WORDS: gl.constexpr = F // 8
        STEPS: gl.constexpr = F // 128 // SPLITS
        e, leader, first, match, index = expert_tokens(ids, pair, T, K, TP, BK, WARPS)
        if leader:
            hit, slot_pair, used = slots(first, WARPS)
            # A token that names the expert in several slots gets the sum of their router weights.
            p_tok = gl.sum(gl.load(weights + index, mask=match, other=0.0), 1)
            p_slot = gl.sum(gl.where(hit, gl.convert_layout(p_tok, gl.SliceLayout(0, small_layout(WARPS)))[None, :], 0.0), 1)
            step0 = split * STEPS
            tile_words, tile_fields = block_tile(row0, WORDS, ROWS, WARPS)
            words = wd + e * L * WORDS + tile_words
            fields = md + e * L * (WORDS // 4) + tile_fields
            h_rows, h_used = act_rows(h, slot_pair, used, 1, F, WARPS)
            act_s = act_ring(STAGES)
            w_s, f_s = words_ring(STAGES, ROWS), fields_ring(STAGES, ROWS)
            if NEED > 0:
                for s in gl.static_range(STAGES - 1):
                    if s < STEPS:
                        copy_tile(w_s, f_s, s, words, fields, step0 + s)
                _h_arrived(arrivals, NEED)
            for s in gl.static_range(STAGES - 1):
                if s < STEPS:
                    copy_act(act_s, s, h_rows, h_used, (step0 + s) * 128, WARPS)
                    if NEED == 0:
                        copy_tile(w_s, f_s, s, words, fields, step0 + s)
                async_copy.commit_group()
            acc = gl.zeros([16, ROWS], gl.float32, mma_layout(WARPS))
            for i in range(STEPS):
                async_copy.wait_group(STAGES - 2)
                gl.thread_barrier()
                nxt = i + STAGES - 1
                if nxt < STEPS:
                    copy_act(act_s, nxt % STAGES, h_rows, h_used, (step0 + nxt) * 128, WARPS)
                    copy_tile(w_s, f_s, nxt % STAGES, words, fields, step0 + nxt)
                async_copy.commit_group()
                acc = mma_v2(act_operand(act_s, i % STAGES, WARPS), weight_operand(w_s, f_s, i % STAGES, WARPS), acc)
            pairs = gl.convert_layout(slot_pair, gl.SliceLayout(1, mma_layout(WARPS)))
            ok = gl.convert_layout(used, gl.SliceLayout(1, mma_layout(WARPS)))
            scale = gl.convert_layout(p_slot, gl.SliceLayout(1, mma_layout(WARPS)))
            rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(0, mma_layout(WARPS)))
            gl.store(partial + (split * T * K + pairs[:, None]) * L + rows[None, :],
                     acc * UNSHIFT * scale[:, None], mask=ok[:, None] & (rows < L)[None, :])

    @gluon.jit(do_not_specialize=["T"])
    def down_kernel(h, ids, weights, wd, md, partial, T, K, L, F: gl.constexpr, TP: gl.constexpr,
                    BK: gl.constexpr, ROWS: gl.constexpr, WARPS: gl.constexpr, SPLITS: gl.constexpr,
                    STAGES: gl.constexpr):
        """Grid (T k, l / ROWS, SPLITS): as _down_kernel with h in one bf16 part [1, T k, F]."""
        # NEED = 0: h is complete before this launch, nothing to wait for (`ids` only fills the unused
        # `arrivals` pointer; the one launch of decode_fused_gluon passes its counters there)
        down_rows(h, ids, weights, wd, md, partial, gl.program_id(0), gl.program_id(1) * ROWS, gl.program_id(2), T, K,
                  L, F, TP, BK, ROWS, WARPS, SPLITS, STAGES, ids, 0)


def fits(tokens: int, dtype: torch.dtype, rows: int, depth: int, tile: Tile) -> bool:
    """Whether the kernels compute a call, its device aside: bf16 activations of at most 16 tokens, tiles of
    128 columns and >= 16 rows whose MMAs give each warp 8 rows per instruction, `rows` weight rows and a
    reduction of `depth` columns that the tile divides into at least 2 steps a program (Triton 3.6 fails to
    lower these kernels with a single step: an LLVM assertion; 128-column steps also mean 16-word storage
    blocks). A register cap is the Triton kernels': these need far fewer."""
    return (dtype == torch.bfloat16 and tokens <= SLOTS and tile.cols == COLS and tile.rows >= 16
            and tile.rows >= 8 * tile.warps and rows % tile.rows == 0 and depth % (COLS * tile.splits) == 0
            and depth // (COLS * tile.splits) >= 2)


def _served(x: torch.Tensor, rows: int, depth: int, tile: Tile) -> bool:
    """`fits`, on CUDA where Gluon is present."""
    return gluon is not None and x.is_cuda and fits(x.shape[0], x.dtype, rows, depth, tile)


def serves_gate_up(x: torch.Tensor, F: int, tile: Tile) -> bool:
    """Whether `gate_up` computes this call (see `fits`)."""
    return _served(x, F, x.shape[1], tile)


def serves_down(x: torch.Tensor, F: int, h_parts: int, tile: Tile) -> bool:
    """Whether `down` computes this call: h in one bf16 part, and see `fits`."""
    return h_parts == 1 and _served(x, x.shape[1], F, tile)


def gate_up(x: torch.Tensor, ids: torch.Tensor, words: torch.Tensor, mults: torch.Tensor, h: torch.Tensor,
            beta1: float, beta2: float, tile: Tile, stages: int) -> None:
    """h [parts, T k, F] <- the SiTU-GLU of the routed experts' gate and up rows for x [T, l]
    (`serves_gate_up` must hold; words / mults: PreparedExperts.gate_up_*)."""
    T, L = x.shape
    K = ids.shape[1]
    F = words.shape[1] // 2
    require(stages >= 2, f"the Gluon pipelines need >= 2 stages, got {stages}")
    gate_up_kernel[(T * K, F // tile.rows)](x, ids, words, mults, h, T, K, F, beta1, beta2, L=L, TP=SLOTS,
                                            BK=next_pow2(K), HP=h.shape[0], ROWS=tile.rows, WARPS=tile.warps,
                                            STAGES=stages, num_warps=tile.warps)


def down(h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, words: torch.Tensor, mults: torch.Tensor,
         partial: torch.Tensor, tile: Tile, stages: int) -> None:
    """partial [splits, T k, l] <- router-weighted down rows of h [1, T k, F] (`serves_down` must hold;
    words / mults: PreparedExperts.down_*)."""
    T, K = ids.shape
    L, F = words.shape[1], h.shape[2]
    require(stages >= 2, f"the Gluon pipelines need >= 2 stages, got {stages}")
    down_kernel[(T * K, L // tile.rows, tile.splits)](h, ids, weights, words, mults, partial, T, K, L, F=F,
                                                      TP=SLOTS, BK=next_pow2(K), ROWS=tile.rows, WARPS=tile.warps,
                                                      SPLITS=tile.splits, STAGES=stages, num_warps=tile.warps)
