"""Prefill forwards of the runner run the MoE layers in the decode fast path's grouped forms
(`model_runner.prefill_moe_forms`): same logits as the reference layers (the oracle: k3core's model on its
contiguous cache), the forms are really used (with the prefill fast path off: K3_PREFILL_FASTPATH=0), decode-only batches keep the reference, and the layers are
left as they were, also when the forward raises."""

from __future__ import annotations

import pytest
import torch

from k3core.cache.layout import plan_layout, shape_from_config
from k3core.cache.manager import PrefixCacheManager
from services.engine.model_runner import ModelRunner
from tests.workers.oracle import build_reference
from tests.workers.test_fast_prefill import _step

PROMPT = [(13 * j) % 250 + 1 for j in range(40)]


class Counting:
    def __init__(self, op) -> None:
        self.op, self.calls = op, 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.op(x)


@pytest.fixture
def setup(monkeypatch):
    monkeypatch.setenv("K3_DECODE_FASTPATH", "1")  # the fast path (and its MoE forms) on the CPU too
    monkeypatch.setenv("K3_PREFILL_FASTPATH", "0")  # the reference prefill (else services.engine.fast_prefill)
    model = build_reference("nano", seed=5)
    layout = plan_layout(shape_from_config(model.config, "nano"), 1, conv_dtype=torch.float32,
                         mla_dtype=torch.float32, hash_block_tokens=16)
    manager = PrefixCacheManager(layout, 64, device="cpu")
    runner = ModelRunner(model, "cpu", max_model_len=128, max_batch=4)
    assert runner.decode_fastpath(manager, tp_size=1) is not None
    counters = [Counting(op) for _, op in runner.prefill_moe]
    runner.prefill_moe = [(moe, c) for (moe, _), c in zip(runner.prefill_moe, counters, strict=True)]
    return model, manager, runner, counters


def test_prefill_uses_the_fast_forms_and_matches_the_reference(setup):
    model, manager, runner, counters = setup
    moe_layers = sum(layer.is_moe for layer in model.model.layers)
    assert moe_layers and len(counters) == moe_layers
    with torch.no_grad():
        want = model.prefill(torch.tensor(PROMPT + [9]), model.new_sequence_cache(), 0)
    manager.add_request("a", PROMPT + [9])
    got = _step(manager, runner, {"a": PROMPT})
    torch.testing.assert_close(got[0], want[len(PROMPT) - 1], rtol=1e-4, atol=1e-4)
    assert all(c.calls == 1 for c in counters)
    step = _step(manager, runner, {"a": [9]})  # decode-only: the reference layers
    torch.testing.assert_close(step[0], want[-1], rtol=1e-4, atol=1e-4)
    assert all(c.calls == 1 for c in counters)
    assert all(layer.block_sparse_moe.fast_form is None for layer in model.model.layers if layer.is_moe)


def test_the_forms_are_removed_when_the_forward_raises(setup):
    model, manager, runner, counters = setup
    manager.add_request("b", [1, 2, 3, 4])
    manager.reserve("b", 3)
    with pytest.raises(ValueError, match="token ids"):
        runner.forward([[1, 2, model.config.vocab_size]], manager.batch_view(["b"]))
    assert all(layer.block_sparse_moe.fast_form is None for layer in model.model.layers if layer.is_moe)
