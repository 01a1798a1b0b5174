"""`PrefixCacheManager.add_request(..., cacheable=False)`: a scratch request (a worker's warm-up) computes on
pages of its own and leaves the cache as it found it. Oracle: a manager that never saw it, and the same
tokens admitted as a cacheable request (which does register blocks and a checkpoint)."""

from __future__ import annotations

import pytest
from cache_synth import tiny_layout

from k3core.cache.hashing import chain_hashes
from k3core.cache.manager import PrefixCacheManager
from k3core.cache.pool import OutOfPages

LAYOUT = tiny_layout(hash_block=4, tokens_per_block=12)  # 2 KDA groups, 1 MLA group
TOKENS = list(range(1, 30))  # 29 tokens: 7 hash blocks, 3 MLA blocks


def run(manager: PrefixCacheManager, rid: str, **admit) -> int:
    """Admit, prefill in 8-token chunks (ending on hash boundaries: checkpoints are due), finish."""
    hit = manager.add_request(rid, **admit)
    assert manager.requests[rid].num_computed == hit
    while manager.requests[rid].num_computed < len(TOKENS):
        manager.reserve(rid, min(8, len(TOKENS) - manager.requests[rid].num_computed))
        manager.forward_done(rid)
        manager.commit_step()
    manager.finish(rid, turn_boundary=False)
    manager.commit_step()
    return hit


def state(manager: PrefixCacheManager) -> tuple:
    pool = manager.pool
    return (pool.num_free, pool.num_cached, len(manager.index), len(manager.checkpoints.by_key),
            tuple(pool.refcount), manager.requests.keys())


def test_a_scratch_request_leaves_nothing_to_find_and_no_page_taken() -> None:
    untouched, scratch = PrefixCacheManager(LAYOUT, 40), PrefixCacheManager(LAYOUT, 40)
    assert run(scratch, "w", num_tokens=len(TOKENS), cacheable=False) == 0
    assert state(scratch) == state(untouched)
    chain = chain_hashes(TOKENS, LAYOUT.hash_block_tokens)
    assert scratch.lookup(chain, len(TOKENS)).num_tokens == 0
    # the same run of a cacheable request does leave blocks and checkpoints (the oracle is not vacuous)
    assert run(untouched, "c", tokens=TOKENS) == 0
    assert len(untouched.index) > 0 and untouched.pool.num_cached > 0
    assert untouched.lookup(chain, len(TOKENS)).num_tokens > 0


def test_a_scratch_request_takes_no_hit_from_the_cache() -> None:
    manager = PrefixCacheManager(LAYOUT, 40)
    run(manager, "c", tokens=TOKENS)
    assert manager.lookup(chain_hashes(TOKENS, LAYOUT.hash_block_tokens), len(TOKENS)).num_tokens > 0
    before = state(manager)
    assert run(manager, "w", num_tokens=len(TOKENS), cacheable=False) == 0
    assert state(manager) == before


def test_scratch_request_arguments_and_a_full_pool() -> None:
    manager = PrefixCacheManager(LAYOUT, 40)
    for bad in ({"tokens": TOKENS}, {"num_tokens": 4, "chain": [1]}, {}, {"num_tokens": 0}):
        with pytest.raises(ValueError, match="scratch request"):
            manager.add_request("w", cacheable=False, **bad)
    small = PrefixCacheManager(LAYOUT, 1)  # one page: not even the 2-page KDA state fits
    with pytest.raises(OutOfPages):
        small.add_request("w", num_tokens=4, cacheable=False)
    assert "w" not in small.requests and small.pool.num_free == 1
