"""`commit_step` queues the checkpoints' checksums and does not wait for them (`settle_fingerprints` hands
them over when first read). The values must be those of the bytes at the commit, whenever they are read:
a page changed after the commit but before anything read the fingerprints is still caught, on restore and
on write-back to the CPU tier, and the settled values equal the big-integer oracle of the committed bytes."""

from __future__ import annotations

import random

import torch
from cache_synth import VOCAB, tiny_layout
from prometheus_client import CollectorRegistry

from k3core.cache.cpu_tier import CpuTier
from k3core.cache.manager import PrefixCacheManager
from k3core.cache.metrics import CacheMetrics
from tests.support.mix_oracle import checksum as oracle

LAYOUT = tiny_layout(hash_block=4, tokens_per_block=12)
TOKENS = [random.Random(5).randrange(VOCAB) for _ in range(40)]


def committed_checkpoint(cpu_pages: int = 0):
    registry = CollectorRegistry()
    manager = PrefixCacheManager(LAYOUT, 40, device="cpu", metrics=CacheMetrics(registry),
                                 cpu_tier=CpuTier(cpu_pages * LAYOUT.page_bytes) if cpu_pages else None)
    manager.add_request("a", TOKENS[:24])
    manager.reserve("a", 24)
    manager.pre_forward()
    for page in manager.requests["a"].state_pages:  # a state to checkpoint: distinct bytes per page
        manager.store.data[page].random_(0, 256, generator=torch.Generator().manual_seed(page))
    manager.forward_done("a")  # 24 is a hash boundary: a checkpoint, copied at the commit
    manager.commit_step()
    (checkpoint,) = manager.checkpoints.by_key.values()
    used = LAYOUT.kda_page_used_bytes
    committed = [oracle(bytes(manager.store.data[p, :used].tolist())) for p in checkpoint.pages]
    return manager, registry, checkpoint, committed


def test_settled_fingerprints_are_the_checksums_of_the_committed_bytes():
    manager, _, checkpoint, committed = committed_checkpoint()
    manager.store.data[checkpoint.pages[0], 3] ^= 1  # changed after the commit, before anything read them
    manager.settle_fingerprints()
    assert checkpoint.fingerprints == committed
    manager.settle_fingerprints()  # nothing left: unchanged
    assert checkpoint.fingerprints == committed


def test_a_page_changed_before_the_first_read_is_caught_on_restore():
    manager, registry, checkpoint, _ = committed_checkpoint()
    manager.finish("a")
    manager.store.data[checkpoint.pages[-1], 7] ^= 0x10
    assert manager.add_request("b", TOKENS[:24] + [1]) == 0  # the corrupt checkpoint is not restored
    assert registry.get_sample_value("k3_prefix_cache_integrity_errors_total", {"where": "restore"}) == 1


def test_a_page_changed_before_the_first_read_is_caught_on_write_back():
    manager, registry, checkpoint, _ = committed_checkpoint(cpu_pages=64)
    manager.finish("a")
    manager.store.data[checkpoint.pages[0], 11] ^= 0x02
    manager.evict_idle(manager.pool.num_pages)
    assert registry.get_sample_value("k3_prefix_cache_integrity_errors_total", {"where": "write_back"}) == 1
    assert manager.cpu.checkpoints() == []
