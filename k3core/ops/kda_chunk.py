"""Chunkwise-parallel KDA (K3 report eq.4, the WY/UT form of Kimi Linear), plain torch.

Inside a chunk of C tokens, with G_r = sum_{s<=r} g_s (per key channel) and S_0 the state entering it:
    M[r, i] = beta_r * sum_c k_r[c] k_i[c] exp(G_r[c] - G_i[c])            (i < r, strictly lower)
    T = (I + M)^-1,  U = T diag(beta) V,  W = T diag(beta) (K * exp(G))    (the UT transform)
    Vt = U - W S_0                                                          (pseudo-values)
    A[r, i] = sum_c q_r[c] k_i[c] exp(G_r[c] - G_i[c])                     (i <= r, Tril with diagonal)
    O = scale * ((Q * exp(G)) S_0 + A Vt)
    S_C = exp(G_C) * S_0 + (K * exp(G_C - G))^T Vt
The decay ratios are formed pairwise in log space (exp(G_r - G_i) <= 1 on the causal side) instead of
as Gamma and 1/Gamma factors, so this reference never overflows, whichever gate produced g.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3core.ops._common import acc_dtype, check_initial_state, sequence_bounds, start_state


def _pad_to_chunks(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[T, H, ...] -> [n_chunks, C, H, ...], zero padded: padded tokens (k = beta = g = 0) are no-ops."""
    pad = (-x.shape[0]) % chunk_size
    if pad:
        x = F.pad(x, (0, 0) * (x.dim() - 1) + (0, pad))
    return x.reshape(-1, chunk_size, *x.shape[1:])


def _chunk_sequence(q, k, v, g, beta, state, scale, chunk_size):
    """One sequence: q, k, g [T, H, K], v [T, H, V], beta [T, H], state [H, K, V] (all acc dtype)."""
    length = q.shape[0]
    qc, kc, vc, gc = (_pad_to_chunks(x, chunk_size).transpose(1, 2) for x in (q, k, v, g))  # [n, H, C, *]
    bc = _pad_to_chunks(beta, chunk_size).transpose(1, 2)  # [n, H, C]
    cum = gc.cumsum(dim=2)  # G_r
    rel = cum.unsqueeze(3) - cum.unsqueeze(2)  # [n, H, C(r), C(i), K] = G_r - G_i
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    strict = causal.tril(-1)
    decay = torch.where(causal[..., None], rel, torch.full_like(rel, float("-inf"))).exp()
    kk = torch.einsum("nhrc,nhic,nhric->nhri", kc, kc, decay)
    qk = torch.einsum("nhrc,nhic,nhric->nhri", qc, kc, decay)
    m = bc.unsqueeze(-1) * kk * strict
    eye = torch.eye(chunk_size, dtype=q.dtype, device=q.device)
    rhs_u = bc.unsqueeze(-1) * vc
    rhs_w = bc.unsqueeze(-1) * kc * cum.exp()
    u = torch.linalg.solve_triangular(eye + m, rhs_u, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(eye + m, rhs_w, upper=False, unitriangular=True)
    a = qk * causal
    q_decayed = qc * cum.exp() * scale
    k_to_end = kc * (cum[:, :, -1:, :] - cum).exp()
    outs = []
    for n in range(qc.shape[0]):
        pseudo_v = u[n] - w[n] @ state  # [H, C, V]
        outs.append(q_decayed[n] @ state + (a[n] * scale) @ pseudo_v)
        state = cum[n, :, -1, :].exp().unsqueeze(-1) * state + k_to_end[n].transpose(1, 2) @ pseudo_v
    o = torch.stack(outs).transpose(1, 2).reshape(-1, *v.shape[1:])[:length]
    return o, state


def kda_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    output_final_state: bool = True,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same contract as `kda_recurrent` (see k3core.ops.kda), computed chunk by chunk."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    batch, length, heads, key_dim = q.shape
    seqs = sequence_bounds(cu_seqlens, batch, length)
    check_initial_state(initial_state, len(seqs), "initial_state")
    dtype = acc_dtype(q, k, v, g)
    scale = key_dim**-0.5 if scale is None else scale
    o = torch.empty_like(v)
    finals = []
    for n, (row, start, end) in enumerate(seqs):
        state = start_state(initial_state, n, (heads, key_dim, v.shape[-1]), dtype, q)
        if end > start:
            parts = (x[row, start:end].to(dtype) for x in (q, k, v, g, beta))
            o_seq, state = _chunk_sequence(*parts, state, scale, chunk_size)
            o[row, start:end] = o_seq.to(v.dtype)
        finals.append(state)
    return o, (torch.stack(finals) if output_final_state else None)
