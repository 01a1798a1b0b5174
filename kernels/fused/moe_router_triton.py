"""The MoE router of one decode step in one launch (K3 report eq.13): tokens x [T, H] -> logits x @ W^T
accumulated in float32 -> sigmoid scores, selection = scores + bias, top-k, weights from the unbiased
scores, renormalised, scaled (replaces x.float()'s copy, cuBLAS's float32 GEMM and its split-K reduction,
sigmoid, the bias add, top-k's two kernels, gather, sum, divide and scale).

Logits: a tensor-core dot of x and W in their own dtype (bf16 at serving) with float32 accumulation. A bf16
product is exact in float32, so the logits equal MoEGate's x.float() @ W.float()^T up to the order of the
float32 sums (as any GEMM's split does). A first in-kernel version ran tl.dot in IEEE float32 (CUDA-core
FMAs) and took 78 us a launch on the H200; a cuBLAS float32 GEMM + a selection kernel then took ~12 us a
layer in four launches (the cast's copy, the sgemm, its split-K reduce, the selection).
Program = (BLOCK_T tokens against all experts, one slice of H): a short K loop of BLOCK_H steps; the slices'
float32 partial logits meet in `split_scratch`, where the last program of the token tile to arrive sums them
in slice order (top-k needs the whole row), then k rounds of (max, lowest index reaching it, mask it out).
NaN selections count as the largest (torch.topk's rule), so every pick is a valid expert id whatever the
activations hold. Picks come out in descending selection order, as torch.topk's sorted output.
"""

from __future__ import annotations

import torch

from kernels._triton import next_pow2, require, sm_count, tl, triton
from kernels.fused.split_scratch import split_scratch

MAX_SPLITS = 8  # programs per token tile along H (the selection needs every expert's logit in one program)

if triton is not None:

    # T is not specialised (its divisibility by 16, T == 1): every prompt length then shares the split and the
    # unsplit kernel a worker's warm-up compiled, instead of a first request paying a JIT compile (~1 s)
    @triton.jit(do_not_specialize=["T"])
    def _route_kernel(x, w, bias, weights_out, indices_out, partials, counters, T, E, H, H_SPLIT, SPLITS,
                      stride_x, stride_w, scaling, TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                      RENORMALIZE: tl.constexpr, EVEN_H: tl.constexpr, BLOCK_T: tl.constexpr,
                      BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
        tile, split = tl.program_id(0), tl.program_id(1)
        tokens = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        experts = tl.arange(0, BLOCK_E)
        hs = split * H_SPLIT + tl.arange(0, BLOCK_H)
        token_ok, expert_ok = tokens < T, experts < E
        x_at = x + tokens.to(tl.int64)[:, None] * stride_x + hs[None, :]
        w_at = w + experts.to(tl.int64)[:, None] * stride_w + hs[None, :]
        logits = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
        for h0 in range(0, H_SPLIT, BLOCK_H):
            x_ok, w_ok = token_ok[:, None], expert_ok[:, None]
            if not EVEN_H:  # a mask along H costs the loads their vector width
                x_ok = x_ok & (h0 + hs < H)[None, :]
                w_ok = w_ok & (h0 + hs < H)[None, :]
            logits = tl.dot(tl.load(x_at, mask=x_ok, other=0.0), tl.trans(tl.load(w_at, mask=w_ok, other=0.0)),
                            logits, input_precision="ieee")
            x_at += BLOCK_H
            w_at += BLOCK_H
        if SPLITS > 1:  # the last program of the token tile to arrive sums the splits in order and selects
            at = tokens.to(tl.int64)[:, None] * BLOCK_E + experts[None, :]
            tl.store(partials + split * T * BLOCK_E + at, logits, mask=token_ok[:, None])
            tl.debug_barrier()  # every thread's partial is written before the release below
            arrived = tl.atomic_add(counters + tile, 1)  # acq_rel: the siblings' partials happen before
            token_ok = tokens < tl.where(arrived == SPLITS - 1, T, 0)
            logits = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
            for s in range(0, SPLITS):
                logits += tl.load(partials + s * T * BLOCK_E + at, mask=token_ok[:, None], other=0.0,
                                  cache_modifier=".cg")
            tl.atomic_xchg(counters + tile, 0, mask=arrived == SPLITS - 1)  # ready for the next launch
        scores = tl.sigmoid(logits)
        selection = scores
        if HAS_BIAS:
            selection = scores + tl.load(bias + experts, mask=expert_ok, other=0.0).to(tl.float32)[None, :]
        selection = tl.where(selection != selection, float("inf"), selection)  # NaN: the largest
        selection = tl.where(expert_ok[None, :], selection, float("-inf"))
        slots = tl.arange(0, BLOCK_K)
        picked_w = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
        picked_i = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int64)
        for j in tl.static_range(TOP_K):
            best = tl.max(selection, axis=1)
            index = tl.min(tl.where(selection == best[:, None], experts[None, :], BLOCK_E), axis=1)
            chosen = experts[None, :] == index[:, None]
            score = tl.sum(tl.where(chosen, scores, 0.0), axis=1)
            picked_w = tl.where(slots[None, :] == j, score[:, None], picked_w)
            picked_i = tl.where(slots[None, :] == j, index.to(tl.int64)[:, None], picked_i)
            selection = tl.where(chosen, float("-inf"), selection)
        if RENORMALIZE:
            picked_w = picked_w / tl.sum(picked_w, axis=1)[:, None]
        picked_w = picked_w * scaling
        out = tokens.to(tl.int64)[:, None] * TOP_K + slots[None, :]
        ok = token_ok[:, None] & (slots[None, :] < TOP_K)
        tl.store(weights_out + out, picked_w, mask=ok)
        tl.store(indices_out + out, picked_i, mask=ok)


def moe_route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int,
              renormalize: bool = True, scaling: float = 1.0, block_t: int = 16, block_h: int = 256,
              num_warps: int = 4, num_stages: int = 4,
              splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as kernels.fused.naive.moe_route: x [T, H] (row-strided allowed) and weight [E, H] of one
    dtype -> (weights [T, k] float32, expert ids [T, k] int64). `splits`: programs per token tile along H
    (default: a power of two up to one per BLOCK_H slice, MAX_SPLITS and about two programs per SM), each one K step or a
    few, so the logits take about one memory latency instead of H / BLOCK_H dependent ones (a single program
    per tile took 7.5 us at 64 tokens on the H200, whatever its block shape)."""
    require(x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1] and x.stride(1) == 1
            and weight.stride(1) == 1, f"x must be [T, H] and weight [E, H] with unit column stride, got "
            f"{tuple(x.shape)} and {tuple(weight.shape)}")
    require(x.dtype == weight.dtype, f"x and weight must share a dtype, got {x.dtype} and {weight.dtype}")
    (tokens, hidden), experts = x.shape, weight.shape[0]
    require(1 <= top_k <= experts, f"top_k must be in [1, {experts}], got {top_k}")
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=x.device)
    indices = torch.empty(tokens, top_k, dtype=torch.int64, device=x.device)
    if tokens:
        block_h = min(block_h, max(16, next_pow2(hidden)))
        block_e = max(16, next_pow2(experts))
        tiles = triton.cdiv(tokens, block_t)
        if splits is None:  # split only while the token tiles leave SMs idle (decode): a prefill chunk's tiles
            # fill them alone, and its partials (splits x T x BLOCK_E float32) would grow the scratch with T
            wanted = triton.cdiv(2 * sm_count(x.device, cpu=132), tiles)
            splits = min(MAX_SPLITS, triton.cdiv(hidden, block_h), wanted)
            splits = 1 << (splits.bit_length() - 1)  # a power of two: slices stay even (one EVEN_H variant)
        h_split = triton.cdiv(triton.cdiv(hidden, splits), block_h) * block_h
        splits = triton.cdiv(hidden, h_split)  # no empty trailing slices
        grid = (tiles, splits)
        # unsplit, the kernel touches neither: ask for nothing that would grow the shared scratch
        split = splits > 1
        partials, counters = split_scratch(splits * tokens * block_e if split else 1, tiles if split else 1, x.device)
        _route_kernel[grid](
            x, weight, x if bias is None else bias, weights, indices, partials, counters, tokens, experts, hidden,
            h_split, splits, x.stride(0), weight.stride(0), float(scaling), TOP_K=top_k, HAS_BIAS=bias is not None,
            RENORMALIZE=renormalize, EVEN_H=hidden == splits * h_split, BLOCK_T=block_t, BLOCK_E=block_e,
            BLOCK_H=block_h, BLOCK_K=next_pow2(top_k), num_warps=num_warps, num_stages=num_stages)
    return weights, indices
