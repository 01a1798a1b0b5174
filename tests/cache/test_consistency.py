"""The three consistency rules of §5.4.1 under concurrency, checkpoint policy and metrics, on the synthetic
model with real page bytes (the oracle checks every entry). Corruption: test_integrity.py; the CPU tier:
test_cpu_tier.py."""

from __future__ import annotations

import pytest
from cache_oracle import PrefixOracle
from cache_steps import LAYOUT, TOKENS, make, run, step

from k3core.cache.hashing import chain_hashes
from k3core.cache.pool import OutOfPages, PageKind


def test_registrations_of_the_current_step_are_not_matchable() -> None:
    manager, _ = make()
    manager.add_request("a", TOKENS[:30])
    step(manager, {"a": 24}, commit=False)  # endpoints and a checkpoint at 24 registered, bytes in flight
    assert manager.lookup(chain_hashes(TOKENS[:40], 4), 40).num_tokens == 0
    manager.commit_step()
    assert manager.lookup(chain_hashes(TOKENS[:40], 4), 40).num_tokens == 24


def test_concurrent_hits_on_a_shared_partial_block_get_private_copies() -> None:
    manager, _ = make()
    oracle = PrefixOracle(LAYOUT)
    run(manager, "a", TOKENS[:18], finish=False)  # block 1 holds tokens 12..17 and is a's growth point
    tails = {"b": TOKENS[:16] + [1, 2, 3, 4, 5], "c": TOKENS[:16] + [9, 9, 9, 9, 9, 9]}
    for rid, tokens in tails.items():  # both hit at 16 in the same step, inside a's partial block
        oracle.learn(tokens)
        assert manager.add_request(rid, tokens) == 16
        assert manager.requests[rid].blocks[1] is not manager.requests["a"].blocks[1]
    manager.append_tokens("a", TOKENS[18:30])
    oracle.learn(TOKENS[:30])
    step(manager, {"a": 8, "b": 8, "c": 8})  # all three write into "their" block 1 in one forward
    for rid, tokens in [("a", TOKENS[:30]), *tails.items()]:
        oracle.check_private(manager, rid, tokens)
    assert oracle.check(manager) > 0


def test_hit_pages_are_pinned_before_allocation() -> None:
    manager, _ = make(pages=12)
    run(manager, "a", TOKENS[:36])  # 3 blocks + a kept checkpoint (2 pages) + superseded ones freed
    idle = manager.pool.num_cached
    # Fill the rest of the pool so that "b"'s allocation can only come from evicting idle entries,
    # and the least recently used idle entries are exactly the blocks "b" hits.
    filler = manager.pool.allocate(PageKind.MLA, 0, manager.pool.num_free)
    tokens = TOKENS[:36] + [7] * 5
    try:
        hit = manager.add_request("b", tokens)
    except OutOfPages:
        assert manager.pool.num_cached == idle and "b" not in manager.requests  # nothing changed
    else:
        oracle = PrefixOracle(LAYOUT)
        oracle.learn(tokens)
        manager.pre_forward()
        oracle.check_private(manager, "b", tokens)
        assert hit == 36 - 4
    for page in filler:
        manager.pool.decref(page)
    manager.pool.check_invariants()


def test_evicting_one_group_of_a_checkpoint_drops_all_groups() -> None:
    manager, _ = make()
    run(manager, "a", TOKENS[:26])
    (checkpoint,) = manager.checkpoints.by_key.values()
    assert len(checkpoint.pages) == LAYOUT.num_kda_groups == 2
    checkpoint.evict()  # what the pool does when it picks one of its pages
    assert manager.checkpoints.by_key == {}
    assert all(manager.pool.kind[p] == PageKind.FREE for p in checkpoint.pages)
    assert manager.lookup(chain_hashes(TOKENS[:40], 4), 40).num_tokens == 0  # MLA alone is no hit


@pytest.mark.parametrize("keep_prompt_end", [True, False])
def test_superseded_checkpoints_are_reclaimed_and_turn_boundaries_kept(keep_prompt_end: bool) -> None:
    manager, _ = make(keep_prompt_end=keep_prompt_end)
    manager.add_request("a", TOKENS[:30])
    while manager.requests["a"].num_computed < 30:
        step(manager, {"a": 8})  # forwards end at 8, 16, 24, 28 (last prompt boundary), then 30
    assert [c.num_tokens for c in manager.checkpoints.by_key.values()] == [28]
    manager.append_tokens("a", TOKENS[30:37])
    step(manager, {"a": 8})  # generation reaches 36: 28 is superseded unless it is the prompt's boundary
    assert sorted(c.num_tokens for c in manager.checkpoints.by_key.values()) == ([28, 36] if keep_prompt_end else [36])
    manager.finish("a")  # the conversation's end is a turn boundary
    assert all(c.keep for c in manager.checkpoints.by_key.values())


def test_checkpoint_cap_bounds_memory() -> None:
    manager, registry = make(pages=60, max_pool_fraction=0.1)  # 6 pages: three 2-page checkpoints
    for i in range(6):
        run(manager, f"r{i}", [i] + TOKENS[:20])
        assert manager.checkpoints.num_pages <= 6
    assert registry.get_sample_value("k3_prefix_cache_checkpoint_bytes") <= 6 * LAYOUT.page_bytes
    assert registry.get_sample_value("k3_prefix_cache_evictions_total", {"kind": "kda"}) >= 3


def test_a_copy_on_write_copy_takes_over_the_endpoints_of_its_evicted_source() -> None:
    manager, _ = make(keep_prompt_end=True)
    run(manager, "a", TOKENS[:9])  # block 0 holds 9 tokens; the prompt-end checkpoint sits at 8
    tokens = TOKENS[:8] + [5] * 10
    assert manager.add_request("b", tokens) == 8  # private copy of a's partial block 0
    manager.commit_step()
    manager.evict_idle(manager.pool.num_pages)  # a's block (and checkpoint) go; b's copy is in use
    probe = TOKENS[:8] + [6] * 6
    assert manager.lookup(chain_hashes(probe, 4), len(probe)).mla_tokens == 8  # answered by b's copy
    oracle = PrefixOracle(LAYOUT)
    oracle.learn(tokens)
    assert oracle.check(manager) >= 2


def test_finishing_a_request_admitted_in_the_same_step_leaves_no_copy_behind() -> None:
    """A request admitted and finished (aborted) in one step still has its restore copy and state zeroing
    queued. Its pages must not go to another request before those land: otherwise the other request's
    state is overwritten by the stale restore."""
    manager, _ = make(pages=12)
    run(manager, "x", TOKENS[:30])  # 3 blocks and a kept checkpoint at 28 (2 pages) idle in the pool
    filler = manager.pool.allocate(PageKind.MLA, 0, manager.pool.num_free - 3)
    assert manager.add_request("a", TOKENS[:30] + [1, 2]) == 28  # restore of the checkpoint queued
    manager.finish("a", turn_boundary=False)  # aborted before its first forward
    oracle = PrefixOracle(LAYOUT)
    fresh = [7, 7, 7, 7, 7, 7]  # a miss: "b" must start from a zero state
    oracle.learn(fresh)
    try:
        assert manager.add_request("b", fresh) == 0
    except OutOfPages:  # a's pages are held until this step's copies land
        manager.commit_step()
        assert manager.add_request("b", fresh) == 0
    manager.pre_forward()
    oracle.check_private(manager, "b", fresh)
    manager.commit_step()
    manager.finish("b")
    for page in filler:
        manager.pool.decref(page)
    manager.pool.check_invariants()
    assert all(count == 0 for count in manager.pool.refcount)


def test_finishing_a_miss_admitted_in_the_same_step_keeps_its_zeroing_on_its_own_pages() -> None:
    manager, _ = make(pages=12)
    filler = manager.pool.allocate(PageKind.MLA, 0, manager.pool.num_free - 2)
    manager.add_request("a", TOKENS[:6])  # a miss: zeroing of its state pages queued
    manager.finish("a", turn_boundary=False)
    assert manager.step_open  # the zeroing still targets a's pages, so they are not free yet
    assert manager.pool.num_free == 0
    manager.commit_step()
    assert manager.pool.num_free == 2 and not manager.step_open
    for page in filler:
        manager.pool.decref(page)
    manager.pool.check_invariants()


def test_a_shared_prefix_gets_a_checkpoint_at_its_branch_point() -> None:
    """a computed a prefix that b shares only in part (a system prompt): b's MLA match runs past its
    (empty) checkpoint hit, so b's prefill ends a forward where the match ends and keeps the state there;
    c, sharing the same prefix, hits it with exactly that prefix's state."""
    manager, _ = make(keep_prompt_end=False)
    system = TOKENS[:14]
    run(manager, "a", system + [1] * 20)  # a's only kept checkpoint is its turn end (32)
    b = system + [2] * 20
    assert manager.add_request("b", b) == 0
    assert manager.requests["b"].branch_point == 12  # the last full hash block both share
    assert manager.prefill_chunk("b", 100) == 12
    while manager.requests["b"].num_computed < len(b):
        step(manager, {"b": 100})
    manager.finish("b")
    oracle = PrefixOracle(LAYOUT)
    c = system + [3] * 9
    for tokens in (system + [1] * 20, b, c):
        oracle.learn(tokens)
    assert manager.add_request("c", c) == 12
    manager.pre_forward()
    oracle.check_private(manager, "c", c)
    assert oracle.check(manager) > 0
    while manager.requests["c"].num_computed < len(c):
        step(manager, {"c": 100})
    manager.finish("c")  # c's turn ended on top of the shared checkpoint, which stays a live entry
    shared = manager.checkpoints.find(chain_hashes(system, 4)[2])
    assert shared is not None and shared.structural and not shared.superseded


def test_branch_points_can_be_switched_off() -> None:
    manager, _ = make(keep_prompt_end=False, branch_points=False)
    run(manager, "a", TOKENS[:14] + [1] * 20)
    manager.add_request("b", TOKENS[:14] + [2] * 20)
    assert manager.requests["b"].branch_point == 0 and manager.prefill_chunk("b", 100) == 32
