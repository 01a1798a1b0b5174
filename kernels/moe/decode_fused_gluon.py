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

from kernels._triton import next_pow2, require, sm_count
from kernels.moe.decode_gluon import fits
from kernels.moe.mxfp4_stream_gluon import SLOTS, gluon
from kernels.moe.tiles import Tile

if gluon is not None:
    from triton.experimental.gluon import language as gl

    from kernels.moe.decode_gluon import down_rows, gate_up_rows

    @gluon.jit
    def sm_id(like):
        """%smid of the running program (`like`: an int32 scalar the asm hangs on)."""
        return gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [like], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _gate_up_item(x, ids, wgu, mgu, h, arrivals, item, T, K, F, beta1, beta2, L: gl.constexpr, TP: gl.constexpr,
                      BK: gl.constexpr, GU_ROWS: gl.constexpr, WARPS: gl.constexpr, GU_STAGES: gl.constexpr):
        """A gate/up item: its rows of h, then the release on its pair's arrival counter."""
        GU_BLOCKS: gl.constexpr = F // GU_ROWS
        pair = item // GU_BLOCKS
        gate_up_rows(x, ids, wgu, mgu, h, pair, (item % GU_BLOCKS) * GU_ROWS, T, K, F, beta1, beta2, L, TP, BK, 1,
                     GU_ROWS, WARPS, GU_STAGES)
        gl.thread_barrier()  # every thread's h stores precede the (single-thread) release
        gl.atomic_add(arrivals + pair, 1, sem="release", scope="gpu")

    @gluon.jit(do_not_specialize=["T", "SMS"])
    def gate_up_down_kernel(x, ids, weights, wgu, mgu, wd, md, h, partial, counters, T, K, beta1, beta2, SMS,
                            L: gl.constexpr, F: gl.constexpr, TP: gl.constexpr, BK: gl.constexpr,
                            GU_ROWS: gl.constexpr, D_ROWS: gl.constexpr, WARPS: gl.constexpr,
                            GU_STAGES: gl.constexpr, D_STAGES: gl.constexpr, BY_SM: gl.constexpr,
                            RANK_SLOTS: gl.constexpr):
        """Grid (T k (F / GU_ROWS + l / D_ROWS)): counters (`_slots`) zero between launches; h [1, T k, F],
        partial [1, T k, l]."""
        GU_BLOCKS: gl.constexpr = F // GU_ROWS
        D_BLOCKS: gl.constexpr = L // D_ROWS
        gate_up_items = T * K * GU_BLOCKS
        down_items = T * K * D_BLOCKS
        arrivals = counters + 3
        if BY_SM:
            claims = arrivals + T * K
            ranks = claims + gate_up_items
            # The first ceil(items / SMS) programs on each SM take the gate/up tickets, the others down's.
            item = gate_up_items + down_items  # none yet
            sm = gl.minimum(sm_id(gate_up_items), RANK_SLOTS - 1)  # a shared last slot changes placement only
            if gl.atomic_add(ranks + sm, 1, sem="relaxed", scope="gpu") < (gate_up_items + SMS - 1) // SMS:
                ticket = gl.atomic_add(counters, 1, sem="relaxed", scope="gpu")
                if ticket < gate_up_items:
                    if gl.atomic_xchg(claims + ticket, 1, sem="relaxed", scope="gpu") == 0:
                        item = ticket
                        _gate_up_item(x, ids, wgu, mgu, h, arrivals, item, T, K, F, beta1, beta2, L, TP, BK, GU_ROWS,
                                      WARPS, GU_STAGES)
            if item == gate_up_items + down_items:
                down = gl.atomic_add(counters + 2, 1, sem="relaxed", scope="gpu")
                if down < down_items:
                    pair = down // D_BLOCKS
                    # Its pair's gate/up items nobody has claimed (their programs not dispatched, or gone to
                    # down tickets) run here first: every item a down program waits on is running.
                    for b in range(GU_BLOCKS):
                        it = pair * GU_BLOCKS + b
                        if gl.load(claims + it, volatile=True) == 0:
                            if gl.atomic_xchg(claims + it, 1, sem="relaxed", scope="gpu") == 0:
                                _gate_up_item(x, ids, wgu, mgu, h, arrivals, it, T, K, F, beta1, beta2, L, TP, BK,
                                              GU_ROWS, WARPS, GU_STAGES)
                    down_rows(h, ids, weights, wd, md, partial, pair, (down % D_BLOCKS) * D_ROWS, 0, T, K, L, F, TP,
                              BK, D_ROWS, WARPS, 1, D_STAGES, arrivals + pair, GU_BLOCKS)
        else:
            # Tickets in order: every gate/up item is claimed before any down item, so a waiting down program
            # only waits on running programs.
            item = gl.atomic_add(counters, 1, sem="relaxed", scope="gpu")
            if item < gate_up_items:
                _gate_up_item(x, ids, wgu, mgu, h, arrivals, item, T, K, F, beta1, beta2, L, TP, BK, GU_ROWS, WARPS,
                              GU_STAGES)
            else:
                down = item - gate_up_items
                pair = down // D_BLOCKS
                down_rows(h, ids, weights, wd, md, partial, pair, (down % D_BLOCKS) * D_ROWS, 0, T, K, L, F, TP, BK,
                          D_ROWS, WARPS, 1, D_STAGES, arrivals + pair, GU_BLOCKS)
        # Every program counts out; the last one (all others have taken their tickets and stopped waiting)
        # leaves the counters zeroed for the next launch.
        if gl.atomic_add(counters + 1, 1, sem="acq_rel", scope="gpu") == gate_up_items + down_items - 1:
            zero: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
            slot = gl.arange(0, 32 * WARPS, layout=zero)
            used = 3 + T * K
            if BY_SM:
                used += gate_up_items + RANK_SLOTS
            for z0 in range(0, used, 32 * WARPS):
                gl.store(counters + z0 + slot, gl.zeros([32 * WARPS], gl.int32, zero), mask=z0 + slot < used)


_COUNTERS: dict[torch.device, torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []  # replaced counters, kept: a graph captured earlier still names them
RANK_SLOTS = 256  # by_sm's programs-per-SM counters (an %smid past them shares the last)


def _slots(pairs: int, gate_up_items: int, by_sm: bool) -> int:
    """Counters a launch uses: gate/up ticket, finished, down ticket, one arrival counter per pair, and (by_sm)
    one claim per gate/up item and the programs counted per SM."""
    return 3 + pairs + (gate_up_items + RANK_SLOTS if by_sm else 0)


def _counters(slots: int, device: torch.device) -> torch.Tensor:
    """This module's zeroed int32 counters (at least `slots`), grown only outside a CUDA-graph capture (a decode
    warms every shape up eagerly before capturing it)."""
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < slots:
        require(device.type != "cuda" or not torch.cuda.is_current_stream_capturing(),
                "the fused MoE decode's counters must be sized by an eager call before a CUDA graph captures it")
        if counters is not None:
            _OUTGROWN.append(counters)
        counters = _COUNTERS[device] = torch.zeros(max(slots, 1024), dtype=torch.int32, device=device)
    return counters


def serves(x: torch.Tensor, F: int, h_parts: int, gate_up_tile: Tile, down_tile: Tile) -> bool:
    """Whether `gate_up_down` computes this call: CUDA with Gluon, h in one bf16 part, both tiles served by
    decode_gluon (`fits`) with equal warps and no split of down's reduction."""
    T, L = x.shape
    return (gluon is not None and x.is_cuda and h_parts == 1 and gate_up_tile.warps == down_tile.warps
            and down_tile.splits == 1 and fits(T, x.dtype, F, L, gate_up_tile) and fits(T, x.dtype, L, F, down_tile))


def gate_up_down(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: tuple[torch.Tensor, ...],
                 h: torch.Tensor, partial: torch.Tensor, beta1: float, beta2: float, gate_up_tile: Tile,
                 down_tile: Tile, gate_up_stages: int, down_stages: int, by_sm: bool = False) -> None:
    """h [1, T k, F] and partial [1, T k, l] <- decode_gluon.gate_up then decode_gluon.down, in one launch
    (`serves` must hold; experts: PreparedExperts, contiguous). by_sm: gate/up items go to the first programs
    of each SM, at most ceil(items / SMs) an SM (the tickets' arrival order can put 4 on one SM and none on
    another)."""
    T, L = x.shape
    K = ids.shape[1]
    gu_words, gu_mults, d_words, d_mults = experts
    F = gu_words.shape[1] // 2
    require(min(gate_up_stages, down_stages) >= 2, "the Gluon pipelines need >= 2 stages")
    gate_up_items = T * K * (F // gate_up_tile.rows)
    grid = gate_up_items + T * K * (L // down_tile.rows)
    counters = _counters(_slots(T * K, gate_up_items, by_sm), x.device)
    gate_up_down_kernel[(grid,)](x, ids, weights, gu_words, gu_mults, d_words, d_mults, h, partial, counters, T, K,
                                 beta1, beta2, sm_count(x.device, cpu=132), L=L, F=F, TP=SLOTS, BK=next_pow2(K),
                                 GU_ROWS=gate_up_tile.rows, D_ROWS=down_tile.rows, WARPS=down_tile.warps,
                                 GU_STAGES=gate_up_stages, D_STAGES=down_stages, BY_SM=by_sm, RANK_SLOTS=RANK_SLOTS,
                                 num_warps=down_tile.warps)
