"""The MoE router of one decode step in one launch (K3 report eq.13; replaces ~10 torch launches per layer:
the float32 cast of x, the float32 GEMM, sigmoid, + bias, top-k's two kernels, gather, sum, divide, scale).

Program = BLOCK_T tokens: logits [BLOCK_T, E] accumulated over BLOCK_H-wide slices of x and the float32
router weight by `tl.dot` in IEEE float32 (no TF32: routing decisions must not depend on the dtype, as in
the reference; a first version's broadcast product reduced per slice took 77 us a launch on the H200), then
sigmoid scores, selection = scores + bias, k rounds of (max, lowest index reaching it, mask it out),
weights from the unbiased scores, renormalised and scaled. Picks come out in descending selection order,
as torch.topk's sorted output. `moe_route_logits` runs the same selection on logits computed elsewhere
(a cuBLAS float32 GEMM): the choice between the two is measured in bench/serve.py (K3_DECODE_ROUTER).
"""

from __future__ import annotations

import torch

from kernels._triton import next_pow2, require, tl, triton

if triton is not None:

    @triton.jit
    def _logits(x, w, tokens, experts, token_ok, expert_ok, H, stride_x, BLOCK_T: tl.constexpr,
                BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr):
        logits = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
        for start in range(0, H, BLOCK_H):
            cols = start + tl.arange(0, BLOCK_H)
            col_ok = cols < H
            xv = tl.load(x + tokens.to(tl.int64)[:, None] * stride_x + cols[None, :],
                         mask=token_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
            wv = tl.load(w + experts[None, :] * H + cols[:, None], mask=col_ok[:, None] & expert_ok[None, :],
                         other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_E]
            logits = tl.dot(xv, wv, logits, input_precision="ieee")
        return logits

    @triton.jit
    def _router_kernel(x, w, bias, weights_out, indices_out, T, H, E, stride_x, scaling, TOP_K: tl.constexpr,
                       FROM_LOGITS: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
        tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        experts = tl.arange(0, BLOCK_E)
        token_ok, expert_ok = tokens < T, experts < E
        if FROM_LOGITS:  # x holds float32 logits [T, E]
            logits = tl.load(x + tokens.to(tl.int64)[:, None] * stride_x + experts[None, :],
                             mask=token_ok[:, None] & expert_ok[None, :], other=0.0).to(tl.float32)
        else:
            logits = _logits(x, w, tokens, experts, token_ok, expert_ok, H, stride_x, BLOCK_T, BLOCK_E, BLOCK_H)
        scores = tl.sigmoid(logits)
        selection = scores
        if HAS_BIAS:
            selection = scores + tl.load(bias + experts, mask=expert_ok, other=0.0).to(tl.float32)[None, :]
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


def _route(source: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, experts: int, top_k: int,
           renormalize: bool, scaling: float, block_t: int, block_h: int, num_warps: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    require(source.dim() == 2 and source.stride(1) == 1,
            f"x / logits must be [T, width] with unit column stride, got {tuple(source.shape)}")
    require(1 <= top_k <= experts, f"top_k must be in [1, {experts}], got {top_k}")
    require(block_t >= 16 and block_h >= 16, "tl.dot needs blocks of at least 16")
    tokens = source.shape[0]
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=source.device)
    indices = torch.empty(tokens, top_k, dtype=torch.int64, device=source.device)
    if tokens == 0:
        return weights, indices
    _router_kernel[(triton.cdiv(tokens, block_t),)](
        source, source if weight is None else weight, source if bias is None else bias, weights, indices, tokens,
        source.shape[1], experts, source.stride(0), float(scaling), TOP_K=top_k, FROM_LOGITS=weight is None,
        HAS_BIAS=bias is not None, RENORMALIZE=renormalize, BLOCK_T=block_t, BLOCK_E=max(16, next_pow2(experts)),
        BLOCK_H=block_h, BLOCK_K=next_pow2(top_k), num_warps=num_warps)
    return weights, indices


def moe_router(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int,
               renormalize: bool = True, scaling: float = 1.0, block_t: int = 16, block_h: int = 64,
               num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] (any float dtype, unit column stride), weight [E, H] (float32 router), bias [E] or None ->
    (weights [T, k] float32, expert ids [T, k] int64)."""
    experts, hidden = weight.shape
    require(x.dim() == 2 and x.shape[1] == hidden, f"x has {tuple(x.shape)} features, the router weight {hidden}")
    require(weight.dtype == torch.float32 and weight.is_contiguous(), "the router weight must be contiguous float32")
    return _route(x, weight, bias, experts, top_k, renormalize, scaling, block_t, block_h, num_warps)


def moe_route_logits(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool = True,
                     scaling: float = 1.0, block_t: int = 16, num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """The selection of `moe_router` on float32 logits [T, E] computed elsewhere."""
    require(logits.dtype == torch.float32, f"logits must be float32, got {logits.dtype}")
    return _route(logits, None, bias, logits.shape[-1], top_k, renormalize, scaling, block_t, 16, num_warps)
