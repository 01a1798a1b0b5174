"""Per-Head Muon, QK-Clip and the per-token loss against direct computations."""

from __future__ import annotations

import torch

from services.trainer.loss import group_advantages, per_token_policy_loss
from services.trainer.muon import PerHeadMuon, orthogonalize, qk_clip_mha, qk_clip_mla


def test_orthogonalize_approximates_polar_factor():
    torch.manual_seed(0)
    m = torch.randn(32, 48, dtype=torch.float64)
    u, _, vh = torch.linalg.svd(m, full_matrices=False)
    polar = u @ vh
    out = orthogonalize(m, steps=10)
    singular = torch.linalg.svdvals(out)
    assert singular.min() > 0.6 and singular.max() < 1.25
    # Same singular vectors: the output is polar * (something close to identity on the singular values).
    cos = (out * polar).sum() / (out.norm() * polar.norm())
    assert cos > 0.97


def test_per_head_update_equalises_head_scales():
    torch.manual_seed(0)
    heads, head_dim, hidden = 2, 8, 16
    grad = torch.randn(heads * head_dim, hidden)
    grad[:head_dim] *= 1000.0  # head 0's gradient dwarfs head 1's
    rms = {}
    for per_head in (0, heads):
        p = torch.nn.Parameter(torch.zeros(heads * head_dim, hidden))
        p.grad = grad.clone()
        PerHeadMuon([p], lr=1.0, momentum=0.0, weight_decay=0.0, nesterov=False, heads=per_head).step()
        update = -p.detach()
        rms[per_head] = [update[:head_dim].pow(2).mean().sqrt(), update[head_dim:].pow(2).mean().sqrt()]
    whole, split = rms[0], rms[heads]
    assert whole[1] / whole[0] < 0.2           # whole-matrix Muon starves the small head
    assert 0.7 < split[1] / split[0] < 1.4     # per-head Muon gives both heads full-scale updates


def test_qk_clip_mha_caps_each_heads_max_logit():
    torch.manual_seed(1)
    heads, head_dim, hidden, tokens, tau = 4, 8, 16, 12, 5.0
    w_q, w_k = torch.randn(heads * head_dim, hidden) * 2, torch.randn(heads * head_dim, hidden) * 2
    w_q[:head_dim] *= 0.001  # head 0 stays under tau and must not change
    x = torch.randn(tokens, hidden)

    def max_logits(wq, wk):
        q = (x @ wq.T).view(tokens, heads, head_dim)
        k = (x @ wk.T).view(tokens, heads, head_dim)
        return torch.einsum("thd,shd->hts", q, k).flatten(1).max(dim=1).values

    before = max_logits(w_q, w_k)
    assert before[0] < tau < before[1:].min()
    head0 = w_q[:head_dim].clone()
    qk_clip_mha(w_q, w_k, before, tau)
    after = max_logits(w_q, w_k)
    torch.testing.assert_close(after[1:], torch.full((heads - 1,), tau), rtol=1e-4, atol=1e-4)
    assert torch.equal(w_q[:head_dim], head0) and after[0] == before[0]


def test_qk_clip_mla_leaves_shared_rope_key_and_values():
    torch.manual_seed(2)
    heads, nope, rope, v, hidden, latent, tokens, tau = 3, 4, 2, 5, 10, 6, 7, 1.0
    q_proj = torch.randn(heads * (nope + rope), hidden)
    kv_b = torch.randn(heads * (nope + v), latent)
    x, c, k_rope = torch.randn(tokens, hidden), torch.randn(tokens, latent), torch.randn(tokens, rope)

    def logits(qp, kvb):
        q = (x @ qp.T).view(tokens, heads, nope + rope)
        kv = (c @ kvb.T).view(tokens, heads, nope + v)
        return (torch.einsum("thd,shd->hts", q[..., :nope], kv[..., :nope])
                + torch.einsum("thd,sd->hts", q[..., nope:], k_rope)).flatten(1)

    before = logits(q_proj, kv_b)
    values = kv_b.view(heads, nope + v, -1)[:, nope:].clone()
    gamma = qk_clip_mla(q_proj, kv_b, before.max(dim=1).values, tau, nope, rope, v)
    after = logits(q_proj, kv_b)
    torch.testing.assert_close(after, before * gamma[:, None], rtol=1e-5, atol=1e-5)
    assert torch.all(after.max(dim=1).values <= tau + 1e-5)
    assert torch.equal(kv_b.view(heads, nope + v, -1)[:, nope:], values)


def test_loss_is_reinforce_on_policy_and_ignores_stale_tokens():
    torch.manual_seed(3)
    logits = torch.randn(2, 5, requires_grad=True)
    logp = torch.log_softmax(logits, dim=-1)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    adv = group_advantages(torch.tensor([[1.0, 0.0]]))[0]
    loss = per_token_policy_loss(logp, logp.detach(), adv, mask, tau=0.5)
    (grad,) = torch.autograd.grad(loss, logits, retain_graph=True)
    reinforce = -(adv[:, None] * logp * mask).sum() / mask.sum()
    (expected,) = torch.autograd.grad(reinforce, logits, retain_graph=True)
    torch.testing.assert_close(grad, expected)

    stale = logp.detach().clone()
    stale[0, 1] -= 5.0  # token far outside the trust region: contributes nothing
    loss = per_token_policy_loss(logp, stale, adv, mask, tau=0.5, max_log_ratio=2.0)
    (grad2,) = torch.autograd.grad(loss, logits)
    assert torch.allclose(grad2[1], grad[1])


def test_qk_clip_leaves_heads_at_or_under_tau_including_negative_max_logits():
    q_proj, kv_b = torch.randn(3 * 6, 10), torch.randn(3 * 9, 8)
    q0, kv0 = q_proj.clone(), kv_b.clone()
    gamma = qk_clip_mla(q_proj, kv_b, torch.tensor([-4.0, 1.0, 8.0]), 2.0, 4, 2, 5)
    assert gamma.tolist() == [1.0, 1.0, 0.25]
    assert torch.equal(q_proj[:12], q0[:12]) and torch.equal(kv_b[:18], kv0[:18])
