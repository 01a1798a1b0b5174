"""Gated MLA with NoPE (K3 report §2.1.2, eq.7): naive (expanded) and weight-absorbed attention.

The cache holds one latent row per token: [c_kv (kv_lora_rank, already kv_a_layernorm'ed) | k_pe (rope
dims, shared by all heads, left unrotated since K3 uses NoPE)]. kv_b_proj maps c_kv to per-head
[k_nope (qk_nope_head_dim) | v (v_head_dim)]; its weight is [H*(Dn+Dv), R] (nn.Linear layout).

Naive: expand every cached latent to per-head keys and values, then softmax attention.
Absorbed (decode): fold W_uk into the query (q_nope W_uk -> latent space) and W_uv after the weighted sum,
so attention runs directly on the latent cache: scores = (q_nope W_uk) . c_kv + q_pe . k_pe.
"""

from __future__ import annotations

import torch

from k3core.ops._common import acc_dtype


def causal_mask(q_len: int, kv_len: int, device: torch.device | None = None) -> torch.Tensor:
    """Bool [q_len, kv_len]: the q_len queries are the LAST q_len positions of the kv_len keys."""
    if q_len > kv_len:
        raise ValueError(f"more queries ({q_len}) than keys ({kv_len})")
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device).unsqueeze(1)
    return torch.arange(kv_len, device=device).unsqueeze(0) <= q_pos


def split_kv_b(
    kv_b_weight: torch.Tensor, num_heads: int, v_head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj weight [H*(Dn+Dv), R] -> (W_uk [H, Dn, R], W_uv [H, Dv, R])."""
    rank = kv_b_weight.shape[1]
    per_head = kv_b_weight.reshape(num_heads, -1, rank)
    nope_dim = per_head.shape[1] - v_head_dim
    return per_head[:, :nope_dim], per_head[:, nope_dim:]


def _latent_operands(
    q_nope: torch.Tensor, latent: torch.Tensor, kv_b_weight: torch.Tensor, v_head_dim: int
) -> tuple[torch.dtype, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(accumulation dtype, W_uk, W_uv, c_kv, k_pe), the tensors in that dtype."""
    dtype = acc_dtype(q_nope, latent)
    rank = kv_b_weight.shape[1]
    w_uk, w_uv = (w.to(dtype) for w in split_kv_b(kv_b_weight, q_nope.shape[1], v_head_dim))
    return dtype, w_uk, w_uv, latent[:, :rank].to(dtype), latent[:, rank:].to(dtype)


def _softmax_attend(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1)


def mla_attention_naive(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    kv_b_weight: torch.Tensor,
    v_head_dim: int,
    scale: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """q_nope [T, H, Dn], q_pe [T, H, P], latent [S, R+P], mask [T, S] -> o [T, H, Dv] (q's dtype)."""
    dtype, w_uk, w_uv, c_kv, k_pe = _latent_operands(q_nope, latent, kv_b_weight, v_head_dim)
    k_nope = torch.einsum("sr,hdr->shd", c_kv, w_uk)
    values = torch.einsum("sr,hdr->shd", c_kv, w_uv)
    scores = torch.einsum("thd,shd->hts", q_nope.to(dtype), k_nope)
    scores = scores + torch.einsum("thp,sp->hts", q_pe.to(dtype), k_pe)
    probs = _softmax_attend(scores * scale, mask)
    return torch.einsum("hts,shd->thd", probs, values).to(q_nope.dtype)


def mla_attention_absorbed(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    kv_b_weight: torch.Tensor,
    v_head_dim: int,
    scale: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as `mla_attention_naive`, attending in the latent space (the decode path)."""
    dtype, w_uk, w_uv, c_kv, k_pe = _latent_operands(q_nope, latent, kv_b_weight, v_head_dim)
    q_latent = torch.einsum("thd,hdr->thr", q_nope.to(dtype), w_uk)
    scores = torch.einsum("thr,sr->hts", q_latent, c_kv) + torch.einsum("thp,sp->hts", q_pe.to(dtype), k_pe)
    probs = _softmax_attend(scores * scale, mask)
    o_latent = torch.einsum("hts,sr->thr", probs, c_kv)
    return torch.einsum("thr,hdr->thd", o_latent, w_uv).to(q_nope.dtype)


def sigmoid_output_gate(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """eq.7 inner part: sigmoid(W_g x) * o, elementwise per channel."""
    dtype = acc_dtype(o, gate)
    return (o.to(dtype) * torch.sigmoid(gate.to(dtype))).to(o.dtype)
