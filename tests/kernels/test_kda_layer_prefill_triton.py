"""The KDA layer's prefill through the Triton block (interpreted on the CPU) vs the layer's torch path.

kernels.dispatch sends only CUDA tensors to Triton; these tests make `use_triton` answer yes so the layer
takes its CUDA route on CPU tensors, and the launcher runs under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import pytest
import torch

from k3core.cache.contiguous import ContiguousBatchCache, SequenceCache
from k3core.layers import kda_prefill_fast
from k3core.layers.batch import BatchLayout
from k3core.layers.kda import KimiDeltaAttention
from k3core.layers.kda_prefill_fast import triton_prefill_applies
from k3core.model import K3Model
from k3core.model.init import init_weights
from k3core.presets import preset
from kernels import dispatch
from kernels.kda import prefill_triton
from tests.kernels.test_kda_prefill_fp32 import tf32_dots  # noqa: F401 - a fixture

TOL = {"rtol": 1e-4, "atol": 1e-5}


def _layer(config) -> KimiDeltaAttention:
    torch.manual_seed(21)
    layer = KimiDeltaAttention(config, 0)
    with torch.no_grad():  # released checkpoints never hold the zero/one defaults: exercise every term
        layer.A_log.normal_(0.0, 0.3)
        layer.dt_bias.normal_(0.0, 0.5)
        layer.o_norm.weight.normal_(1.0, 0.2)
    return layer


def _forward(layer: KimiDeltaAttention, x: torch.Tensor, seqs: list[SequenceCache], counts: list[int]):
    layout = BatchLayout.of([s.length for s in seqs], counts)
    cache = ContiguousBatchCache(seqs, counts)
    with torch.no_grad():
        out = layer(x, layout, cache)
    cache.commit()
    return out


def test_layer_prefill_on_triton_matches_reference(interpreted, monkeypatch):
    """A varlen batch of three sequences (70, 5, 33 tokens: none a multiple of the 64-token chunk); the
    first continues a 37-token first chunk (chunked prefill: nonzero conv and recurrent states)."""
    config = preset("nano")
    layer = _layer(config)
    gen = torch.Generator().manual_seed(22)
    first = SequenceCache(config)
    _forward(layer, torch.randn(37, config.hidden_size, generator=gen), [first], [37])  # reference path
    assert first.kda_state[0].abs().sum() > 0 and first.kda_conv[0].abs().sum() > 0
    counts = [70, 5, 33]
    x = torch.randn(sum(counts), config.hidden_size, generator=gen)
    ref_seqs = [first.clone(), SequenceCache(config), SequenceCache(config)]
    fast_seqs = [s.clone() for s in ref_seqs]

    want = _forward(layer, x, ref_seqs, counts)
    calls = []
    launcher = prefill_triton.kda_prefill_block
    monkeypatch.setattr(prefill_triton, "kda_prefill_block", lambda *a, **k: calls.append(1) or launcher(*a, **k))
    monkeypatch.setattr(dispatch, "use_triton", lambda *tensors: True)
    _admit_nano(monkeypatch)
    got = _forward(layer, x, fast_seqs, counts)

    assert calls == [1]  # the Triton launcher ran, not the reference
    torch.testing.assert_close(got, want, **TOL)
    for fast, ref in zip(fast_seqs, ref_seqs, strict=True):
        torch.testing.assert_close(fast.kda_state, ref.kda_state, **TOL)
        torch.testing.assert_close(fast.kda_conv, ref.kda_conv, rtol=0, atol=0)  # raw inputs, moved only
        assert fast.kda_state.dtype == ref.kda_state.dtype and fast.kda_conv.dtype == ref.kda_conv.dtype


@pytest.mark.usefixtures("tf32_dots")
def test_nano_model_prefill_on_triton_with_device_dots_matches_the_torch_path(monkeypatch):
    """tests/k3core/test_model_gpu.py's nano case on the CPU, with the device's dot rounding emulated: the
    H200 gave logits 0.44 (relative) apart while the float32 block's dots were TF32 (now IEEE: 3e-5)."""
    model = init_weights(K3Model(preset("nano")), seed=0).eval()
    tokens = torch.randint(0, 263, (100,), generator=torch.Generator().manual_seed(0))
    calls = []
    launcher = prefill_triton.kda_prefill_block
    with torch.no_grad():
        want = model.prefill(tokens, model.new_sequence_cache(), 0)
        monkeypatch.setattr(prefill_triton, "kda_prefill_block", lambda *a, **k: calls.append(1) or launcher(*a, **k))
        monkeypatch.setattr(dispatch, "use_triton", lambda *tensors: True)
        _admit_nano(monkeypatch)
        got = model.prefill(tokens, model.new_sequence_cache(), 0)
    # Every KDA layer took the Triton block: otherwise both sides are the torch path and agree trivially.
    assert len(calls) == sum(isinstance(m, KimiDeltaAttention) for m in model.modules()) > 0
    assert float((got - want).abs().max() / want.abs().max()) < 1e-3


def _admit_nano(monkeypatch) -> None:
    """The route admits nano's head dim and float32 here: these tests check the layer's mapping onto the
    launcher (interpreted), whatever the device-validated lists say."""
    monkeypatch.setattr(kda_prefill_fast, "VALIDATED_HEAD_DIMS", (preset("nano").kda_head_dim,))
    monkeypatch.setattr(kda_prefill_fast, "VALIDATED_DTYPES", (torch.float32,))


def test_unvalidated_head_dim_or_dtype_keeps_the_reference(monkeypatch):
    """Only the head dims and dtypes checked on the H200 are routed (float16 is not, yet); the two lists are
    independent conditions."""
    layer = KimiDeltaAttention(preset("nano"), 0)
    x = torch.zeros(3, preset("nano").hidden_size)
    monkeypatch.setattr(dispatch, "use_triton", lambda *tensors: True)
    with torch.no_grad():
        assert triton_prefill_applies(layer, x) and triton_prefill_applies(layer, x.bfloat16())
        assert not triton_prefill_applies(layer, x.half())
        monkeypatch.setattr(kda_prefill_fast, "VALIDATED_HEAD_DIMS", (128,))
        assert not triton_prefill_applies(layer, x)  # nano's D=32 no longer listed
        monkeypatch.setattr(kda_prefill_fast, "VALIDATED_HEAD_DIMS", (preset("nano").kda_head_dim,))
        monkeypatch.setattr(kda_prefill_fast, "VALIDATED_DTYPES", (torch.bfloat16,))
        assert not triton_prefill_applies(layer, x)  # float32 no longer listed
        assert triton_prefill_applies(layer, x.bfloat16())


def test_softplus_gate_cpu_tensors_and_autograd_keep_the_reference(monkeypatch):
    """The Kimi Linear gate never takes the fused route; CPU tensors never do unless Triton is forced; a
    forward under autograd never does (the kernel has no backward: the weights would get no gradients)."""
    x = torch.zeros(3, preset("nano").hidden_size)
    bounded, softplus = KimiDeltaAttention(preset("nano"), 0), KimiDeltaAttention(preset("nano-kl"), 0)
    _admit_nano(monkeypatch)
    with torch.no_grad():
        assert not triton_prefill_applies(bounded, x)
        monkeypatch.setattr(dispatch, "use_triton", lambda *tensors: True)
        assert triton_prefill_applies(bounded, x)
        assert not triton_prefill_applies(softplus, x)
    assert not triton_prefill_applies(bounded, x)  # grad mode on
