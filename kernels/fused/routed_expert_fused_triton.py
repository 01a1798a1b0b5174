"""The routed experts' gate|up + GLU and down projection in ONE launch (routed_expert_gemm_triton.py's tiles).

Two launches pay two ramps, two last-wave tails, and the down projection cannot start a weight read before the
whole gate|up has ended. Here the work items are first every gate|up tile (expert-major), then every down tile
(same expert order), and a program takes its item from a ticket counter, not from its program id: an item can
then only wait on items with lower tickets, which running programs already hold and which never wait, so no
order of dispatch (nor anything else on the GPU) can deadlock it. A gate|up tile stores its act columns, then
arrives on its expert's counter (a barrier, then an atomic add with release); a down tile of expert e spins
(acquire) until all of e's gate|up column tiles arrived, after its routing scan, before its first read of act.
The last program to finish (a second ticket) sets the counters back to zero: nothing to clear between launches
(CUDA-graph replays included). Under the interpreter programs run one by one in grid order, so tickets follow
that order and every wait is already satisfied.

Counters: naive.routed_counters(E), int32 [2 + E] zeros (ticket, finished, one arrival count per expert), returned
to zero by each launch; two launches that may run at the same time need their own (fast_ffn.MoeDecode keeps one
per layer).
"""

from __future__ import annotations

import os

import torch

from kernels._triton import next_pow2, require, tl, triton
from kernels.fused.expert_gemm_triton import ACTIVATIONS
from kernels.fused.naive import Padding, require_activation, routed_counters
from kernels.fused.routed_expert_gemm_triton import token_tile, weight_descriptor

if triton is not None:
    from kernels.fused.routed_expert_gemm_triton import _routed_tile

    @triton.jit
    def _routed_fused_kernel(z, indices, position, marker, skip, w13, w13_desc, act, w2, w2_desc, out, counters, T,
                             F, L, stride_z, stride_w13, stride_act, stride_w2, stride_o, beta1, beta2,
                             EXPERTS: tl.constexpr, ACT: tl.constexpr, PADDING: tl.constexpr, TMA: tl.constexpr,
                             EVEN_L: tl.constexpr, EVEN_F: tl.constexpr, TOP_K: tl.constexpr,
                             TOP_K_P2: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_N_DOWN: tl.constexpr, BLOCK_K_UP: tl.constexpr,
                             BLOCK_K_DOWN: tl.constexpr, PREFETCH_LINES: tl.constexpr, COUNTERS_P2: tl.constexpr):
        """Item = ticket: [0, E * up_tiles) gate|up (z [T, L] -> act [R, F]), then E * down_tiles down tiles
        (act -> out [R (+ 1), L]); counters [2 + E]: ticket, finished, arrivals per expert."""
        up_tiles = tl.cdiv(F, BLOCK_N)
        up_items = EXPERTS * up_tiles
        items = up_items + EXPERTS * tl.cdiv(L, BLOCK_N_DOWN)
        item = tl.atomic_add(counters, 1, sem="relaxed", scope="gpu")
        arrivals = counters + 2
        if item < up_items:
            expert = item // up_tiles
            _routed_tile(z, indices, position, marker, skip, w13, w13_desc, act, T, F, L, stride_z, stride_w13,
                         stride_act, 2 * F, beta1, beta2, item % up_tiles, expert, arrivals, 0, ACT, True, PADDING,
                         TMA, EVEN_L, TOP_K, TOP_K_P2, BLOCK_P, BLOCK_T, BLOCK_N, BLOCK_K_UP, False)
            tl.debug_barrier()  # every thread's act stores before the release
            tl.atomic_add(arrivals + expert, 1, sem="release", scope="gpu")
        elif item < items:  # (counters not at rest: no tile, rather than a read out of bounds)
            down_tiles = tl.cdiv(L, BLOCK_N_DOWN)
            expert = (item - up_items) // down_tiles
            _routed_tile(act, indices, position, marker, skip, w2, w2_desc, out, T, L, F, stride_act, stride_w2,
                         stride_o, L, 1.0, 1.0, (item - up_items) % down_tiles, expert, arrivals + expert, up_tiles,
                         0, False, PADDING, TMA, EVEN_F, TOP_K, TOP_K_P2, BLOCK_P, BLOCK_T, BLOCK_N_DOWN,
                         BLOCK_K_DOWN, True, PREFETCH_LINES)
        finished = tl.atomic_add(counters + 1, 1, sem="acq_rel", scope="gpu")
        if finished == items - 1:  # the last program: every ticket is taken and every wait is over
            slots = tl.arange(0, COUNTERS_P2)
            tl.store(counters + slots, tl.zeros([COUNTERS_P2], dtype=tl.int32), mask=slots < EXPERTS + 2)


_SHARED_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}


def routed_expert_gate_up_down(z: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, indices: torch.Tensor,
                               activation: str = "situ", beta1: float = 4.0, beta2: float = 25.0,
                               block_n: int = 64, block_t: int | None = None, block_k: int = 64, num_warps: int = 4,
                               num_stages: int = 4, tma: bool = True, block_n_down: int | None = None,
                               prefetch: bool = False, padding: Padding | None = None,
                               counters: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as kernels.fused.naive.routed_expert_gate_up_down: z [T, l] (row-strided allowed), w13
    [E, 2F, l], w2 [E, l, F], the routing [T, k] -> (down rows [R = T*k (+ 1 with padding), l] sorted by expert,
    the row of each pair [T, k] int64); tilings as routed_expert_gate_up_glu / routed_expert_down (the same
    for both projections but the down tiles' width, block_n_down, default block_n). `prefetch`: a down tile asks
    L2 for its weight block before it waits (compiled only: the interpreter has no inline PTX). `counters`: `routed_counters(E)` on z's device, not used by a concurrent launch (None:
    one shared per device and E)."""
    require_activation(activation)
    require(z.dim() == 2 and w13.dim() == 3 and w2.dim() == 3 and w13.shape[2] == z.shape[1]
            and w13.shape[1] == 2 * w2.shape[2] and w2.shape[:2] == (w13.shape[0], z.shape[1]),
            f"z must be [T, l], w13 [E, 2F, l] and w2 [E, l, F], got {tuple(z.shape)}, {tuple(w13.shape)} and "
            f"{tuple(w2.shape)}")
    require(z.dtype == w13.dtype == w2.dtype, f"z, w13 and w2 must share a dtype, got {z.dtype}, {w13.dtype}, "
            f"{w2.dtype}")
    require(z.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1, "z, w13 and w2 need a unit inner stride")
    require(indices.dim() == 2 and indices.shape[0] == z.shape[0] and indices.is_contiguous(),
            f"indices must be the contiguous routing [T={z.shape[0]}, k], got {tuple(indices.shape)}")
    tokens, top_k = indices.shape
    if padding is not None:
        require(padding[0].shape == (tokens,) and padding[0].stride(0) == 1,
                f"the padding marker must be one value per token [{tokens}], got {tuple(padding[0].shape)}")
    experts, latent, ffn = w2.shape
    if counters is None:
        key = (z.device, experts)
        counters = _SHARED_COUNTERS.get(key)
        if counters is None:
            counters = _SHARED_COUNTERS[key] = routed_counters(experts, z.device)
    require(counters.shape == (experts + 2,) and counters.dtype == torch.int32 and counters.device == z.device,
            f"counters must be routed_counters({experts}) on {z.device}, got {tuple(counters.shape)} {counters.dtype}")
    rows = tokens * top_k
    act = torch.empty(rows, ffn, dtype=z.dtype, device=z.device)
    out = torch.empty(rows + (padding is not None), latent, dtype=z.dtype, device=z.device)
    position = torch.empty(indices.shape, dtype=torch.int64, device=z.device)
    if rows == 0:
        return out.zero_(), position
    k_up, k_down = min(block_k, max(16, next_pow2(latent))), min(block_k, max(16, next_pow2(ffn)))
    block_n_down = block_n_down or block_n
    items = experts * (triton.cdiv(ffn, block_n) + triton.cdiv(latent, block_n_down))
    lines = next_pow2(triton.cdiv(ffn * w2.element_size(), 128)) if prefetch and os.environ.get("TRITON_INTERPRET", "0") != "1" else 0
    marker, skip = (indices, 0) if padding is None else padding
    _routed_fused_kernel[(items,)](
        z, indices, position, marker, skip, w13, weight_descriptor(w13, block_n, k_up, tma), act, w2,
        weight_descriptor(w2, block_n_down, k_down, tma), out, counters, tokens, ffn, latent, z.stride(0), w13.stride(1),
        act.stride(0), w2.stride(1), out.stride(0), float(beta1), float(beta2), EXPERTS=experts,
        ACT=ACTIVATIONS[activation], PADDING=padding is not None, TMA=tma, EVEN_L=latent % k_up == 0,
        EVEN_F=ffn % k_down == 0, TOP_K=top_k, TOP_K_P2=next_pow2(top_k), BLOCK_P=max(16, next_pow2(tokens)),
        BLOCK_T=token_tile(rows, experts, block_t), BLOCK_N=block_n, BLOCK_N_DOWN=block_n_down, BLOCK_K_UP=k_up,
        BLOCK_K_DOWN=k_down, PREFETCH_LINES=lines, COUNTERS_P2=next_pow2(experts + 2), num_warps=num_warps,
        num_stages=num_stages)
    return out, position
