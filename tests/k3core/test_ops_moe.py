"""SiTU-GLU (eq.12, app. B), the sigmoid router (eq.13) and Quantile Balancing (eq.14, app. C-D)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3core.ops.moe import sigmoid_router, situ_glu, swiglu
from k3core.ops.qb import (
    expert_loads,
    qb_bias_from_histogram,
    qb_histogram_counts,
    qb_histogram_range,
    qb_target_bias,
    qb_update_exact,
    qb_update_histogram,
)

finite = st.floats(-1e6, 1e6, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(finite, finite)
def test_situ_bounded_by_beta_product(gate, up):
    out = situ_glu(torch.tensor([gate], dtype=torch.float64), torch.tensor([up], dtype=torch.float64))
    assert abs(float(out)) <= 4.0 * 25.0


def test_situ_formula_and_first_order_agreement_with_swiglu():
    g, u = torch.tensor([3.0, -2.0, 80.0]), torch.tensor([7.0, 1.5, 300.0])
    expected = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)
    assert torch.allclose(situ_glu(g, u), expected)
    small = torch.linspace(-0.05, 0.05, 11)
    assert torch.allclose(situ_glu(small, small), swiglu(small, small), atol=1e-5)
    assert float(situ_glu(torch.tensor([1e4]), torch.tensor([1e4]))) == pytest.approx(100.0)


def test_router_bias_selects_but_never_changes_weights():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(50, 16, generator=gen)
    bias = torch.randn(16, generator=gen)
    weights, indices = sigmoid_router(logits, 4, bias)
    scores = torch.sigmoid(logits)
    assert torch.equal(indices, (scores + bias).topk(4).indices)
    chosen = scores.gather(1, indices)
    assert torch.allclose(weights, chosen / chosen.sum(1, keepdim=True))
    w_raw, _ = sigmoid_router(logits, 4, bias, renormalize=False, scaling=2.5)
    assert torch.allclose(w_raw, 2.5 * chosen)
    with pytest.raises(ValueError, match="top_k"):
        sigmoid_router(logits, 17)


def _skewed_scores(seed, tokens=8192, experts=64, skew=0.25):
    gen = torch.Generator().manual_seed(seed)
    return torch.sigmoid(torch.randn(tokens, experts, generator=gen) + torch.linspace(-skew, skew, experts))


def _imbalance(scores, bias, top_k=4):
    loads = expert_loads(scores, bias, top_k).float()
    return float(loads.max() / loads.mean())


@pytest.mark.parametrize("seed", [0, 1])
def test_qb_histogram_three_updates_balance_load(seed):
    scores = _skewed_scores(seed)
    bias = torch.zeros(64)
    assert _imbalance(scores, bias) > 1.4
    for _ in range(3):
        bias = qb_update_histogram(scores, bias, top_k=4)
        assert abs(float(bias.mean())) < 1e-6
    assert _imbalance(scores, bias) <= 1.05
    # the bias moved routing but the mixing weights are still those of the unbiased scores
    logits = torch.logit(scores[:100])
    weights, indices = sigmoid_router(logits, 4, bias)
    chosen = scores[:100].gather(1, indices)
    assert torch.allclose(weights, chosen / chosen.sum(1, keepdim=True), atol=1e-6)


def test_qb_one_exact_step_gives_each_expert_its_target_against_fixed_cutoffs():
    scores = _skewed_scores(3, tokens=512, experts=8, skew=1.0)
    top_k = 2
    old_bias = 0.05 * torch.randn(8, generator=torch.Generator().manual_seed(1))
    target = qb_target_bias(scores, old_bias, top_k)
    cutoffs = (scores + old_bias).topk(top_k + 1, dim=1).values[:, -1:]  # alpha from the OLD bias
    # r_ij = alpha_i - s_ij ties at b_j for the token whose cutoff IS expert j, so the target q = mk/n
    # is met up to ties: #{r < b_hat} <= q <= #{r <= b_hat} (exact when no tie sits at the quantile)
    required = cutoffs - scores
    q = 512 * top_k // 8
    assert ((required < target).sum(0) <= q).all() and ((required <= target).sum(0) >= q).all()
    assert (scores + target > cutoffs).sum(0).tolist().count(q) >= 6
    centred = qb_update_exact(scores, old_bias, top_k)
    assert torch.allclose(centred, target - target.mean())


def test_qb_histogram_is_additive_and_tracks_the_exact_quantile():
    scores = _skewed_scores(4, tokens=4096, experts=16, skew=0.5)
    bias = 0.1 * torch.randn(16, generator=torch.Generator().manual_seed(5))
    low, high = qb_histogram_range(bias)
    whole = qb_histogram_counts(scores, bias, 2, low, high, 1000)
    halves = qb_histogram_counts(scores[:1000], bias, 2, low, high) + qb_histogram_counts(
        scores[1000:], bias, 2, low, high
    )
    assert torch.equal(whole, halves)  # counts from shards sum to the global histogram
    estimate = qb_bias_from_histogram(whole, low, high, 2)
    exact = qb_update_exact(scores, bias, 2)
    assert float((estimate - exact.double()).abs().max()) <= 2 * (high - low) / 1000
