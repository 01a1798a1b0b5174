"""Per-Head Muon with QK-Clip (K3 report §2.5; K2 report §2.1, MuonClip).

Muon updates a matrix parameter with the orthogonalised momentum (a Newton-Schulz iteration approximates
U V^T of its SVD). Per-Head Muon splits the momentum of attention projections along the head dimension and
orthogonalises each head's block on its own, so heads with small gradients still get full-scale updates.
The update is rescaled to match AdamW's RMS (0.2 * sqrt(max(m, n))) and decoupled weight decay applies.
QK-Clip rescales a head's query and key weights after the step whenever its largest attention logit in the
step exceeded tau: gamma_h = min(1, tau / S_max^h), W_q^h *= sqrt(gamma_h), W_k^h *= sqrt(gamma_h)
(for MLA only the head-specific parts: q's nope and rope rows get sqrt(gamma) and gamma respectively; the
shared rope key is left alone).
"""

from __future__ import annotations

import torch

# Quintic Newton-Schulz coefficients: converge singular values into a band around 1 in few steps.
NS_COEFFS = (3.4445, -4.7750, 2.0315)


def orthogonalize(matrix: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Approximately U V^T for matrix = U S V^T, computed in float32 (bfloat16 on GPU is fine too)."""
    a, b, c = NS_COEFFS
    x = matrix.float()
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.T
    x = x / (x.norm() + eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if transposed else x).to(matrix.dtype)


class PerHeadMuon(torch.optim.Optimizer):
    """Muon for 2-D parameters; `heads` (per parameter, via param groups) splits rows into per-head blocks.

    Param group keys: lr, momentum, weight_decay, nesterov, heads (0 = whole matrix), ns_steps.
    Only 2-D parameters belong here; embeddings, norms and biases go to AdamW.
    """

    def __init__(self, params, lr: float = 2e-2, momentum: float = 0.95, weight_decay: float = 0.1,
                 nesterov: bool = True, heads: int = 0, ns_steps: int = 5):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov,
                                      heads=heads, ns_steps=ns_steps))
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"PerHeadMuon takes 2-D parameters only, got shape {tuple(p.shape)}")
                if group["heads"] and p.shape[0] % group["heads"]:
                    raise ValueError(f"rows {p.shape[0]} do not split into {group['heads']} heads")

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(p.grad)
                direction = p.grad.add(buf, alpha=group["momentum"]) if group["nesterov"] else buf
                update = self._orthogonal_update(direction, group["heads"], group["ns_steps"])
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"])
        return loss

    @staticmethod
    def _orthogonal_update(direction: torch.Tensor, heads: int, steps: int) -> torch.Tensor:
        blocks = direction.chunk(heads, dim=0) if heads else (direction,)
        out = torch.cat([orthogonalize(b, steps) for b in blocks], dim=0)
        rows, cols = blocks[0].shape
        # Match AdamW's update RMS so learning rates and weight decay transfer (Moonlight).
        return out * (0.2 * max(rows, cols) ** 0.5)


def clip_factors(max_logits: torch.Tensor, tau: float) -> torch.Tensor:
    """gamma_h = min(1, tau / S_max^h); a head whose max logit is <= tau (negative ones too) keeps 1."""
    s = max_logits.float()
    return torch.where(s > tau, tau / s, torch.ones_like(s))


@torch.no_grad()
def qk_clip_mha(w_q: torch.Tensor, w_k: torch.Tensor, max_logits: torch.Tensor, tau: float) -> torch.Tensor:
    """Per-head QK-Clip for multi-head attention; w_q, w_k: [heads * head_dim, hidden]. Returns gamma."""
    if w_q.shape != w_k.shape:
        raise ValueError(f"w_q {tuple(w_q.shape)} and w_k {tuple(w_k.shape)} must match (one key head per query head)")
    gamma = clip_factors(max_logits, tau)
    scale = gamma.sqrt().repeat_interleave(w_q.shape[0] // max_logits.numel()).to(w_q.dtype)[:, None]
    w_q.mul_(scale)
    w_k.mul_(scale)
    return gamma


@torch.no_grad()
def qk_clip_mla(q_proj: torch.Tensor, kv_b_proj: torch.Tensor, max_logits: torch.Tensor, tau: float,
                qk_nope_dim: int, qk_rope_dim: int, v_dim: int) -> torch.Tensor:
    """Per-head QK-Clip for MLA. q_proj rows per head: [nope | rope]; kv_b_proj rows per head: [k_nope | v].

    q_nope and k_nope each get sqrt(gamma) (their product gets gamma); q_rope gets gamma because its partner,
    the rope key, is shared by all heads and must not change. Values are untouched.
    """
    heads = max_logits.numel()
    gamma = clip_factors(max_logits, tau).to(q_proj.dtype)
    q = q_proj.view(heads, qk_nope_dim + qk_rope_dim, -1)
    q[:, :qk_nope_dim].mul_(gamma.sqrt()[:, None, None])
    q[:, qk_nope_dim:].mul_(gamma[:, None, None])
    kv = kv_b_proj.view(heads, qk_nope_dim + v_dim, -1)
    kv[:, :qk_nope_dim].mul_(gamma.sqrt()[:, None, None])
    return gamma
