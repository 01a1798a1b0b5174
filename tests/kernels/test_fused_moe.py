"""Fused MoE glue (kernels/fused): the references against float64 loops, the Triton launchers (interpreted)
against the references, on tiny shapes with non-power-of-two sizes and row-strided inputs."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.fused import expert_gemm_triton, moe_align_triton, moe_combine_triton, moe_router_triton
from kernels.fused import naive as fused_naive

T, H, E, K = 7, 40, 12, 3  # T not a multiple of the token block, H of the K slice, E not a power of two


def _router_case(seed: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row-strided tokens x [T, H], router weight [E, H], selection bias [E]."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H + 5, generator=gen).to(dtype)[:, :H]
    return x, (torch.randn(E, H, generator=gen) * 0.4).to(dtype), torch.randn(E, generator=gen) * 0.3


def test_route_reference_matches_float64_by_hand():
    x, weight, bias = _router_case(0)
    weights, indices = fused_naive.moe_route(x, weight, bias, K, renormalize=True, scaling=2.5)
    for t in range(T):
        logits = [sum(float(x[t, h]) * float(weight[e, h]) for h in range(H)) for e in range(E)]
        scores = [1 / (1 + math.exp(-logit)) for logit in logits]
        order = sorted(range(E), key=lambda e: -(scores[e] + float(bias[e])))[:K]
        total = sum(scores[e] for e in order)
        assert indices[t].tolist() == order
        torch.testing.assert_close(weights[t].double(), torch.tensor([2.5 * scores[e] / total for e in order],
                                                                     dtype=torch.float64), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("with_bias", "renormalize", "top_k", "dtype", "block_h"),
                         [(True, True, K, torch.float32, 16), (False, False, 1, torch.float32, 64),
                          (True, True, E, torch.float16, 32)])
def test_triton_route_matches_reference(interpreted, with_bias, renormalize, top_k, dtype, block_h):
    """The logits' float32 accumulation in the kernel against the reference's float32 GEMM (half-precision
    tokens and weight: exact products, so only the summation order differs). float16 stands in for bf16
    here: the interpreter's bf16 tl.dot returns garbage (triton 3.9 on the CPU); bench.serve_glue checks
    bf16 on the GPU."""
    x, weight, bias = _router_case(1, dtype)
    bias = bias if with_bias else None
    want_w, want_i = fused_naive.moe_route(x, weight, bias, top_k, renormalize, 1.5)
    got_w, got_i = moe_router_triton.moe_route(x, weight, bias, top_k, renormalize, 1.5, block_t=16,
                                               block_h=block_h)
    assert got_i.dtype == torch.int64 and torch.equal(got_i, want_i)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)


def test_triton_route_over_several_token_tiles(interpreted):
    """37 tokens: three 16-token programs, the last one partial (the cases above fit in one program)."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(37, H + 3, generator=gen)[:, :H]
    weight, bias = torch.randn(E, H, generator=gen) * 0.4, torch.randn(E, generator=gen) * 0.3
    want_w, want_i = fused_naive.moe_route(x, weight, bias, K, True, 1.0)
    got_w, got_i = moe_router_triton.moe_route(x, weight, bias, K, True, 1.0, block_t=16, block_h=16)
    assert torch.equal(got_i, want_i)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)

def test_triton_route_picks_valid_experts_from_nan_logits(interpreted):
    """NaN activations (e.g. garbage pages) must not yield an out-of-range expert id (a device-side assert
    in the gather that follows took down the H200 run): NaN counts as the largest, as in torch.topk."""
    x, weight, bias = _router_case(2)
    x, weight = x.clone(), weight.clone()
    weight[5, 7] = float("nan")  # expert 5's logit is NaN for every token
    x[3, 0] = float("nan")  # every logit of token 3 is NaN
    _, want_i = fused_naive.moe_route(x, weight, bias, K, True, 1.0)
    _, got_i = moe_router_triton.moe_route(x, weight, bias, K, True, 1.0)
    assert bool(((got_i >= 0) & (got_i < E)).all())
    assert got_i[:, 0].tolist() == [5, 5, 5, 0, 5, 5, 5]
    assert got_i[3].tolist() == [0, 1, 2]  # all NaN: lowest ids first (torch.topk leaves ties unordered)
    keep = [0, 1, 2, 4, 5, 6]
    assert torch.equal(got_i[keep], want_i[keep])


def test_route_refuses_mixed_dtypes():
    x, weight, bias = _router_case(3)
    with pytest.raises(ValueError, match="dtype"):
        moe_router_triton.moe_route(x.double(), weight, bias, K)


L, F = 24, 10  # latent width and shared-expert width, not powers of two


def _combine_case(seed: int, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(E, T, L + 3, generator=gen).to(dtype)[..., :L]  # [E, T, l], row-strided
    index = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    weight = torch.rand(T, K, generator=gen)
    shared = torch.randn(T, 2 * F + 6, generator=gen).to(dtype)[:, 3 : 3 + 2 * F]  # a column slice of a GEMM
    return dense, index, weight, 1 + torch.rand(L, generator=gen), shared


def test_combine_reference_matches_float64_loop():
    dense, index, weight, norm_w, shared = _combine_case(0)
    rows = dense.reshape(E * T, L)  # copies: the strided view has no [E*T, l] view
    got = fused_naive.moe_combine(rows, index, weight, T, 1, norm_w, 1e-5, shared, "situ", 4.0, 25.0)
    for t in range(T):
        routed = sum(float(weight[t, j]) * dense[int(index[t, j]), t].double() for j in range(K))
        normed = routed / torch.sqrt(routed.square().mean() + 1e-5) * norm_w.double()
        g, u = shared[t, :F].double(), shared[t, F:].double()
        act = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)
        torch.testing.assert_close(got[t].double(), torch.cat([normed, act]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("dtype", "layout", "norm", "activation"),
                         [(torch.float32, "dense", True, "situ"), (torch.bfloat16, "dense", True, "swiglu"),
                          (torch.float32, "grouped", False, None), (torch.bfloat16, "grouped", True, "situ")])
def test_triton_combine_matches_reference(interpreted, dtype, layout, norm, activation):
    dense, index, weight, norm_w, shared = _combine_case(1, dtype)
    if layout == "dense":  # [E, T, l] read in place: row = expert * T + token
        rows, index_stride, token_stride = dense.contiguous().view(E * T, L), T, 1
    else:  # [T*K, l] in some permuted order, index = each pick's row
        perm = torch.randperm(T * K, generator=torch.Generator().manual_seed(5))
        picked = torch.stack([dense[int(index[t, j]), t] for t in range(T) for j in range(K)])
        rows = torch.empty(T * K, L + 2, dtype=dtype)[:, :L]
        rows[perm] = picked
        index, index_stride, token_stride = perm.view(T, K), 1, 0
    kwargs = {"norm_weight": norm_w if norm else None, "eps": 1e-5, "activation": activation or "situ",
              "shared_gate_up": shared if activation else None}
    want = fused_naive.moe_combine(rows, index, weight, index_stride, token_stride, **kwargs)
    got = moe_combine_triton.moe_combine(rows, index, weight, index_stride, token_stride, block_f=4, **kwargs)
    assert got.shape == want.shape == (T, L + (F if activation else 0)) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_combine_refuses_an_unknown_activation():
    dense, index, weight, _, shared = _combine_case(2)
    with pytest.raises(ValueError, match="activation"):
        moe_combine_triton.moe_combine(dense.reshape(E * T, L), index, weight, T, 1, shared_gate_up=shared,
                                       activation="gelu")


def test_align_reference_by_hand():
    indices = torch.tensor([[2, 0], [0, 1], [2, 1]])
    tokens, offsets, position = fused_naive.moe_align(indices, 4)
    # pairs by expert then pair id: (0,0)->e2 (0,1)->e0 (1,0)->e0 (1,1)->e1 (2,0)->e2 (2,1)->e1
    # sorted: e0: pairs 1, 2; e1: pairs 3, 5; e2: pairs 0, 4; e3: none
    assert tokens.tolist() == [0, 1, 1, 2, 0, 2]
    assert offsets.tolist() == [2, 4, 6, 6]
    assert position.tolist() == [[4, 0], [1, 2], [5, 3]]


@pytest.mark.parametrize(("tokens", "top_k", "experts", "chunk"), [(1, 4, 32, 256), (7, 3, 12, 8), (50, 4, 16, 64)])
def test_triton_align_matches_reference(interpreted, tokens, top_k, experts, chunk):
    gen = torch.Generator().manual_seed(tokens)
    indices = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    want = fused_naive.moe_align(indices, experts)
    got = moe_align_triton.moe_align(indices, experts, chunk=chunk)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)


def _experts_case(seed: int, width: int, dtype: torch.dtype = torch.float32):
    """Row-strided z [T, width] (a column slice of the x GEMM) and w13 [E, 2F, width]."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(T, width + 8, generator=gen).to(dtype)[:, 8:]
    return z, (torch.randn(E, 2 * F, width, generator=gen) / width ** 0.5).to(dtype)


def test_expert_gate_up_reference_matches_float64():
    z, w13 = _experts_case(0, H)
    act = fused_naive.expert_gate_up_glu(z, w13, "situ", 4.0, 25.0)
    assert act.shape == (E, T, F)
    for e in range(E):
        g, u = z.double() @ w13[e, :F].double().T, z.double() @ w13[e, F:].double().T
        want = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)
        torch.testing.assert_close(act[e].double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("dtype", "activation", "width", "block_k", "tokens"),
                         [(torch.float32, "situ", H, 16, T), (torch.float16, "swiglu", 48, 16, T),
                          (torch.float16, "situ", H, 64, 70)])
def test_triton_expert_gate_up_matches_reference(interpreted, dtype, activation, width, block_k, tokens):
    """Interpreted: F not a multiple of the column block (8), the K depth a multiple of block_k or not, 70
    tokens in two token tiles. float16 stands in for bf16 (the interpreter's bf16 tl.dot is broken); the
    kernel's GLU reads float32 accumulators where the reference rounds gate|up first: a few half ulps."""
    z, w13 = _experts_case(1, width, dtype)
    if tokens != T:
        z = torch.randn(tokens, width, generator=torch.Generator().manual_seed(3)).to(dtype)
    want = fused_naive.expert_gate_up_glu(z, w13, activation, 4.0, 25.0)
    got = expert_gemm_triton.expert_gate_up_glu(z, w13, activation, 4.0, 25.0, block_n=8, block_k=block_k)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert got.shape == want.shape == (E, tokens, F) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_expert_gate_up_refuses_mismatched_shapes():
    z, w13 = _experts_case(2, H)
    with pytest.raises(ValueError, match="w13"):
        expert_gemm_triton.expert_gate_up_glu(z[:, 1:], w13)


def test_triton_route_split_along_h_matches_one_program(interpreted):
    """The H slices' partial logits summed by the last program to arrive give the single-program result, and
    the counters are left at zero (a second launch on the same scratch selects the same experts)."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(21, 70, generator=gen)
    weight, bias = torch.randn(E, 70, generator=gen) * 0.4, torch.randn(E, generator=gen) * 0.3
    one_w, one_i = moe_router_triton.moe_route(x, weight, bias, K, True, 1.0, block_h=16, splits=1)
    want_w, want_i = fused_naive.moe_route(x, weight, bias, K, True, 1.0)
    assert torch.equal(one_i, want_i)
    torch.testing.assert_close(one_w, want_w, rtol=1e-5, atol=1e-6)
    for _ in range(2):
        got_w, got_i = moe_router_triton.moe_route(x, weight, bias, K, True, 1.0, block_h=16, splits=3)
        assert torch.equal(got_i, want_i)
        torch.testing.assert_close(got_w, one_w, rtol=1e-6, atol=1e-7)


def test_route_splits_h_only_while_token_tiles_leave_the_device_idle(monkeypatch, launch_grids):
    """A prefill chunk's token tiles fill the SMs alone: no H split there, so the split scratch (splits x T x
    BLOCK_E float32, kept for the process) stays bounded instead of growing with the chunk (K3, 896 experts:
    8 x 32K tokens x 1024 = 1 GiB). Decode batches keep their splits. CPU plans for 132 SMs."""
    grids, scratch = launch_grids(moe_router_triton, "_route_kernel"), []

    def _scratch(floats, tiles, device):
        scratch.append((floats, tiles))
        return torch.zeros(1), torch.zeros(1)

    monkeypatch.setattr(moe_router_triton, "split_scratch", _scratch)
    weight = torch.zeros(32, 2048)
    for tokens in (64, 256, 8192):
        moe_router_triton.moe_route(torch.zeros(tokens, 2048), weight, None, 4)
    assert [g[1] for g in grids[:2]] == [8, 8]  # decode: one program per 256-wide slice of H
    assert grids[2] == (8192 // 16, 1) and scratch[2] == (1, 1)  # unsplit: no partials, no counters
    for tokens in range(1, 9000, 37):  # never more than ~4 programs per SM's worth of partial rows
        moe_router_triton.moe_route(torch.zeros(tokens, 2048), weight, None, 4)
        assert scratch[-1][0] <= 4 * 132 * 16 * 32 and scratch[-1][1] <= 2 * 132
