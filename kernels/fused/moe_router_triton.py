"""The MoE router's selection of one decode step in one launch (K3 report eq.13): float32 logits [T, E] ->
sigmoid scores, selection = scores + bias, top-k, weights from the unbiased scores, renormalised, scaled
(replaces sigmoid, the bias add, top-k's two kernels, gather, sum, divide and scale).

The logits come from a cuBLAS float32 GEMM (x.float() @ W_router^T): a first version computed them inside
this kernel (tl.dot in IEEE float32, one program per 16 tokens looping over the hidden size) and took 78 us
a launch on the H200 at any batch (1.25 ms of a 4.1 ms forward at batch 64: a serial loop of strided
loads in one to four programs), where the GEMM + this selection take a few us.
Program = BLOCK_T tokens: k rounds of (max, lowest index reaching it, mask it out). NaN selections count as
the largest (torch.topk's rule), so every pick is a valid expert id whatever the activations hold. Picks
come out in descending selection order, as torch.topk's sorted output.
"""

from __future__ import annotations

import torch

from kernels._triton import next_pow2, require, tl, triton

if triton is not None:

    @triton.jit
    def _route_kernel(logits, bias, weights_out, indices_out, T, E, stride_t, scaling, TOP_K: tl.constexpr,
                      HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr,
                      BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
        tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        experts = tl.arange(0, BLOCK_E)
        token_ok, expert_ok = tokens < T, experts < E
        x = tl.load(logits + tokens.to(tl.int64)[:, None] * stride_t + experts[None, :],
                    mask=token_ok[:, None] & expert_ok[None, :], other=0.0).to(tl.float32)
        scores = tl.sigmoid(x)
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


def moe_route_logits(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool = True,
                     scaling: float = 1.0, block_t: int = 16, num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] float32 (unit column stride) -> (weights [T, k] float32, expert ids [T, k] int64)."""
    require(logits.dim() == 2 and logits.stride(1) == 1 and logits.dtype == torch.float32,
            f"logits must be float32 [T, E] with unit column stride, got {logits.dtype} {tuple(logits.shape)}")
    tokens, experts = logits.shape
    require(1 <= top_k <= experts, f"top_k must be in [1, {experts}], got {top_k}")
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    indices = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    if tokens:
        _route_kernel[(triton.cdiv(tokens, block_t),)](
            logits, logits if bias is None else bias, weights, indices, tokens, experts, logits.stride(0),
            float(scaling), TOP_K=top_k, HAS_BIAS=bias is not None, RENORMALIZE=renormalize, BLOCK_T=block_t,
            BLOCK_E=next_pow2(experts), BLOCK_K=next_pow2(top_k), num_warps=num_warps)
    return weights, indices
