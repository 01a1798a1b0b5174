"""The dense experts' GEMMs (kernels/fused/expert_gemm_triton.py), interpreted, against the references: the
gate|up + GLU and the down projection, in both load forms (pointer tiles, TMA descriptors), on tiny shapes whose
sizes are not multiples of the blocks (F past the column block, T past the token block, K past the K block).
float16 stands in for bf16 (the interpreter's bf16 tl.dot is broken); the references are checked against
float64 by hand."""

from __future__ import annotations

import pytest
import torch

from kernels.fused import expert_gemm_triton
from kernels.fused import naive as fused_naive

E, F, L = 3, 24, 40  # F not a multiple of the 16-column block, L (the GEMM depth) not of the 32-deep K block


def _inputs(tokens: int, seed: int = 0, dtype: torch.dtype = torch.float16):
    """Row-strided z [T, L] (a column slice, as the fast path's x GEMM output), w13 [E, 2F, L], w2 [E, L, F]."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(tokens, L + 8, generator=gen).to(dtype)[:, 8:]
    w13 = (torch.randn(E, 2 * F, L, generator=gen) / L ** 0.5).to(dtype)
    w2 = (torch.randn(E, L, F, generator=gen) / F ** 0.5).to(dtype)
    return z, w13, w2


def test_expert_down_reference_matches_float64():
    _, _, w2 = _inputs(5, dtype=torch.float32)
    act = torch.randn(E, 5, F, generator=torch.Generator().manual_seed(1))
    got = fused_naive.expert_down(act, w2)
    for e in range(E):
        torch.testing.assert_close(got[e].double(), act[e].double() @ w2[e].double().T, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize(("tokens", "activation"), [(5, "situ"), (70, "swiglu")])
def test_gate_up_glu_matches_reference(interpreted, tma, tokens, activation):
    """5 tokens: one 16-row token tile; 70: two 64-row tiles (the widest), the second mostly out of range (TMA
    zero-fills it)."""
    z, w13, _ = _inputs(tokens)
    want = fused_naive.expert_gate_up_glu(z, w13, activation, 4.0, 25.0)
    got = expert_gemm_triton.expert_gate_up_glu(z, w13, activation, 4.0, 25.0, block_n=16, block_k=32, tma=tma)
    assert got.shape == want.shape == (E, tokens, F) and got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("tokens", [5, 70])
def test_expert_down_matches_reference(interpreted, tma, tokens):
    """A token tile past an expert's rows reads the next expert's (or, for the last, TMA's zeros): the store
    mask keeps each expert's output its own. 70 tokens: a second 64-row tile starting inside the expert."""
    _, _, w2 = _inputs(tokens)
    act = torch.randn(E, tokens, F, generator=torch.Generator().manual_seed(2)).to(torch.float16)
    want = fused_naive.expert_down(act.float(), w2.float())
    got = expert_gemm_triton.expert_down(act, w2, block_n=16, block_k=16, tma=tma)
    assert got.shape == (E, tokens, L) and got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)


def test_pointer_form_takes_strided_experts_and_tma_refuses_them(interpreted):
    """Experts stacked with padding between them (a view, as a shard of a larger stack could be): the pointer
    form follows the strides; TMA's 2-D view needs them contiguous and says so."""
    z, w13, w2 = _inputs(5)
    padded13 = torch.zeros(E, 2 * F + 8, L, dtype=w13.dtype)
    padded13[:, : 2 * F] = w13
    padded2 = torch.zeros(E, L + 8, F, dtype=w2.dtype)
    padded2[:, :L] = w2
    act = expert_gemm_triton.expert_gate_up_glu(z, padded13[:, : 2 * F], "situ", block_n=16, block_k=32)
    torch.testing.assert_close(act, expert_gemm_triton.expert_gate_up_glu(z, w13, "situ", block_n=16, block_k=32))
    torch.testing.assert_close(expert_gemm_triton.expert_down(act, padded2[:, :L], block_n=16, block_k=16),
                               expert_gemm_triton.expert_down(act, w2, block_n=16, block_k=16))
    with pytest.raises(ValueError, match="contiguous"):
        expert_gemm_triton.expert_gate_up_glu(z, padded13[:, : 2 * F], tma=True)


def test_expert_gemms_refuse_bad_layouts():
    z, w13, w2 = _inputs(4)
    with pytest.raises(ValueError, match="w13"):
        expert_gemm_triton.expert_gate_up_glu(z[:, 1:], w13)
    with pytest.raises(ValueError, match="w2"):
        expert_gemm_triton.expert_down(torch.zeros(E, 4, F + 1, dtype=torch.float16), w2)
    with pytest.raises(ValueError, match="16-byte"):  # a row stride of 2 * 47 bytes cannot be a TMA view
        expert_gemm_triton.expert_gate_up_glu(torch.zeros(4, L + 7, dtype=torch.float16)[:, :L], w13, tma=True)


def _cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch.device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [16, 64, 70])
def test_compiled_expert_gemms_match_reference_on_gpu(tokens):
    """Compiled bf16 at mini's expert shapes (E 32, F 768, l 1024), both load forms, z a column slice."""
    dev, bf = _cuda(), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(tokens)
    z = torch.randn(tokens, 3072, device=dev, generator=gen).to(bf)[:, :1024]
    w13 = (torch.randn(32, 1536, 1024, device=dev, generator=gen) / 32).to(bf)
    w2 = (torch.randn(32, 1024, 768, device=dev, generator=gen) / 28).to(bf)
    act = fused_naive.expert_gate_up_glu(z, w13, "situ", 4.0, 25.0)
    down = fused_naive.expert_down(act, w2)
    for tma in (False, True):
        got = expert_gemm_triton.expert_gate_up_glu(z, w13, "situ", 4.0, 25.0, tma=tma)
        torch.testing.assert_close(got.float(), act.float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(expert_gemm_triton.expert_down(act, w2, tma=tma).float(), down.float(),
                                   rtol=2e-2, atol=2e-2)


def mini_moe_decode(dev: torch.device, gen: torch.Generator):
    """(the fast path's MoE layer of `mini` in bf16 on `dev`, random weights drawn from `gen`; its config)."""
    from k3core.layers.moe import SparseMoE
    from k3core.presets import preset
    from services.engine.fast_ffn import MoeDecode

    config = preset("mini")
    with torch.device(dev):
        moe = SparseMoE(config)
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0.0, param.shape[-1] ** -0.5, generator=gen)
    return MoeDecode(moe.to(torch.bfloat16).eval(), config, grouped=True), config


def captured_layer(fast, x: torch.Tensor, residual: torch.Tensor) -> torch.cuda.CUDAGraph:
    """`fast(x, residual)` captured in a CUDA graph, after an eager call that compiles outside the capture (call
    under no_grad, and within whatever context the capture needs, e.g. `padding_rows`)."""
    fast(x, torch.zeros_like(x))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fast(x, residual)
    return graph


@pytest.mark.gpu
@pytest.mark.parametrize(("tokens", "form"), [(4, "routed"), (64, "tma-down"), (64, "routed")])
def test_moe_layer_router_branch_is_the_serial_layer_in_a_graph(tokens, form, monkeypatch):
    """The router on a side stream (K3_DECODE_BRANCHES=1) joined before the combine (grouped at 4 rows, the
    dense tma-down form at 64) or before the expert GEMMs (the routed form, the default at 64): the captured
    layer's output is bit for bit the one-chain layer's."""
    from services.engine.fast_attention import BRANCHES_ENV
    from services.engine.fast_ffn import DENSE_FORM_ENV

    monkeypatch.setenv(DENSE_FORM_ENV, form)
    dev = _cuda()
    gen = torch.Generator(device=dev).manual_seed(tokens)
    fast, config = mini_moe_decode(dev, gen)
    assert (fast.dense(tokens), fast.routed(tokens)) == ((False, False) if tokens == 4 else (True, form == "routed"))
    x = torch.randn(tokens, config.hidden_size, device=dev, generator=gen).to(torch.bfloat16)
    outs = []
    for branches in ("0", "1"):
        monkeypatch.setenv(BRANCHES_ENV, branches)
        residual = torch.zeros_like(x)
        with torch.no_grad():
            graph = captured_layer(fast, x, residual)
            for _ in range(3):
                residual.zero_()
                graph.replay()
        torch.cuda.synchronize()
        outs.append(residual.clone())
    assert outs[0].abs().max() > 0 and torch.equal(outs[0], outs[1])


def _mla_layer_branch_outputs(device: torch.device, monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One MLA decode layer (mini, bf16) on a pool of random latents, with K3_DECODE_BRANCHES 0 then 1, captured
    in a CUDA graph and replayed from the same pool bytes: (output, pool bytes) of each."""
    from k3core.cache.layout import plan_layout, shape_from_config
    from k3core.cache.pool_views import PoolViews
    from k3core.layers.mla import GatedMLA
    from k3core.presets import preset
    from services.engine.derived_weights import DerivedWeights
    from services.engine.fast_attention import BRANCHES_ENV, MlaDecode

    config = preset("mini")
    layout = plan_layout(shape_from_config(config, "mini"))
    gen = torch.Generator(device=device).manual_seed(7)
    with torch.device(device):
        attn = GatedMLA(config, 0)
    with torch.no_grad():
        for param in attn.parameters():
            param.normal_(0.0, param.shape[-1] ** -0.5, generator=gen)
    attn = attn.to(torch.bfloat16).eval()
    pages, batch, per_page = 8, 4, layout.tokens_per_block
    data = torch.zeros(pages, layout.page_bytes, dtype=torch.uint8, device=device)
    views = PoolViews(data, layout)
    cache = views.mla_cache(0)
    cache.copy_(torch.randn(cache.shape, device=device, generator=gen).to(cache.dtype))
    layer = MlaDecode(attn, views, DerivedWeights())
    lengths = torch.tensor([5, 17, 1, per_page], device=device, dtype=torch.int32)
    table = torch.arange(batch, device=device, dtype=torch.int32).view(batch, 1) * 2
    row_base = (table[:, 0].long() * per_page + lengths.long() - 1) * layout.layers_per_group  # the write adds the slot
    x = torch.randn(batch, config.hidden_size, device=device, generator=gen).to(torch.bfloat16)
    before, outs = data.clone(), []
    for branches in ("0", "1"):
        monkeypatch.setenv(BRANCHES_ENV, branches)
        with torch.no_grad():
            layer(x, table, lengths, row_base)  # compiles outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = layer(x, table, lengths, row_base)
            data.copy_(before)
            graph.replay()
            torch.cuda.synchronize()
        outs.append((out.clone(), data.clone()))
    return outs


@pytest.mark.gpu
def test_mla_layer_latent_write_branch_is_the_serial_layer_in_a_graph(monkeypatch):
    """The new latent row written on a side stream, joined before the attention reads the cache: the same
    output and pool bytes, bit for bit, as the one-chain layer (a branch never joined fails the capture)."""
    (serial, serial_pool), (branched, branched_pool) = _mla_layer_branch_outputs(_cuda(), monkeypatch)
    assert serial.abs().max() > 0 and torch.equal(serial, branched) and torch.equal(serial_pool, branched_pool)
