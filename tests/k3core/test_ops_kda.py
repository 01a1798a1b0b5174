"""KDA ops: the chunkwise form and the decode step against the token-by-token recurrence (eq.1), float64."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3core.ops.kda import (
    causal_short_conv,
    kda_chunk,
    kda_gate_bounded,
    kda_gate_softplus,
    kda_recurrent,
    kda_step,
    l2norm,
    short_conv_step,
)

F64 = torch.float64


def _inputs(total, heads=2, key_dim=8, value_dim=6, gate="bounded", seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(1, total, heads, key_dim, generator=gen, dtype=F64))
    k = l2norm(torch.randn(1, total, heads, key_dim, generator=gen, dtype=F64))
    v = torch.randn(1, total, heads, value_dim, generator=gen, dtype=F64)
    z = 2 * torch.randn(1, total, heads, key_dim, generator=gen, dtype=F64)
    a_log = 0.3 * torch.randn(heads, generator=gen, dtype=F64)
    dt_bias = torch.randn(heads * key_dim, generator=gen, dtype=F64)
    if gate == "bounded":
        g = kda_gate_bounded(z, a_log, -5.0, dt_bias)
    else:
        g = kda_gate_softplus(z, a_log, dt_bias)
    beta = torch.rand(1, total, heads, generator=gen, dtype=F64)
    return q, k, v, g, beta


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def test_recurrence_matches_hand_computed_single_token():
    q, k, v, g, beta = _inputs(1, heads=1, key_dim=3, value_dim=2)
    s0 = torch.randn(1, 1, 3, 2, dtype=F64)
    o, s1 = kda_recurrent(q, k, v, g, beta, scale=0.5, initial_state=s0)
    decay = torch.diag(g[0, 0, 0].exp())
    kk = k[0, 0, 0].unsqueeze(1)
    expected = (torch.eye(3, dtype=F64) - beta[0, 0, 0] * kk @ kk.T) @ decay @ s0[0, 0] + beta[
        0, 0, 0
    ] * kk @ v[0, 0, 0].unsqueeze(0)
    assert torch.allclose(s1[0, 0], expected, atol=1e-14)
    assert torch.allclose(o[0, 0, 0], 0.5 * expected.T @ q[0, 0, 0], atol=1e-14)


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunk_equals_recurrent_float64(gate, with_state, chunk_size):
    q, k, v, g, beta = _inputs(150, gate=gate)  # several chunks, last one partial
    s0 = torch.randn(1, 2, 8, 6, dtype=F64) if with_state else None
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, initial_state=s0)
    o, s = kda_chunk(q, k, v, g, beta, initial_state=s0, chunk_size=chunk_size)
    assert _rel(o, o_ref) < 1e-10 and _rel(s, s_ref) < 1e-10


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_varlen_equals_each_sequence_alone(gate):
    lengths = [5, 0, 70, 33]
    q, k, v, g, beta = _inputs(sum(lengths), gate=gate, seed=3)
    cu = torch.tensor([0, 5, 5, 75, 108])
    s0 = torch.randn(4, 2, 8, 6, dtype=F64)
    o_chunk, s_chunk = kda_chunk(q, k, v, g, beta, initial_state=s0, cu_seqlens=cu, chunk_size=16)
    o_rec, s_rec = kda_recurrent(q, k, v, g, beta, initial_state=s0, cu_seqlens=cu)
    for n in range(4):
        a, b = int(cu[n]), int(cu[n + 1])
        part = [x[:, a:b] for x in (q, k, v, g, beta)]
        o_alone, s_alone = kda_recurrent(*part, initial_state=s0[n : n + 1])
        assert torch.allclose(o_rec[:, a:b], o_alone, atol=1e-13)
        assert torch.allclose(s_rec[n], s_alone[0], atol=1e-13)
    assert _rel(o_chunk, o_rec) < 1e-10 and _rel(s_chunk, s_rec) < 1e-10
    assert torch.equal(s_rec[1], s0[1])  # an empty sequence leaves its state untouched


def test_step_equals_recurrent_and_split_resumes():
    q, k, v, g, beta = _inputs(20)
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta)
    _, s_half = kda_chunk(*(x[:, :13] for x in (q, k, v, g, beta)), chunk_size=4)
    state = s_half
    for t in range(13, 20):
        o_t, state = kda_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        assert torch.allclose(o_t, o_ref[:, t], atol=1e-12)
    assert torch.allclose(state, s_ref, atol=1e-12)


def test_bounded_gate_range_and_float32_accumulation():
    z = torch.linspace(-50, 50, 101).reshape(1, 101)  # [H=1, K=101]
    g = kda_gate_bounded(z, torch.zeros(1))
    assert g.dtype == torch.float32 and float(g.min()) >= -5.0 and float(g.max()) <= 0.0
    assert torch.allclose(kda_gate_bounded(torch.zeros(1, 4), torch.zeros(1)), torch.full((1, 4), -2.5))
    with pytest.raises(ValueError, match="A_log"):
        kda_gate_bounded(torch.zeros(2, 4), torch.zeros(3))
    q, k, v, g64, beta = _inputs(40)
    o32, _ = kda_chunk(*(x.to(torch.bfloat16) for x in (q, k, v)), g64.float(), beta.float(), chunk_size=16)
    o64, _ = kda_recurrent(q, k, v, g64, beta)
    assert o32.dtype == torch.bfloat16 and _rel(o32.double(), o64) < 5e-2


def test_short_conv_varlen_and_step_match_per_sequence():
    gen = torch.Generator().manual_seed(1)
    channels, width = 5, 4
    x = torch.randn(1, 11, channels, generator=gen, dtype=F64)
    weight = torch.randn(channels, width, generator=gen, dtype=F64)
    bias = torch.randn(channels, generator=gen, dtype=F64)
    cu = torch.tensor([0, 2, 9, 11])
    s0 = torch.randn(3, channels, width - 1, generator=gen, dtype=F64)
    y, final = causal_short_conv(x, weight, bias, "silu", s0, cu)
    for n in range(3):
        a, b = int(cu[n]), int(cu[n + 1])
        history = torch.cat([s0[n].T, x[0, a:b]], dim=0)  # hand-rolled sliding window
        for t in range(b - a):
            window = history[t : t + width]
            expected = torch.nn.functional.silu((window.T * weight).sum(1) + bias)
            assert torch.allclose(y[0, a + t], expected, atol=1e-13)
        assert torch.allclose(final[n], history[-(width - 1) :].T, atol=0)
        state = s0[n : n + 1]
        for t in range(a, b):
            y_t, state = short_conv_step(x[:, t], state, weight, bias, "silu")
            assert torch.allclose(y_t[0], y[0, t], atol=1e-13)
        assert torch.equal(state[0], final[n])


def test_bad_varlen_input_is_rejected():
    q, k, v, g, beta = _inputs(10)
    with pytest.raises(ValueError, match="end at T"):
        kda_chunk(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 4, 9]))
    with pytest.raises(ValueError, match="batch size 1"):
        kda_recurrent(*(torch.cat([x, x]) for x in (q, k, v, g, beta)), cu_seqlens=torch.tensor([0, 10]))
    with pytest.raises(ValueError, match="sequences"):
        kda_chunk(q, k, v, g, beta, initial_state=torch.zeros(2, 2, 8, 6, dtype=F64))


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 23), min_size=1, max_size=4),
    chunk_size=st.sampled_from([1, 3, 8, 64]),
    gate=st.sampled_from(["bounded", "softplus"]),
    seed=st.integers(0, 2**16),
)
def test_property_chunk_equals_recurrent_for_any_packing(lengths, chunk_size, gate, seed):
    total = sum(lengths)
    q, k, v, g, beta = _inputs(max(total, 1), heads=1, key_dim=4, value_dim=3, gate=gate, seed=seed)
    q, k, v, g, beta = (x[:, :total] for x in (q, k, v, g, beta))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    s0 = torch.randn(len(lengths), 1, 4, 3, dtype=F64, generator=torch.Generator().manual_seed(seed))
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, initial_state=s0, cu_seqlens=cu)
    o, s = kda_chunk(q, k, v, g, beta, initial_state=s0, cu_seqlens=cu, chunk_size=chunk_size)
    assert torch.allclose(o, o_ref, atol=1e-12, rtol=1e-10) and torch.allclose(
        s, s_ref, atol=1e-12, rtol=1e-10
    )
