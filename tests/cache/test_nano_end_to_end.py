"""End to end with the nano model: greedy generations served with prefix hits from the paged pool (GPU
tier, and after a round trip through the CPU tier) equal generations without any cache, computed by the
model over k3core's contiguous cache from token 0."""

from __future__ import annotations

import random

import pytest
import torch
from prometheus_client import CollectorRegistry

from k3core.cache.cpu_tier import CpuTier
from k3core.cache.layout import plan_layout, shape_from_config
from k3core.cache.manager import PrefixCacheManager
from k3core.cache.metrics import CacheMetrics
from k3core.model import K3Model
from k3core.model.init import init_weights
from k3core.presets import preset

HASH_BLOCK = 16
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def model() -> K3Model:
    torch.manual_seed(0)
    return init_weights(K3Model(preset("nano")), seed=0).eval()


def _manager(model: K3Model, registry: CollectorRegistry) -> PrefixCacheManager:
    fp32 = torch.float32
    layout = plan_layout(shape_from_config(model.config, "nano"), 1, state_dtype=fp32, conv_dtype=fp32,
                         mla_dtype=fp32, hash_block_tokens=HASH_BLOCK)
    return PrefixCacheManager(layout, num_pages=48, device="cpu", debug=True,
                              cpu_tier=CpuTier(64 * layout.page_bytes), metrics=CacheMetrics(registry))


@torch.no_grad()
def generate_uncached(model: K3Model, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    cache = model.new_sequence_cache()
    logits = model.prefill(torch.tensor(prompt), cache, 0)[-1]
    out, first = [], logits
    for _ in range(NEW_TOKENS):
        out.append(int(logits.argmax()))
        logits = model.decode(torch.tensor(out[-1:]), [cache])[0]
    return out, first


@torch.no_grad()
def generate_paged(model: K3Model, manager: PrefixCacheManager, rid: str, prompt: list[int],
                   chunk: int = 24) -> tuple[list[int], torch.Tensor, int]:
    """A minimal engine loop over the manager's step protocol (chunks snapped to hash boundaries)."""
    hit = manager.add_request(rid, prompt)
    req = manager.requests[rid]
    out: list[int] = []
    first = None
    while len(out) < NEW_TOKENS:
        if req.num_computed == req.num_tokens:
            manager.append_tokens(rid, out[-1:])
        start = req.num_computed
        n = manager.prefill_chunk(rid, chunk)
        manager.reserve(rid, n)
        manager.pre_forward()
        logits = model(torch.tensor(req.tokens[start : start + n]), manager.batch_view([rid]))
        manager.forward_done(rid)
        manager.commit_step()
        if req.num_computed == req.num_tokens:
            first = logits[-1] if first is None else first
            out.append(int(logits[-1].argmax()))
    manager.finish(rid)
    assert first is not None
    return out, first, hit


def _conversation(model: K3Model, manager: PrefixCacheManager, seed: int) -> None:
    rng = random.Random(seed)
    prompt = [rng.randrange(256) for _ in range(41)]
    for turn in range(3):
        expected, expected_first = generate_uncached(model, prompt)
        got, first, hit = generate_paged(model, manager, f"s{seed}t{turn}", prompt)
        assert got == expected, f"turn {turn}: hit {hit} changed the generation"
        torch.testing.assert_close(first, expected_first, rtol=1e-4, atol=1e-4)
        if turn:
            assert hit > 0 and hit % HASH_BLOCK == 0, f"turn {turn} should reuse the previous turn (hit {hit})"
        prompt = prompt + got + [rng.randrange(256) for _ in range(rng.randrange(3, 20))]


def test_generations_with_gpu_prefix_hits_equal_uncached(model: K3Model) -> None:
    registry = CollectorRegistry()
    manager = _manager(model, registry)
    _conversation(model, manager, seed=1)
    assert registry.get_sample_value("k3_prefix_cache_hit_tokens_total") > 0


def test_generations_after_cpu_tier_round_trip_equal_uncached(model: K3Model) -> None:
    registry = CollectorRegistry()
    manager = _manager(model, registry)
    rng = random.Random(5)
    prompt = [rng.randrange(256) for _ in range(45)]
    first_turn, _, _ = generate_paged(model, manager, "a", prompt)
    manager.evict_idle(manager.pool.num_pages)  # everything idle leaves the GPU: written back
    assert manager.pool.num_cached == 0 and len(manager.index) == 0
    assert registry.get_sample_value("k3_prefix_cache_cpu_tier_bytes_total", {"direction": "offload"}) > 0
    follow_up = prompt + first_turn + [rng.randrange(256) for _ in range(9)]
    expected, expected_first = generate_uncached(model, follow_up)
    got, first, hit = generate_paged(model, manager, "b", follow_up)
    assert hit >= 32, hit  # restored from the CPU tier
    assert registry.get_sample_value("k3_prefix_cache_cpu_tier_bytes_total", {"direction": "prefetch"}) > 0
    assert got == expected
    torch.testing.assert_close(first, expected_first, rtol=1e-4, atol=1e-4)
