"""The latent-MoE decode's gate/up and down steps on Hopper's warpgroup MMA (wgmma), in Gluon (GPU only).

The same computations as `decode_gluon.gate_up_kernel` / `down_kernel`, with the operands' roles swapped: a
program is one warpgroup (4 warps) on 64 (gate/up: 64 gate and 64 up rows) or `R` (down) weight rows, which
are the MMA's M side, decoded in registers straight into wgmma's A fragments (each warp 16 rows of each 64:
rows g and g + 8 of lane 4 g + t, its 4 words 4 t .. 4 t + 3 of a 128-column step, all of scale group t, so
one multiplier a row and step); the expert's 16 token slots are the N side, read by the tensor cores from
shared memory. wgmma has twice mma.sync's throughput on the H200, and the activations are permuted into
the MMA's K order once per program and step (in registers, stored to an NVMMA-swizzled tile) instead of
once per warp. K order: the word of lane t and row r at position j + 4 e (its register j holds codes j and
j + 4, `mxfp4_tile_triton`) is column 32 t + 8 b + j + 4 e of the step (b: the word of the 4), and the MMA's
k = 32 b + 16 (j // 2) + 8 (j % 2) + 2 t + e.
"""

from __future__ import annotations

import torch

from kernels._triton import next_pow2, require
from kernels.moe.mxfp4_stream_gluon import SLOTS, gluon
from kernels.moe.tiles import Tile

ROWS, WARPS = 64, 4  # one warpgroup, one wgmma M tile (gate/up: 64 rows of each)
# Axis orders (after a leading row / token axis) that put a step's 128 columns in the MMA's K order, big-endian
# bits k = (b1 b0 j1 j0 t1 t0 e): WEIGHT_K_ORDER from the decoded words [word (t1 t0 b1 b0), e, j0, j1],
# ACT_K_ORDER from the activation columns c = 32 t + 8 b + 4 e + j, bits (t1 t0 b1 b0 e j1 j0).
WEIGHT_K_ORDER = (0, 3, 4, 7, 6, 1, 2, 5)
ACT_K_ORDER = (0, 3, 4, 6, 7, 1, 2, 5)

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from kernels.moe.decode_gluon import situ_glu
    from kernels.moe.mxfp4_stream_gluon import (
        _DECODE,
        _FIELDS,
        UNSHIFT,
        _act_copy_layout,
        _act_view,
        act_ring,
        act_rows,
        block_tile,
        copy_act,
        copy_tile,
        expert_tokens,
        fields_ring,
        slots,
        small_layout,
        words_ring,
    )

    _ROWS, _SLOTS = gl.constexpr(ROWS), gl.constexpr(SLOTS)
    _WEIGHT_K_ORDER, _ACT_K_ORDER = gl.constexpr(WEIGHT_K_ORDER), gl.constexpr(ACT_K_ORDER)
    _MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16]))
    _B_SHARED = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
    @gluon.constexpr_function
    def _words_layout(rows):
        """[rows, 16] words of a step: lane 4 g + t, warp w: rows 16 w + g (+ 8, + 64 i: registers), words
        4 t .. 4 t + 3."""
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [8, 0]] + [[64 << b, 0] for b in range(rows.bit_length() - 7)],
            lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]], warp_bases=[[16, 0], [32, 0]], block_bases=[],
            shape=[rows, 16])

    @gluon.constexpr_function
    def _groups_layout(rows):
        """[rows, 4 groups, 4 words of a group]: as `_words_layout`, so that a reshape gives it (word 4 t + b is
        in group t)."""
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 1], [0, 0, 2], [8, 0, 0]] + [[64 << b, 0, 0] for b in range(rows.bit_length() - 7)],
            lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
            warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[rows, 4, 4])

    @gluon.jit
    def _weights(words_s, fields_s, buf):
        """Stage `buf`'s [R, 16] words and [R, 4] fields -> the bf16 [R, 128] A operand (weights x 2^-SHIFT,
        columns in the MMA's K order)."""
        R: gl.constexpr = words_s.shape[1]
        w = words_s.index(buf).load(_words_layout(R)).to(gl.uint32, bitcast=True)
        f = fields_s.index(buf).load(gl.SliceLayout(2, _groups_layout(R))).to(gl.uint32) * _FIELDS
        m = gl.reshape(f[:, :, None] + gl.full([R, 4, 4], 0, gl.uint32, _groups_layout(R)), [R, 16])
        m = gl.convert_layout(m, _words_layout(R), assert_trivial=True)
        e0, e1, e2, e3, e4, e5, e6, e7 = gl.inline_asm_elementwise(
            _DECODE, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [w, m], dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1)
        t = gl.join(gl.join(gl.join(e0, e4), gl.join(e1, e5)), gl.join(gl.join(e2, e6), gl.join(e3, e7)))
        t = gl.reshape(t, [R, 2, 2, 2, 2, 2, 2, 2])
        t = gl.reshape(gl.permute(t, _WEIGHT_K_ORDER.value), [R, 128])
        return gl.convert_layout(t, gl.DotOperandLayout(0, _MMA, 2), assert_trivial=True)

    @gluon.jit
    def _stage_b(ring, buf, b_s):
        """Stage `buf`'s [16, 128] activation rows (column c = 32 t + 8 b + 4 e + j) -> b_s in the MMA's K
        order (k = 32 b + 16 (j // 2) + 8 (j % 2) + 2 t + e), as [16 tokens, 128 k]."""
        a = _act_view(ring, buf).load(_act_copy_layout(4))  # read as copied: 8 columns (16 B) a thread
        a = gl.reshape(a, [_SLOTS, 2, 2, 2, 2, 2, 2, 2])
        a = gl.reshape(gl.permute(a, _ACT_K_ORDER.value), [_SLOTS, 128])
        b_s.store(a)

    @gluon.jit(do_not_specialize=["T"])
    def gate_up_kernel(x, ids, wgu, mgu, h, T, K, F, beta1, beta2, L: gl.constexpr, TP: gl.constexpr,
                             BK: gl.constexpr, HP: gl.constexpr, STAGES: gl.constexpr):
        """Grid (T k, F / 64), 4 warps: as decode_gluon.gate_up_kernel (h in x's precision: HP bf16 parts)."""
        WORDS: gl.constexpr = L // 8
        STEPS: gl.constexpr = L // 128
        e, leader, first, _match, _index = expert_tokens(ids, gl.program_id(0), T, K, TP, BK, 4)
        if leader:
            _hit, slot_pair, used = slots(first, 4)
            row0 = gl.program_id(1) * _ROWS
            gate_words, gate_fields = block_tile(row0, WORDS, _ROWS, 4)
            words = wgu + e * (2 * F) * WORDS + gate_words
            fields = mgu + e * (2 * F) * (WORDS // 4) + gate_fields
            up_words, up_fields = words + F * WORDS, fields + F * (WORDS // 4)
            x_rows, x_used = act_rows(x, slot_pair, used, K, L, 4)
            act_s = act_ring(STAGES)
            gate_s, gate_f = words_ring(STAGES, _ROWS), fields_ring(STAGES, _ROWS)
            up_s, up_f = words_ring(STAGES, _ROWS), fields_ring(STAGES, _ROWS)
            b_s = gl.allocate_shared_memory(gl.bfloat16, [_SLOTS, 128], _B_SHARED)
            for s in gl.static_range(STAGES - 1):
                if s < STEPS:
                    copy_act(act_s, s, x_rows, x_used, s * 128, 4)
                    copy_tile(gate_s, gate_f, s, words, fields, s)
                    copy_tile(up_s, up_f, s, up_words, up_fields, s)
                async_copy.commit_group()
            g = gl.zeros([_ROWS, _SLOTS], gl.float32, _MMA)
            u = gl.zeros([_ROWS, _SLOTS], gl.float32, _MMA)
            for i in range(STEPS):
                async_copy.wait_group(STAGES - 2)
                gl.thread_barrier()  # step i landed everywhere; the previous step's MMAs and reads are done
                nxt = i + STAGES - 1
                if nxt < STEPS:
                    copy_act(act_s, nxt % STAGES, x_rows, x_used, nxt * 128, 4)
                    copy_tile(gate_s, gate_f, nxt % STAGES, words, fields, nxt)
                    copy_tile(up_s, up_f, nxt % STAGES, up_words, up_fields, nxt)
                async_copy.commit_group()
                buf = i % STAGES
                _stage_b(act_s, buf, b_s)
                fence_async_shared()
                gl.thread_barrier()
                xt = b_s.permute([1, 0])
                gw = _weights(gate_s, gate_f, buf)
                g = warpgroup_mma(gw, xt, g, is_async=True)
                uw = _weights(up_s, up_f, buf)  # decoded while the gate MMAs run
                u = warpgroup_mma(uw, xt, u, is_async=True)
                g, u, gw, uw = warpgroup_mma_wait(0, deps=[g, u, gw, uw])
            rest = situ_glu(g * UNSHIFT, u * UNSHIFT, beta1, beta2)
            pair = gl.convert_layout(slot_pair, gl.SliceLayout(0, _MMA))
            ok = gl.convert_layout(used, gl.SliceLayout(0, _MMA))
            rows = row0 + gl.arange(0, _ROWS, layout=gl.SliceLayout(1, _MMA))
            for p in gl.static_range(HP):
                part = rest.to(gl.bfloat16)
                gl.store(h + (p * T * K + pair[None, :]) * F + rows[:, None], part,
                         mask=ok[None, :] & (rows < F)[:, None])
                rest = rest - part.to(gl.float32)


    @gluon.jit(do_not_specialize=["T"])
    def down_kernel(h, ids, weights, wd, md, partial, T, K, L, F: gl.constexpr, TP: gl.constexpr, BK: gl.constexpr,
                    R: gl.constexpr, SPLITS: gl.constexpr, STAGES: gl.constexpr):
        """Grid (T k, l / R, SPLITS), 4 warps: as decode_gluon.down_kernel (h in one bf16 part [1, T k, F])."""
        WORDS: gl.constexpr = F // 8
        STEPS: gl.constexpr = F // 128 // SPLITS
        e, leader, first, match, index = expert_tokens(ids, gl.program_id(0), T, K, TP, BK, 4)
        if leader:
            hit, slot_pair, used = slots(first, 4)
            # A token that names the expert in several slots gets the sum of their router weights.
            p_tok = gl.sum(gl.load(weights + index, mask=match, other=0.0), 1)
            p_slot = gl.sum(gl.where(hit, gl.convert_layout(p_tok, gl.SliceLayout(0, small_layout(4)))[None, :], 0.0), 1)
            row0 = gl.program_id(1) * R
            step0 = gl.program_id(2) * STEPS
            tile_words, tile_fields = block_tile(row0, WORDS, R, 4)
            words = wd + e * L * WORDS + tile_words
            fields = md + e * L * (WORDS // 4) + tile_fields
            h_rows, h_used = act_rows(h, slot_pair, used, 1, F, 4)
            act_s = act_ring(STAGES)
            w_s, f_s = words_ring(STAGES, R), fields_ring(STAGES, R)
            b_s = gl.allocate_shared_memory(gl.bfloat16, [_SLOTS, 128], _B_SHARED)
            for s in gl.static_range(STAGES - 1):
                if s < STEPS:
                    copy_act(act_s, s, h_rows, h_used, (step0 + s) * 128, 4)
                    copy_tile(w_s, f_s, s, words, fields, step0 + s)
                async_copy.commit_group()
            acc = gl.zeros([R, _SLOTS], gl.float32, _MMA)
            for i in range(STEPS):
                async_copy.wait_group(STAGES - 2)
                gl.thread_barrier()
                nxt = i + STAGES - 1
                if nxt < STEPS:
                    copy_act(act_s, nxt % STAGES, h_rows, h_used, (step0 + nxt) * 128, 4)
                    copy_tile(w_s, f_s, nxt % STAGES, words, fields, step0 + nxt)
                async_copy.commit_group()
                buf = i % STAGES
                _stage_b(act_s, buf, b_s)
                fence_async_shared()
                gl.thread_barrier()
                ww = _weights(w_s, f_s, buf)
                acc = warpgroup_mma(ww, b_s.permute([1, 0]), acc, is_async=True)
                acc, ww = warpgroup_mma_wait(0, deps=[acc, ww])
            pair = gl.convert_layout(slot_pair, gl.SliceLayout(0, _MMA))
            ok = gl.convert_layout(used, gl.SliceLayout(0, _MMA))
            scale = gl.convert_layout(p_slot, gl.SliceLayout(0, _MMA))
            rows = row0 + gl.arange(0, R, layout=gl.SliceLayout(1, _MMA))
            gl.store(partial + (gl.program_id(2) * T * K + pair[None, :]) * L + rows[:, None],
                     acc * UNSHIFT * scale[None, :], mask=ok[None, :] & (rows < L)[:, None])


GATE_UP_TILE = Tile(ROWS, 128, WARPS)  # what `gate_up` runs (for decode_gluon.serves_gate_up)
DOWN_TILE = Tile(128, 128, WARPS)  # `down`'s default: 128 rows (two M tiles) as decode_gluon's down


def serves_down_tile(tile: Tile) -> bool:
    """Down tiles `down` runs: 128 columns, 4 warps, rows a multiple of 64 up to 128 (register budget)."""
    return tile.cols == 128 and tile.warps == WARPS and tile.rows in (64, 128)


def gate_up(x: torch.Tensor, ids: torch.Tensor, words: torch.Tensor, mults: torch.Tensor, h: torch.Tensor,
            beta1: float, beta2: float, stages: int) -> None:
    """decode_gluon.gate_up on 64-row warpgroup programs (`decode_gluon.serves_gate_up` with GATE_UP_TILE must
    hold)."""
    T, L = x.shape
    K = ids.shape[1]
    F = words.shape[1] // 2
    require(stages >= 2, f"the Gluon pipelines need >= 2 stages, got {stages}")
    gate_up_kernel[(T * K, F // ROWS)](x, ids, words, mults, h, T, K, F, beta1, beta2, L=L, TP=SLOTS, BK=next_pow2(K),
                                       HP=h.shape[0], STAGES=stages, num_warps=WARPS)


def down(h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, words: torch.Tensor, mults: torch.Tensor,
         partial: torch.Tensor, tile: Tile, stages: int) -> None:
    """decode_gluon.down on warpgroup programs of `tile.rows` rows (`decode_gluon.serves_down` and
    `serves_down_tile` must hold)."""
    T, K = ids.shape
    L, F = words.shape[1], h.shape[2]
    require(stages >= 2, f"the Gluon pipelines need >= 2 stages, got {stages}")
    require(serves_down_tile(tile), f"warpgroup down tiles are 64 or 128 rows x 128 columns, 4 warps: {tile.label()}")
    down_kernel[(T * K, L // tile.rows, tile.splits)](h, ids, weights, words, mults, partial, T, K, L, F=F, TP=SLOTS,
                                                      BK=next_pow2(K), R=tile.rows, SPLITS=tile.splits,
                                                      STAGES=stages, num_warps=WARPS)
