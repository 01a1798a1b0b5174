"""`SparseMoE.fast_form`: while set, the layer's forward is that form (the engine's faster MoE for prefill);
unset, the reference loop over experts runs again."""

import torch

from k3core.layers.moe import SparseMoE
from k3core.presets import preset


def test_fast_form_replaces_the_forward_while_set():
    torch.manual_seed(0)
    moe = SparseMoE(preset("nano")).eval()
    with torch.no_grad():
        for param in moe.parameters():  # the gate weight is allocated uninitialised
            param.normal_(0.0, 0.1)
    x = torch.randn(5, preset("nano").hidden_size)
    with torch.no_grad():
        reference = moe(x)
        moe.fast_form = lambda h: torch.full_like(h, 7.0)
        assert torch.equal(moe(x), torch.full_like(x, 7.0))
        moe.fast_form = None
        assert torch.equal(moe(x), reference)
