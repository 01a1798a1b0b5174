"""A prefix cache manager over the synthetic model (cache_synth) with real page bytes, debug checks and metrics,
and the forward step the consistency, integrity and CPU-tier tests drive it with."""

from __future__ import annotations

import random

from cache_synth import VOCAB, forward, tiny_layout
from prometheus_client import CollectorRegistry

from k3core.cache.checkpoints import CheckpointPolicy
from k3core.cache.cpu_tier import CpuTier
from k3core.cache.manager import PrefixCacheManager
from k3core.cache.metrics import CacheMetrics

LAYOUT = tiny_layout(hash_block=4, tokens_per_block=12)
TOKENS = [random.Random(3).randrange(VOCAB) for _ in range(60)]


def make(pages: int = 40, cpu: int = 0, **policy: object) -> tuple[PrefixCacheManager, CollectorRegistry]:
    registry = CollectorRegistry()
    manager = PrefixCacheManager(LAYOUT, pages, device="cpu", debug=True, metrics=CacheMetrics(registry),
                                 cpu_tier=CpuTier(cpu * LAYOUT.page_bytes) if cpu else None,
                                 policy=CheckpointPolicy(**policy))
    return manager, registry


def step(manager: PrefixCacheManager, work: dict[str, int], commit: bool = True) -> None:
    """One step: `work` maps request -> token budget (chunks snapped to hash boundaries)."""
    rids = []
    for rid, budget in work.items():
        manager.reserve(rid, manager.prefill_chunk(rid, budget))
        rids.append(rid)
    manager.pre_forward()
    reqs = [manager.requests[r] for r in rids]
    forward(manager.batch_view(rids), [r.tokens[r.num_computed : r.num_computed + r.scheduled] for r in reqs])
    for rid in rids:
        manager.forward_done(rid)
    if commit:
        manager.commit_step()


def run(manager: PrefixCacheManager, rid: str, tokens: list[int], finish: bool = True) -> int:
    hit = manager.add_request(rid, tokens)
    while manager.requests[rid].num_computed < len(tokens):
        step(manager, {rid: 8})
    if finish:
        manager.finish(rid)
    return hit
