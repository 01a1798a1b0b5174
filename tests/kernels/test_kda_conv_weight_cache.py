"""The KDA layer's stacked conv weight (the fused prefill's input) is built once, yet follows every update.

The layer's fused prefill route (Triton, interpreted on the CPU) against its torch path, which reads the
three conv weights directly: after each way the trainer and the weight reload change weights (in place by
an optimizer step or `load_state_dict`, swapped as a new Parameter or through `.data`), the route must
match the torch path again, and differ from its output before the change (the change mattered).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from k3core.cache.contiguous import ContiguousBatchCache, SequenceCache
from k3core.layers.batch import BatchLayout
from k3core.layers.kda import KimiDeltaAttention
from k3core.presets import preset
from kernels import dispatch
from kernels.kda import prefill_triton
from tests.kernels.test_kda_layer_prefill_triton import TOL, _admit_nano, _forward, _layer

COUNT = 11  # one sequence, shorter than a chunk: the cheapest interpreted launch
NANO = preset("nano")


@pytest.fixture
def prefill(interpreted, monkeypatch):
    """prefill(layer, x, fused) -> the layer's output on a fresh sequence, fused route or torch path."""
    route, calls = {"fused": False}, []
    launcher = prefill_triton.kda_prefill_block
    monkeypatch.setattr(prefill_triton, "kda_prefill_block", lambda *a, **k: calls.append(1) or launcher(*a, **k))
    monkeypatch.setattr(dispatch, "use_triton", lambda *tensors: route["fused"])
    _admit_nano(monkeypatch)

    def run(layer: KimiDeltaAttention, x: torch.Tensor, fused: bool) -> torch.Tensor:
        route["fused"] = fused
        before = len(calls)
        out = _forward(layer, x, [SequenceCache(NANO)], [COUNT])
        # The fused route really ran (else both sides read the conv weights directly and agree trivially).
        assert len(calls) - before == int(fused)
        return out

    return run


def _check_follows(prefill, layer: KimiDeltaAttention, x: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    fused = prefill(layer, x, True)
    torch.testing.assert_close(fused, prefill(layer, x, False), **TOL)
    assert (fused - before).abs().max() > 1e-3, "the update changed nothing: the case proves nothing"
    return fused


def test_stacked_conv_weight_is_cached_and_follows_every_update(prefill):
    layer = _layer(NANO)
    x = torch.randn(COUNT, NANO.hidden_size, generator=torch.Generator().manual_seed(5))
    out = prefill(layer, x, True)
    torch.testing.assert_close(out, prefill(layer, x, False), **TOL)
    with torch.no_grad():
        assert layer.stacked_conv_weight() is layer.stacked_conv_weight()  # no stack per call

    with torch.no_grad():  # in place, as a no_grad copy_ or an optimizer step writes
        layer.k_conv1d.weight.mul_(-1.5)
    out = _check_follows(prefill, layer, x, out)

    convs = (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d)
    optimizer = torch.optim.AdamW([c.weight for c in convs], lr=0.1)
    # A training forward (torch path, grad on): the conv weights get gradients, then the step updates them.
    cache = ContiguousBatchCache([SequenceCache(NANO)], [COUNT])
    layer(x, BatchLayout.of([0], [COUNT]), cache).square().sum().backward()
    assert all(c.weight.grad.abs().sum() > 0 for c in convs)
    optimizer.step()
    out = _check_follows(prefill, layer, x, out)

    torch.manual_seed(6)  # the reload path: load_state_dict copies a new checkpoint's tensors in place
    layer.load_state_dict(KimiDeltaAttention(NANO, 0).state_dict() | {
        k: v for k, v in layer.state_dict().items() if "conv1d" not in k})
    out = _check_follows(prefill, layer, x, out)

    layer.v_conv1d.weight = nn.Parameter(torch.randn_like(layer.v_conv1d.weight))  # a new Parameter
    out = _check_follows(prefill, layer, x, out)
    layer.q_conv1d.weight.data = torch.randn_like(layer.q_conv1d.weight)  # swapped storage (TP sharding does)
    _check_follows(prefill, layer, x, out)


def test_under_autograd_the_stack_is_built_with_its_graph():
    """A cached stack has no graph; with grad on, gradients through the stack reach each conv weight."""
    layer = KimiDeltaAttention(NANO, 0)
    with torch.no_grad():
        cached = layer.stacked_conv_weight()
    assert cached.grad_fn is None
    stacked = layer.stacked_conv_weight()
    assert stacked is not cached and stacked.grad_fn is not None
    coeff = torch.randn(stacked.shape)
    (stacked * coeff).sum().backward()
    for i, conv in enumerate((layer.q_conv1d, layer.k_conv1d, layer.v_conv1d)):
        torch.testing.assert_close(conv.weight.grad[:, 0, :], coeff[i], rtol=0, atol=0)


def test_weights_made_in_inference_mode_are_stacked_afresh():
    """Inference tensors have no version counter: the stack is built on every call and follows their
    in-place updates (a layer built, loaded and updated inside torch.inference_mode)."""
    with torch.inference_mode():
        layer = KimiDeltaAttention(NANO, 0)
        convs = (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d)
        for conv in convs:
            conv.weight.normal_()
        first = layer.stacked_conv_weight()
        layer.k_conv1d.weight.mul_(-2.0)
        again = layer.stacked_conv_weight()
    for i, conv in enumerate(convs):
        torch.testing.assert_close(again[i], conv.weight[:, 0, :], rtol=0, atol=0)
    torch.testing.assert_close(again[1], -2.0 * first[1], rtol=0, atol=0)
