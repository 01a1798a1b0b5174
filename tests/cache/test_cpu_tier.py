"""The CPU tier under the synthetic model with real page bytes: write-back only (idle blocks, never active
ones), copies of blocks sharing a prefix with an earlier copy kept, and a written-back prefix prefetched to
the GPU before its reuse (the oracle checks every entry)."""

from __future__ import annotations

from cache_oracle import PrefixOracle
from cache_steps import LAYOUT, TOKENS, make, run

from k3core.cache.hashing import chain_hashes


def test_cpu_tier_is_write_back_only_and_skips_active_blocks() -> None:
    manager, registry = make(cpu=64)
    run(manager, "a", TOKENS[:40])
    assert manager.cpu.used_bytes == 0  # nothing written while on the GPU (no write-through)
    assert manager.add_request("b", TOKENS[:40] + [5] * 8) == 40  # b shares a's blocks 0-2 (active again)
    manager.commit_step()  # b's copy of a's partial block 3 has landed
    manager.evict_idle(manager.pool.num_pages)
    chain = chain_hashes(TOKENS[:40], 4)
    written = {h for host in manager.cpu.blocks() for h, _ in host.endpoints}
    assert written == {chain[9]}  # only the idle partial block 3; blocks 0-2 are in use by b
    assert [c.num_tokens for c in manager.cpu.checkpoints()] == [40]
    assert all(manager.index.contains(chain[i]) for i in range(9))
    assert registry.get_sample_value("k3_prefix_cache_cpu_tier_bytes_total", {"direction": "offload"}) > 0


def test_cpu_tier_keeps_blocks_that_share_a_prefix_with_an_earlier_copy() -> None:
    """Two conversations share a system prompt that ends inside block 0. After the first one went to the CPU
    tier, the second recomputes block 0 (registering the shared endpoints again on the GPU); its own
    write-back must still land, under the endpoints the tier lacks, so that it can be restored."""
    manager, _ = make(cpu=64)
    system = TOKENS[:6]
    first, second = system + [1] * 20, system + [2] * 20
    run(manager, "a", first)
    manager.evict_idle(manager.pool.num_pages)
    run(manager, "b", second)
    manager.evict_idle(manager.pool.num_pages)
    oracle = PrefixOracle(LAYOUT)
    follow_up = second + [3] * 5
    oracle.learn(follow_up)
    assert manager.add_request("c", follow_up) == 24  # b's turn-end checkpoint, with b's own block 0
    manager.pre_forward()
    oracle.check_private(manager, "c", follow_up)


def test_prefetch_brings_a_written_back_prefix_back_before_reuse() -> None:
    manager, registry = make(cpu=64)
    run(manager, "a", TOKENS[:40])
    manager.evict_idle(manager.pool.num_pages)
    assert manager.lookup(chain_hashes(TOKENS[:45], 4), 45).num_tokens == 40  # from the CPU tier
    assert manager.prefetch(chain_hashes(TOKENS[:45], 4), 45) == 40
    assert manager.lookup(chain_hashes(TOKENS[:45], 4), 45).checkpoint is not None
    assert manager.checkpoints.find(chain_hashes(TOKENS[:40], 4)[-1]) is None  # pending until commit
    manager.commit_step()
    hit = manager.lookup(chain_hashes(TOKENS[:45], 4), 45)
    assert hit.checkpoint is manager.checkpoints.find(chain_hashes(TOKENS[:40], 4)[-1])  # GPU-resident now
    oracle = PrefixOracle(LAYOUT)
    oracle.learn(TOKENS[:45])
    assert oracle.check(manager) > 0
    assert manager.add_request("b", TOKENS[:45]) == 40
    manager.pre_forward()
    oracle.check_private(manager, "b", TOKENS[:45])
    assert registry.get_sample_value("k3_prefix_cache_cpu_tier_bytes_total", {"direction": "prefetch"}) > 0
