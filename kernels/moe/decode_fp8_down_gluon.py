"""The latent-MoE decode's down step on FP8 warpgroup MMAs (opt-in; GPU only, Gluon has no interpreter).

decode_fp8_gluon's form for W_down [E, l, F]: the same e4m3 weight layout (`fp8_operands_triton.prepare_weights`
is generic in rows), a program one warpgroup on two 64-row M tiles of the l rows (the second decoded while the
first's MMAs run, as gate and up there), the expert's token slots the N side (8 or 16), one wgmma per 32-column
MXFP4 group with the group's scale on its float32 result; the decode, multipliers, group MMAs and scaled adds
are decode_fp8_gluon's. Output: the router-weighted rows into partial [splits, T k, l] float32, which the
launcher's `_sum_pairs_kernel` adds per token (as after decode_gluon.down). Opt-in: experts prepared with
prepared_experts.prepare_experts(..., gate_up_fp8=True, down_fp8=True).

The activation h [T k, F] needs no amax and no split launch: SiTU-GLU bounds it, |gate| < beta1 and
|up part| < beta2, so |h| < beta1 beta2 (100 for the model's 4 and 25), and one power-of-two s fixed at
launch (`h_scale`) keeps every |h| / s <= 448 (e4m3's largest). The FP8 gate/up writes h / s = hi + lo (both
hi e4m3, lo e5m2: 2 bytes an element like bf16 h) in the MMA's K order (`decode_fp8_gluon.gate_up(...,
h_scale=s)`); two MMAs a group (hi, lo: e4m3 x e5m2) as there. Why lo in e5m2: with an e4m3 lo, every |h|
under s 2^-2 (lo below e4m3's normals) loses bits, and a whole call whose h is 10x smaller than the bench's
was 3e-2 from the oracle (float64 simulation, tests); e5m2 reaches 16 binades lower for one bit less
(~1.6e-3 there, as bf16 h).
"""

from __future__ import annotations

import math

import torch

from kernels._triton import next_pow2, require
from kernels.moe import fp8_operands_triton
from kernels.moe.decode_fp8_gluon import ROWS, WARPS
from kernels.moe.mxfp4_stream_gluon import SLOTS, gluon

E4M3_MAX = 448.0
MAX_H_SCALE = 2.0**-2  # the largest s checked against the oracle (tests): K3's betas (4, 25) need exactly it
TILES = 2  # 64-row M tiles a program


def h_scale(beta1: float, beta2: float) -> float:
    """The smallest power of two s with beta1 beta2 / s <= 448 (SiTU-GLU's |h| < beta1 beta2 in e4m3)."""
    bound = abs(beta1 * beta2)
    require(math.isfinite(bound) and bound > 0, f"fp8 h needs finite non-zero betas, got {beta1}, {beta2}")
    s = 2.0 ** math.ceil(math.log2(bound / E4M3_MAX))
    require(s <= MAX_H_SCALE, f"fp8 h: |h| < beta1 * beta2 = {bound:g} needs a scale {s:g} above {MAX_H_SCALE:g} "
            "(small h would lose precision untested): use the bf16 down")
    return s


def split_h_reference(h: torch.Tensor, s: float) -> torch.Tensor:
    """CPU reference of the FP8 gate/up's fp8 h: h [P, F] (|h| / s <= 448) -> uint8 [P, 2, F], h / s = hi
    (e4m3) + lo (e5m2), each rounded to nearest even, columns in the MMA's K order."""
    y = (h.double() / s)[:, fp8_operands_triton.mma_k_columns(h.shape[1])]
    hi = y.to(torch.float8_e4m3fn)
    lo = (y - hi.double()).to(torch.float8_e5m2)
    return torch.stack([hi.view(torch.uint8), lo.view(torch.uint8)], 1)


if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma_wait

    from kernels.moe.decode_fp8_gluon import (
        _X_SHARED,
        _copy_x,
        _gather,
        _issue,
        _mma,
        _next_step,
        _scaled,
        _x_rows,
    )
    from kernels.moe.decode_gluon import _h_arrived
    from kernels.moe.mxfp4_stream_gluon import (
        block_tile,
        copy_tile,
        expert_tokens,
        fields_ring,
        slots,
        small_layout,
        words_ring,
    )

    _ROWS = gl.constexpr(ROWS)

    @gluon.jit
    def _slot_values(v, slot, layout: gl.constexpr, N: gl.constexpr):
        """A [16] slot vector's first N entries in the accumulators' column layout."""
        return gl.convert_layout(_gather(v, slot, layout), gl.SliceLayout(0, _mma(N)))

    @gluon.jit
    def down_rows(hq, ids, weights, wd, md, partial, lead, row0, split, T, K, L, s, F: gl.constexpr,
                  TP: gl.constexpr, BK: gl.constexpr, SPLITS: gl.constexpr, STAGES: gl.constexpr, N: gl.constexpr,
                  arrivals, NEED: gl.constexpr):
        """One FP8 down program's work (the two 64-row tiles from row0 of split `split`, where pair `lead` leads
        its expert). NEED > 0 (decode_fp8_fused_gluon): the ring's first weight stages are issued before waiting
        for the counter at `arrivals` to reach NEED (the expert's h published), and only then its h stages."""
        WORDS: gl.constexpr = F // 8
        STEPS: gl.constexpr = F // 128 // SPLITS
        e, leader, first, match, index = expert_tokens(ids, lead, T, K, TP, BK, 4)
        if leader:
            hit, slot_pair, used = slots(first, 4)
            # A token that names the expert in several slots gets the sum of their router weights.
            p_tok = gl.sum(gl.load(weights + index, mask=match, other=0.0), 1)
            p_slot = gl.sum(gl.where(hit, gl.convert_layout(p_tok, gl.SliceLayout(0, small_layout(4)))[None, :], 0.0), 1)
            step0 = split * STEPS
            a_words, a_fields = block_tile(row0, WORDS, _ROWS, 4)
            a_words = wd + e * L * WORDS + a_words
            a_fields = md + e * L * (WORDS // 4) + a_fields
            b_words, b_fields = a_words + _ROWS * WORDS, a_fields + _ROWS * (WORDS // 4)  # 64 rows on (blocked)
            h_rows, h_ok = _x_rows(hq.to(gl.pointer_type(gl.float8e4nv)), slot_pair, used, 1, F, N)  # lo: e5m2
            h_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 8 * N, 32], _X_SHARED)
            a_s, a_f = words_ring(STAGES, _ROWS), fields_ring(STAGES, _ROWS)
            b_s, b_f = words_ring(STAGES, _ROWS), fields_ring(STAGES, _ROWS)
            if NEED > 0:
                for i in gl.static_range(STAGES - 1):
                    if i < STEPS:
                        copy_tile(a_s, a_f, i, a_words, a_fields, step0 + i)
                        copy_tile(b_s, b_f, i, b_words, b_fields, step0 + i)
                _h_arrived(arrivals, NEED)
            for i in gl.static_range(STAGES - 1):
                if i < STEPS:
                    _copy_x(h_s, i, h_rows, h_ok, step0 + i)
                    if NEED == 0:
                        copy_tile(a_s, a_f, i, a_words, a_fields, step0 + i)
                        copy_tile(b_s, b_f, i, b_words, b_fields, step0 + i)
                async_copy.commit_group()
            acc_a = gl.zeros([_ROWS, N], gl.float32, _mma(N))
            acc_b = gl.zeros([_ROWS, N], gl.float32, _mma(N))
            for i in range(STEPS):
                _next_step(h_s, a_s, a_f, b_s, b_f, h_rows, h_ok, a_words, a_fields, b_words, b_fields, i, step0,
                           STEPS, STAGES)
                buf = i % STAGES
                h_b = h_s.index(buf)
                lo_b = h_b._reinterpret(gl.float8e5, [8 * N, 32], _X_SHARED)
                a0, a1, a2, a3 = _issue(a_s, h_b, lo_b, buf, N)
                b0, b1, b2, b3 = _issue(b_s, h_b, lo_b, buf, N)  # decoded while tile a's MMAs run
                a0, a1, a2, a3, b0, b1, b2, b3 = warpgroup_mma_wait(0, deps=[a0, a1, a2, a3, b0, b1, b2, b3])
                acc_a = _scaled(acc_a, a_f, buf, a0, a1, a2, a3, N)
                acc_b = _scaled(acc_b, b_f, buf, b0, b1, b2, b3, N)
            cols: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [4, 1], [1, 0])  # [N, 16] slot gathers
            slot = gl.arange(0, N, layout=gl.SliceLayout(1, cols))
            pair = _slot_values(slot_pair, slot, cols, N)
            ok = _slot_values(used.to(gl.int32), slot, cols, N) > 0
            scale = _slot_values(p_slot, slot, cols, N) * s
            rows = row0 + gl.arange(0, _ROWS, layout=gl.SliceLayout(1, _mma(N)))
            out = partial + (split * T * K + pair[None, :]) * L + rows[:, None]
            gl.store(out, acc_a * scale[None, :], mask=ok[None, :])
            gl.store(out + _ROWS, acc_b * scale[None, :], mask=ok[None, :])

    @gluon.jit(do_not_specialize=["T"])
    def down_kernel(hq, ids, weights, wd, md, partial, T, K, L, s, F: gl.constexpr, TP: gl.constexpr,
                    BK: gl.constexpr, SPLITS: gl.constexpr, STAGES: gl.constexpr, N: gl.constexpr):
        """Grid (T k, l / 128, SPLITS), 4 warps: partial[split, pair] <- p * s * (rows of W_down) . (hi + lo)
        over the split's F / SPLITS columns, for the experts' leading pairs (hq: uint8 [T k, 2, F])."""
        # NEED = 0: h is complete before this launch (`ids` only fills the unused `arrivals` pointer)
        down_rows(hq, ids, weights, wd, md, partial, gl.program_id(0), gl.program_id(1) * (2 * _ROWS),
                  gl.program_id(2), T, K, L, s, F, TP, BK, SPLITS, STAGES, N, ids, 0)


def serves(x: torch.Tensor, F: int, splits: int) -> bool:
    """Whether `down` computes a call on x [T, l] (beside decode_fp8_gluon.serves for its gate/up): CUDA, at
    most 16 tokens, l a multiple of 128 rows, F of 128 columns in >= 2 steps a split (Triton 3.6 cannot lower
    one step)."""
    return (gluon is not None and x.is_cuda and x.shape[0] <= SLOTS and x.shape[1] % (TILES * ROWS) == 0
            and F % (128 * splits) == 0 and F // (128 * splits) >= 2)


def down(hq: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, words: torch.Tensor, mults: torch.Tensor,
         partial: torch.Tensor, s: float, stages: int) -> None:
    """partial [splits, T k, l] <- router-weighted down rows of h = s (hi + lo) (hq uint8 [T k, 2, F] from
    decode_fp8_gluon.gate_up(..., h_scale=s); words / mults: fp8_operands_triton.prepare_weights of W_down)."""
    T, K = ids.shape
    L, F = words.shape[1], hq.shape[2]
    splits = partial.shape[0]
    require(stages >= 2, f"the Gluon pipelines need >= 2 stages, got {stages}")
    require(hq.dtype == torch.uint8 and hq.shape == (T * K, 2, F), f"hq must be uint8 [{T * K}, 2, {F}]")
    require(partial.shape[1:] == (T * K, L), f"partial must be [splits, {T * K}, {L}]")
    down_kernel[(T * K, L // (TILES * ROWS), splits)](hq, ids, weights, words, mults, partial, T, K, L, s, F=F,
                                                      TP=SLOTS, BK=next_pow2(K), SPLITS=splits, STAGES=stages,
                                                      N=8 if T <= 8 else 16, num_warps=WARPS)
