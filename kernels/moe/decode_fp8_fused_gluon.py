"""The FP8 gate/up and the FP8 down of the latent-MoE decode in ONE launch (Gluon, GPU only; experts prepared with
both FP8 layouts take it where `gluon_fused` says so, docs/kernels.md history 51).

decode_fused_gluon's protocol on the FP8 kernels' bodies: every program takes its item from a ticket counter, the
gate/up items first (pair-major: `decode_fp8_gluon.gate_up_rows`, 64 gate + 64 up rows, h written as e4m3 hi +
e5m2 lo at the fixed scale s), then the down items (`decode_fp8_down_gluon.down_rows`, two 64-row tiles), which
issue their first weight stages, wait for their pair's arrival counter (acquire), then stream h. Both bodies are
one warpgroup, so one launch has one warp count. No deadlock: a waiting program waits only on items already
claimed by running programs (tickets are taken in order, gate/up items never wait). The last program zeroes the
counters (decode_fused_gluon's buffer, one per device), so the launch replays from a CUDA graph; calls on
concurrent streams of one device must not overlap. The activation split (e4m3 hi + lo of x) stays its own launch.
"""

from __future__ import annotations

import torch

from kernels._triton import next_pow2, require
from kernels.moe import decode_fp8_down_gluon, decode_fp8_gluon
from kernels.moe.decode_fp8_down_gluon import TILES
from kernels.moe.decode_fp8_gluon import ROWS, WARPS
from kernels.moe.decode_fused_gluon import _counters
from kernels.moe.fp8_operands_triton import split_activations
from kernels.moe.mxfp4_stream_gluon import SLOTS, gluon

if gluon is not None:
    from triton.experimental.gluon import language as gl

    from kernels.moe.decode_fp8_down_gluon import down_rows
    from kernels.moe.decode_fp8_gluon import gate_up_rows
    from kernels.moe.decode_fused_gluon import count_out, publish

    _ROWS, _DOWN_ROWS, _WARPS = gl.constexpr(ROWS), gl.constexpr(TILES * ROWS), gl.constexpr(WARPS)

    @gluon.jit(do_not_specialize=["T"])
    def gate_up_down_kernel(xq, xs, ids, weights, wgu, mgu, wd, md, h, partial, counters, T, K, s, beta1, beta2,
                            L: gl.constexpr, F: gl.constexpr, TP: gl.constexpr, BK: gl.constexpr,
                            GU_STAGES: gl.constexpr, D_STAGES: gl.constexpr, N: gl.constexpr, HS: gl.constexpr):
        """Grid (T k (F / 64 + l / 128)), 4 warps: counters [ticket, finished, arrivals of T k pairs], zero
        between launches; h uint8 [T k, 2, F] (h / s = hi + lo, HS = 1 / s), partial [1, T k, l]."""
        GU_BLOCKS: gl.constexpr = F // _ROWS
        D_BLOCKS: gl.constexpr = L // _DOWN_ROWS
        arrivals = counters + 2
        item = gl.atomic_add(counters, 1, sem="relaxed", scope="gpu")
        gate_up_items = T * K * GU_BLOCKS
        if item < gate_up_items:
            pair = item // GU_BLOCKS
            gate_up_rows(xq, xs, ids, wgu, mgu, h, pair, (item % GU_BLOCKS) * _ROWS, T, K, F, beta1, beta2, L, TP,
                         BK, 1, GU_STAGES, N, HS)
            publish(arrivals + pair)
        else:
            down = item - gate_up_items
            pair = down // D_BLOCKS
            down_rows(h, ids, weights, wd, md, partial, pair, (down % D_BLOCKS) * _DOWN_ROWS, 0, T, K, L, s, F,
                      TP, BK, 1, D_STAGES, N, arrivals + pair, GU_BLOCKS)
        count_out(counters, gate_up_items + T * K * D_BLOCKS, T * K, TP, BK, _WARPS)


def serves(x: torch.Tensor, F: int, splits: int) -> bool:
    """Whether `gate_up_down` computes this call: both FP8 kernels serve it and down's reduction is whole."""
    return splits == 1 and decode_fp8_gluon.serves(x, F) and decode_fp8_down_gluon.serves(x, F, 1)


def gate_up_down(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: tuple[torch.Tensor, ...],
                 h: torch.Tensor, partial: torch.Tensor, beta1: float, beta2: float, s: float, gate_up_stages: int,
                 down_stages: int) -> None:
    """h uint8 [T k, 2, F] and partial [1, T k, l] <- decode_fp8_gluon.gate_up(..., h_scale=s) then
    decode_fp8_down_gluon.down, in one launch (`serves` must hold; experts: the FP8 layouts' words and
    multipliers of W_gate;W_up and W_down, contiguous)."""
    T, L = x.shape
    K = ids.shape[1]
    gu_words, gu_mults, d_words, d_mults = experts
    F = gu_words.shape[1] // 2
    require(min(gate_up_stages, down_stages) >= 2, "the Gluon pipelines need >= 2 stages")
    require(h.dtype == torch.uint8 and h.shape == (T * K, 2, F), f"h must be uint8 [{T * K}, 2, {F}]")
    require(partial.shape == (1, T * K, L), f"partial must be [1, {T * K}, {L}]")
    xq, xs = split_activations(x)
    grid = T * K * (F // ROWS + L // (TILES * ROWS))
    gate_up_down_kernel[(grid,)](xq, xs, ids, weights, gu_words, gu_mults, d_words, d_mults, h, partial,
                                 _counters(T * K, x.device), T, K, s, beta1, beta2, L=L, F=F, TP=SLOTS,
                                 BK=next_pow2(K), GU_STAGES=gate_up_stages, D_STAGES=down_stages,
                                 N=8 if T <= 8 else 16, HS=1.0 / s, num_warps=WARPS)
