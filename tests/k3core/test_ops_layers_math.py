"""Norms, gated MLA (naive vs weight-absorbed) and Block AttnRes (two-phase vs direct)."""

import torch

from k3core.ops.attnres import attnres_direct, attnres_inter, attnres_merge
from k3core.ops.mla import causal_mask, mla_attention_absorbed, mla_attention_naive, sigmoid_output_gate
from k3core.ops.norm import gated_rms_norm, rms_norm

F64 = torch.float64


def test_rms_norm_and_gated_rms_norm_hand_computed():
    x = torch.tensor([[3.0, 4.0]])
    w = torch.tensor([1.0, 2.0])
    rms = (12.5) ** 0.5
    assert torch.allclose(rms_norm(x, w, eps=0.0), torch.tensor([[3 / rms, 8 / rms]]))
    gate = torch.tensor([[0.0, 100.0]])
    assert torch.allclose(gated_rms_norm(x, gate, w, eps=0.0), torch.tensor([[1.5 / rms, 8 / rms]]))
    assert rms_norm(x.to(torch.bfloat16), w, 1e-6).dtype == torch.bfloat16


def test_causal_mask_offsets_queries_to_the_end():
    mask = causal_mask(2, 4)
    assert mask.tolist() == [[True, True, True, False], [True, True, True, True]]


def test_absorbed_mla_equals_naive_and_explicit_keys():
    gen = torch.Generator().manual_seed(0)
    heads, nope, rope, v_dim, rank, tokens, queries = 3, 5, 2, 4, 6, 9, 4
    q_nope = torch.randn(queries, heads, nope, generator=gen, dtype=F64)
    q_pe = torch.randn(queries, heads, rope, generator=gen, dtype=F64)
    latent = torch.randn(tokens, rank + rope, generator=gen, dtype=F64)
    kv_b = torch.randn(heads * (nope + v_dim), rank, generator=gen, dtype=F64)
    mask = causal_mask(queries, tokens)
    naive = mla_attention_naive(q_nope, q_pe, latent, kv_b, v_dim, 0.3, mask)
    absorbed = mla_attention_absorbed(q_nope, q_pe, latent, kv_b, v_dim, 0.3, mask)
    assert torch.allclose(naive, absorbed, atol=1e-12)
    # independent check of one query/head with explicitly built keys and values
    kv = (latent[:, :rank] @ kv_b.T).reshape(tokens, heads, nope + v_dim)
    t, h = 1, 2
    visible = tokens - queries + t + 1
    keys = torch.cat([kv[:visible, h, :nope], latent[:visible, rank:]], dim=1)
    probs = torch.softmax(0.3 * keys @ torch.cat([q_nope[t, h], q_pe[t, h]]), dim=0)
    assert torch.allclose(naive[t, h], probs @ kv[:visible, h, nope:], atol=1e-12)


def test_sigmoid_output_gate():
    o = torch.tensor([2.0, 2.0])
    assert torch.allclose(sigmoid_output_gate(o, torch.tensor([0.0, -100.0])), torch.tensor([1.0, 0.0]))


def test_attnres_direct_hand_computed_and_single_source():
    sources = torch.tensor([[[1.0, 0.0]], [[0.0, 3.0]]], dtype=F64)  # [S=2, T=1, D=2]
    query = torch.tensor([1.0, 0.0], dtype=F64)
    # RMSNorm(keys) = [sqrt2, 0] and [0, sqrt2]; logits sqrt2 and 0
    w = torch.softmax(torch.tensor([2**0.5, 0.0], dtype=F64), dim=0)
    expected = w[0] * sources[0] + w[1] * sources[1]
    assert torch.allclose(attnres_direct(query, sources, eps=0.0), expected)
    assert torch.equal(attnres_direct(query, sources[:1]), sources[0])


def test_attnres_two_phase_equals_direct():
    gen = torch.Generator().manual_seed(2)
    dim, tokens, blocks, sites = 8, 5, 4, 6
    completed = 5 * torch.randn(blocks, tokens, dim, generator=gen, dtype=F64)
    queries = torch.randn(sites, dim, generator=gen, dtype=F64)
    norms = 1 + 0.1 * torch.randn(sites, dim, generator=gen, dtype=F64)
    outputs = torch.randn(sites, tokens, dim, generator=gen, dtype=F64)  # the block's sublayer outputs
    inter = attnres_inter(queries, completed, norms)
    partial = None
    for i in range(sites):
        sources = completed if partial is None else torch.cat([completed, partial.unsqueeze(0)])
        direct = attnres_direct(queries[i], sources, norms[i])
        merged = attnres_merge(inter.row(i), queries[i], partial, norms[i])
        assert torch.allclose(merged, direct, atol=1e-12)
        partial = outputs[i] if partial is None else partial + outputs[i]
