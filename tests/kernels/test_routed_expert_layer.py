"""The routed experts on the device (GPU only): the compiled kernels at mini's expert shapes against the
references, and a whole latent-MoE layer of the fast path in the routed form (`K3_DENSE_EXPERTS=routed`)
against the dense form, captured in a CUDA graph and replayed on new tokens (the routing read on the device,
no host sync)."""

from __future__ import annotations

import pytest
import torch

from kernels.fused import naive
from kernels.fused import routed_expert_gemm_triton as routed

pytestmark = pytest.mark.gpu


def _cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch.device("cuda")


@pytest.mark.parametrize("tokens", [16, 64, 128])
def test_compiled_routed_gemms_match_reference_on_gpu(tokens):
    """bf16 at mini's shapes (E 32, F 768, l 1024), z a column slice, a random router's spread (experts with
    more rows than a token tile at 128 tokens, maybe none at 16); default, 32-row and pointer tilings."""
    dev, bf = _cuda(), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(tokens)
    z = torch.randn(tokens, 3072, device=dev, generator=gen).to(bf)[:, :1024]
    w13 = (torch.randn(32, 1536, 1024, device=dev, generator=gen) / 32).to(bf)
    w2 = (torch.randn(32, 1024, 768, device=dev, generator=gen) / 28).to(bf)
    indices = torch.randn(tokens, 32, device=dev, generator=gen).topk(4, dim=1).indices
    act, position = naive.routed_expert_gate_up_glu(z, w13, indices, "situ", 4.0, 25.0)
    down = naive.routed_expert_down(act, w2, indices)
    for tiling in ({}, {"block_t": 32}, {"block_t": 16}, {"tma": False}):
        got, got_position = routed.routed_expert_gate_up_glu(z, w13, indices, "situ", 4.0, 25.0, **tiling)
        assert torch.equal(got_position, position)
        torch.testing.assert_close(got.float(), act.float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(routed.routed_expert_down(act, w2, indices, **tiling).float(), down.float(),
                                   rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("tokens", [16, 64])
def test_routed_layer_equals_the_dense_layer_in_a_graph(tokens, monkeypatch):
    """The routed layer (the router on the side branch, joined before the expert GEMMs) captured once and
    replayed on three different token sets: each replay equals the same layer run eagerly on those tokens
    (bit for bit: same kernels) and the dense tma-down layer within bf16 rounding."""
    from services.engine.fast_ffn import DENSE_FORM_ENV, ROUTED_FORM
    from tests.kernels.test_expert_gemm import captured_layer, mini_moe_decode

    dev = _cuda()
    gen = torch.Generator(device=dev).manual_seed(tokens)
    fast, config = mini_moe_decode(dev, gen)
    xs = [torch.randn(tokens, config.hidden_size, device=dev, generator=gen).to(torch.bfloat16) for _ in range(3)]
    monkeypatch.setenv(DENSE_FORM_ENV, ROUTED_FORM)
    assert fast.routed(tokens)
    x, residual = xs[0].clone(), torch.zeros_like(xs[0])
    with torch.no_grad():
        graph = captured_layer(fast, x, residual)
        replayed = []
        for new in xs:
            x.copy_(new)
            residual.zero_()
            graph.replay()
            replayed.append(residual.clone())
        eager = [fast(new, torch.zeros_like(new)) for new in xs]  # the captured call's path (residual add)
        monkeypatch.setenv(DENSE_FORM_ENV, "tma-down")
        dense = [fast(new, torch.zeros_like(new)) for new in xs]
    torch.cuda.synchronize()
    for got, same, want in zip(replayed, eager, dense, strict=True):
        assert torch.equal(got, same)
        scale = float(want.abs().max())
        assert scale > 0
        torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2 * scale)
    assert not torch.equal(replayed[0], replayed[1])  # the replays followed the new tokens


def test_padding_rows_in_a_graph_route_to_no_expert(monkeypatch):
    """97 tokens in the 128 bucket: the layer captured once with the padding marker (the scratch page's value on
    rows 97-127, as the decode step's `padding_rows` gives it), replayed on two batches with alike padding rows:
    bit for bit the eager padded layer, the padding rows finite, the real rows those of the layer on the 97
    rows alone (within the other GEMMs' tilings); the compiled routed GEMMs at 128 rows with the marker give
    the 97 rows' rows and positions bit for bit and point the padding pairs at the zero row 128*k."""
    from services.engine.fast_ffn import DENSE_FORM_ENV, ROUTED_FORM, padding_rows
    from tests.kernels.test_expert_gemm import captured_layer, mini_moe_decode

    dev, real, size, scratch = _cuda(), 97, 128, 7
    gen = torch.Generator(device=dev).manual_seed(97)
    fast, config = mini_moe_decode(dev, gen)
    monkeypatch.setenv(DENSE_FORM_ENV, ROUTED_FORM)
    marker = torch.full((size,), 3, dtype=torch.int64, device=dev)
    marker[real:] = scratch
    batches = [torch.randn(size, config.hidden_size, device=dev, generator=gen).to(torch.bfloat16) for _ in range(2)]
    for batch in batches:
        batch[real:] = batch[0]  # alike padding rows: the same top-k experts
    x, residual = batches[0].clone(), torch.zeros_like(batches[0])
    with torch.no_grad(), padding_rows([fast], marker, scratch):
        graph = captured_layer(fast, x, residual)
    with torch.no_grad():
        for batch in batches:
            x.copy_(batch)
            residual.zero_()
            graph.replay()
            with padding_rows([fast], marker, scratch):
                eager = fast(batch.clone(), torch.zeros_like(batch))
            alone = fast(batch[:real].clone(), torch.zeros_like(batch[:real]))
            torch.cuda.synchronize()
            assert torch.equal(residual, eager) and residual[real:].isfinite().all()
            scale = float(alone.abs().max())  # other GEMM tilings at 97 rows than at 128 (cuBLAS): close
            torch.testing.assert_close(residual[:real].float(), alone.float(), rtol=2e-2, atol=2e-2 * scale)
        z = torch.randn(size, 1024, device=dev, generator=gen).to(torch.bfloat16)
        _, indices = fast._route(batches[1])
        mark = (marker, scratch)
        act, position = routed.routed_expert_gate_up_glu(z, fast.w13, indices, padding=mark)
        down = routed.routed_expert_down(act, fast.w2, indices, padding=mark)
        act_real, position_real = routed.routed_expert_gate_up_glu(z[:real], fast.w13, indices[:real].contiguous())
        down_real = routed.routed_expert_down(act_real, fast.w2, indices[:real].contiguous())
    rows = real * indices.shape[1]
    assert torch.equal(position[:real], position_real) and (position[real:] == size * indices.shape[1]).all()
    assert torch.equal(down[:rows], down_real) and not down[-1].any()
