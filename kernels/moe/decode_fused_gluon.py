"""The latent-MoE decode's gate/up and down in ONE launch (Gluon, GPU only; opt-in `gluon_fused` of
latent_moe_decode_prepared).

At T = 1 / 4 the two-launch call pays each kernel's ramp and tail, and the down's weight stream (a third of the
bytes) cannot start before gate/up has ended. Here every program takes its item from a ticket counter: the gate/up
tiles first (pair-major), then the down tiles (pair-major): a program of `decode_gluon.gate_up_rows` publishes its h
rows (a release on its pair's arrival counter); one of `decode_gluon.down_rows` issues its first weight stages, then
waits for its pair's counter to reach the expert's gate/up tiles, then streams h. A waiting program only waits on
items already claimed by running programs (tickets are taken in order, gate/up items never wait): no deadlock
whatever the dispatch order or residency. The last program to finish zeroes the counters, so the launch can be
replayed from a CUDA graph. The counters belong to this module, one buffer per device: calls on concurrent
streams of one device must not overlap (the decode runs its MoE layers on one stream).
"""

from __future__ import annotations

import torch

from kernels._triton import next_pow2, require
from kernels.moe.decode_gluon import fits
from kernels.moe.mxfp4_stream_gluon import SLOTS, gluon
from kernels.moe.tiles import Tile

if gluon is not None:
    from triton.experimental.gluon import language as gl

    from kernels.moe.decode_gluon import down_rows, gate_up_rows

    @gluon.jit
    def publish(arrival):
        """A gate/up item's h rows, published: one release on its pair's arrival counter."""
        gl.thread_barrier()  # every thread's h stores precede the (single-thread) release
        gl.atomic_add(arrival, 1, sem="release", scope="gpu")

    @gluon.jit
    def count_out(counters, items, pairs, TP: gl.constexpr, BK: gl.constexpr, WARPS: gl.constexpr):
        """Every program counts out; the last of `items` (all others have taken their tickets and stopped
        waiting) leaves the counters (ticket, finished, `pairs` arrivals) zeroed for the next launch."""
        if gl.atomic_add(counters + 1, 1, sem="acq_rel", scope="gpu") == items - 1:
            zero: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
            slot = gl.arange(0, 2 * TP * BK, layout=zero)  # >= T k + 2 (T <= TP)
            gl.store(counters + slot, gl.zeros([2 * TP * BK], gl.int32, zero), mask=slot < pairs + 2)

    @gluon.jit(do_not_specialize=["T"])
    def gate_up_down_kernel(x, ids, weights, wgu, mgu, wd, md, h, partial, counters, T, K, beta1, beta2,
                            L: gl.constexpr, F: gl.constexpr, TP: gl.constexpr, BK: gl.constexpr,
                            GU_ROWS: gl.constexpr, D_ROWS: gl.constexpr, WARPS: gl.constexpr,
                            GU_STAGES: gl.constexpr, D_STAGES: gl.constexpr):
        """Grid (T k (F / GU_ROWS + l / D_ROWS)): counters [ticket, finished, arrivals of T k pairs], zero
        between launches; h [1, T k, F], partial [1, T k, l]."""
        GU_BLOCKS: gl.constexpr = F // GU_ROWS
        D_BLOCKS: gl.constexpr = L // D_ROWS
        arrivals = counters + 2
        item = gl.atomic_add(counters, 1, sem="relaxed", scope="gpu")
        gate_up_items = T * K * GU_BLOCKS
        if item < gate_up_items:
            pair = item // GU_BLOCKS
            gate_up_rows(x, ids, wgu, mgu, h, pair, (item % GU_BLOCKS) * GU_ROWS, T, K, F, beta1, beta2, L, TP, BK,
                         1, GU_ROWS, WARPS, GU_STAGES)
            publish(arrivals + pair)
        else:
            down = item - gate_up_items
            pair = down // D_BLOCKS
            down_rows(h, ids, weights, wd, md, partial, pair, (down % D_BLOCKS) * D_ROWS, 0, T, K, L, F, TP, BK,
                      D_ROWS, WARPS, 1, D_STAGES, arrivals + pair, GU_BLOCKS)
        count_out(counters, gate_up_items + T * K * D_BLOCKS, T * K, TP, BK, WARPS)


_COUNTERS: dict[torch.device, torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []  # replaced counters, kept: a graph captured earlier still names them


def _counters(pairs: int, device: torch.device) -> torch.Tensor:
    """This module's zeroed int32 counters (ticket, finished, one per pair), grown only outside a CUDA-graph
    capture (a decode warms every shape up eagerly before capturing it)."""
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < pairs + 2:
        require(device.type != "cuda" or not torch.cuda.is_current_stream_capturing(),
                "the fused MoE decode's counters must be sized by an eager call before a CUDA graph captures it")
        if counters is not None:
            _OUTGROWN.append(counters)
        counters = _COUNTERS[device] = torch.zeros(max(pairs + 2, 258), dtype=torch.int32, device=device)
    return counters


def serves(x: torch.Tensor, F: int, h_parts: int, gate_up_tile: Tile, down_tile: Tile) -> bool:
    """Whether `gate_up_down` computes this call: CUDA with Gluon, h in one bf16 part, both tiles served by
    decode_gluon (`fits`) with equal warps and no split of down's reduction."""
    T, L = x.shape
    return (gluon is not None and x.is_cuda and h_parts == 1 and gate_up_tile.warps == down_tile.warps
            and down_tile.splits == 1 and fits(T, x.dtype, F, L, gate_up_tile) and fits(T, x.dtype, L, F, down_tile))


def gate_up_down(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: tuple[torch.Tensor, ...],
                 h: torch.Tensor, partial: torch.Tensor, beta1: float, beta2: float, gate_up_tile: Tile,
                 down_tile: Tile, gate_up_stages: int, down_stages: int) -> None:
    """h [1, T k, F] and partial [1, T k, l] <- decode_gluon.gate_up then decode_gluon.down, in one launch
    (`serves` must hold; experts: PreparedExperts, contiguous)."""
    T, L = x.shape
    K = ids.shape[1]
    gu_words, gu_mults, d_words, d_mults = experts
    F = gu_words.shape[1] // 2
    require(min(gate_up_stages, down_stages) >= 2, "the Gluon pipelines need >= 2 stages")
    grid = T * K * (F // gate_up_tile.rows + L // down_tile.rows)
    gate_up_down_kernel[(grid,)](x, ids, weights, gu_words, gu_mults, d_words, d_mults, h, partial,
                                 _counters(T * K, x.device), T, K, beta1, beta2, L=L, F=F, TP=SLOTS, BK=next_pow2(K),
                                 GU_ROWS=gate_up_tile.rows, D_ROWS=down_tile.rows, WARPS=down_tile.warps,
                                 GU_STAGES=gate_up_stages, D_STAGES=down_stages, num_warps=down_tile.warps)
