"""Gated MLA's GPU prefill attention (`GatedMLA._prefill_fused`) pads the values with zero columns to the
query/key head dim in 16-bit dtypes, so that SDPA can pick its flash kernel: the output equals the naive
einsum form (float64 oracle) with and without the padding, at a chunk after cached context, and SDPA gets
the padded values exactly when the padding is on (else both cases would pass with it never applied)."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from k3core.layers import mla as mla_module
from k3core.model import K3Model
from k3core.ops.mla import causal_mask, mla_attention_naive
from k3core.presets import preset


class ValueDims(TorchFunctionMode):
    """Records the values' head dim of every SDPA call (a mode: the causal bias dispatches on the function)."""

    def __init__(self, dims: list[int]) -> None:
        super().__init__()
        self.dims = dims

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.scaled_dot_product_attention:
            self.dims.append(args[2].shape[-1])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("padded", [True, False])
def test_prefill_attention_of_16_bit_inputs_equals_the_naive_form(monkeypatch, padded):
    monkeypatch.setattr(mla_module, "PAD_VALUES_FOR_FLASH", padded)
    torch.manual_seed(0)
    model = K3Model(preset("nano"))
    attn = next(layer.self_attn for layer in model.model.layers if isinstance(layer.self_attn, mla_module.GatedMLA))
    assert attn.v_dim < attn.nope + attn.rope  # else nothing is padded
    torch.nn.init.normal_(attn.kv_b_proj.weight, std=attn.rank**-0.5)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(9, attn.heads, attn.nope + attn.rope, generator=gen)
    latent = torch.randn(40, attn.rank + attn.rope, generator=gen)
    want = mla_attention_naive(q[..., : attn.nope].double(), q[..., attn.nope :].double(), latent.double(),
                               attn.kv_b_proj.weight.double(), attn.v_dim, attn.scale, causal_mask(9, 40))
    value_dims = []
    with torch.no_grad(), ValueDims(value_dims):
        got = attn.to(torch.bfloat16)._prefill_fused(q.bfloat16(), latent.bfloat16())
    assert value_dims == [attn.nope + attn.rope if padded else attn.v_dim]  # the head dim SDPA saw
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=0.05, atol=0.03)
