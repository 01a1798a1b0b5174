"""The decode fast path follows an in-place weight reload (`DecodeFastPath.reload_weights`), on CPU.

Oracles: the reference path (K3Model.forward) of a model built with the new weights: greedy tokens through
the engine loop and the logits of one step from the same pool bytes; the old weights' tokens (the new ones
must differ, or the test proves nothing); the fast path without the refresh (must be wrong: the derived
tensors do matter); the pre-refresh bytes and addresses (a refresh keeps storage, and without a weight
change it is bit-identical).
"""

from __future__ import annotations

import copy

import pytest
import torch

from k3core.layers.kda import KimiDeltaAttention
from services.engine.derived_weights import DerivedWeights
from services.engine.fast_attention import fuse_linears
from services.engine.fast_ffn import MoeDecode
from services.engine.weight_reload import invalidate_prefix_cache
from tests.workers.oracle import build_reference
from tests.workers.test_fastpath import Driver

PROMPTS = [[(5 * i + j) % 200 + 1 for j in range(n)] for i, n in enumerate((6, 19, 33))]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def models():
    return build_reference("nano", seed=3), build_reference("nano", seed=11)


def _derived(driver: Driver) -> list[torch.Tensor]:
    return [tensor for tensor, _ in driver.executor.fastpath.decoder.derived._entries]


def _one_step(driver: Driver) -> tuple[torch.Tensor, torch.Tensor]:
    """Fast and reference logits of one decode step of every request, both from the same pool bytes."""
    manager, fast = driver.manager, driver.executor.fastpath
    rids, cached = driver.reserve_step()
    tokens = [13 * i + 2 for i in range(len(rids))]
    before = manager.store.data.clone()
    fast_logits = fast.forward(cached, tokens)
    manager.store.data.copy_(before)
    ref_logits = driver.executor.runner.forward([[t] for t in tokens], manager.batch_view(rids))
    manager.store.data.copy_(before)  # the pool as it was: the next call sees the same bytes
    return fast_logits, ref_logits


def test_views_of_module_weights_still_alias_after_load_state_dict(models):
    """The assumption the refresh rests on: fused projections and stacked experts need no refresh."""
    old, new = models
    model = copy.deepcopy(old)
    kda = next(i for i, layer in enumerate(model.model.layers) if isinstance(layer.self_attn, KimiDeltaAttention))
    moe = next(i for i, layer in enumerate(model.model.layers) if layer.is_moe)
    attn = model.model.layers[kda].self_attn
    fused = fuse_linears([attn.q_proj, attn.k_proj])
    stacked = MoeDecode(model.model.layers[moe].block_sparse_moe, model.config, grouped=False)
    model.load_state_dict(new.state_dict(), strict=True)
    new_attn, new_experts = new.model.layers[kda].self_attn, new.model.layers[moe].block_sparse_moe.experts
    assert torch.equal(fused, torch.cat([new_attn.q_proj.weight, new_attn.k_proj.weight]))
    ffn = new_experts[1].w1.weight.shape[0]
    assert torch.equal(stacked.w13[1, ffn:], new_experts[1].w3.weight)
    assert torch.equal(stacked.w2[1], new_experts[1].w2.weight)
    assert not torch.equal(fused, torch.cat([old.model.layers[kda].self_attn.q_proj.weight,
                                             old.model.layers[kda].self_attn.k_proj.weight]))


def test_fast_path_serves_the_new_weights_after_reload(models):
    old, new = models
    old_tokens = Driver(copy.deepcopy(old), fastpath=False).generate(PROMPTS, NEW_TOKENS)
    new_tokens = Driver(copy.deepcopy(new), fastpath=False).generate(PROMPTS, NEW_TOKENS)
    assert old_tokens != new_tokens  # otherwise the comparison below could not tell the weights apart

    driver = Driver(copy.deepcopy(old), fastpath=True)
    assert driver.generate(PROMPTS, NEW_TOKENS) == old_tokens
    derived = _derived(driver)
    assert len(derived) > 10  # conv stacks, A_log, dt_bias, w_uk, w_uv_t, routers, AttnRes stacks
    ptrs = [t.data_ptr() for t in derived]
    before = [t.clone() for t in derived]

    while driver.scheduler.has_work:  # the finished requests' pages go at the next step
        driver.executor.execute(driver.scheduler.schedule())
    driver.executor.runner.model.load_state_dict(new.state_dict(), strict=True)  # as weight_reload does
    invalidate_prefix_cache(driver.manager)  # the cached KV was computed by the old weights
    driver.executor.fastpath.reload_weights()
    assert [t.data_ptr() for t in derived] == ptrs  # same storage: captured CUDA graphs stay valid
    assert sum(not torch.equal(t, b) for t, b in zip(derived, before, strict=True)) > len(derived) // 2

    steps = driver.fast_steps
    assert driver.generate(PROMPTS, NEW_TOKENS) == new_tokens
    assert driver.fast_steps - steps >= NEW_TOKENS - 1  # the new tokens did come from the fast path


def _decoding(model) -> Driver:
    driver = Driver(copy.deepcopy(model), fastpath=True)
    driver.generate(PROMPTS, 1, finish=False)  # requests left at decode positions in the pool
    return driver


def test_one_step_logits_equal_the_reference_only_after_the_refresh(models):
    old, new = models
    driver = _decoding(old)
    driver.executor.runner.model.load_state_dict(new.state_dict(), strict=True)
    stale, ref = _one_step(driver)
    assert (stale - ref).abs().max() > 1e-2  # without the refresh the derived copies are the old weights
    driver.executor.fastpath.reload_weights()
    fresh, ref_again = _one_step(driver)
    assert torch.equal(ref, ref_again)
    torch.testing.assert_close(fresh, ref, rtol=1e-4, atol=1e-4)


def test_refresh_without_a_weight_change_is_bit_identical(models):
    driver = _decoding(models[0])
    derived = _derived(driver)
    before, ptrs = [t.clone() for t in derived], [t.data_ptr() for t in derived]
    logits, _ = _one_step(driver)
    driver.executor.fastpath.reload_weights()
    assert [t.data_ptr() for t in derived] == ptrs
    assert all(torch.equal(t, b) for t, b in zip(derived, before, strict=True))
    again, _ = _one_step(driver)
    assert torch.equal(logits, again)


def test_a_changed_shape_is_refused():
    weight = torch.zeros(4, 3)
    derived = DerivedWeights()
    stacked = derived.derive(lambda: weight.t().contiguous())
    weight.fill_(2.0)
    derived.refresh()
    assert torch.equal(stacked, torch.full((3, 4), 2.0))
    weight = torch.zeros(5, 3)
    with pytest.raises(ValueError, match="keep every shape"):
        derived.refresh()
