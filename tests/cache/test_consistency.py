"""The three consistency rules of §5.4.1 under concurrency, checkpoint policy, tiering and metrics, on the
synthetic model with real page bytes (the oracle checks every entry)."""

from __future__ import annotations

import random

import pytest
import torch
from cache_oracle import PrefixOracle
from cache_synth import VOCAB, forward, tiny_layout
from prometheus_client import CollectorRegistry

from k3core.cache.checkpoints import CheckpointPolicy
from k3core.cache.cpu_tier import CpuTier
from k3core.cache.hashing import chain_hashes
from k3core.cache.manager import PrefixCacheManager
from k3core.cache.metrics import CacheMetrics
from k3core.cache.page_store import IntegrityError, PageKindError
from k3core.cache.pool import OutOfPages, PageKind

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


def test_corrupt_cpu_checkpoint_is_a_counted_miss() -> None:
    manager, registry = make(cpu=64)
    run(manager, "a", TOKENS[:30])
    manager.evict_idle(manager.pool.num_pages)
    (host,) = manager.cpu.checkpoints()
    host.data[0][17] ^= 0x40  # one flipped bit in DRAM
    oracle = PrefixOracle(LAYOUT)
    tokens = TOKENS[:30] + [3] * 4
    oracle.learn(tokens)
    assert manager.add_request("b", tokens) == 0  # the only checkpoint is bad: a miss, not wrong state
    manager.pre_forward()
    oracle.check_private(manager, "b", tokens)
    assert registry.get_sample_value("k3_prefix_cache_integrity_errors_total", {"where": "prefetch"}) == 1
    assert manager.cpu.checkpoints() == []


def test_corrupt_gpu_checkpoint_is_caught_on_restore() -> None:
    manager, registry = make()
    run(manager, "a", TOKENS[:30])
    (checkpoint,) = manager.checkpoints.by_key.values()
    manager.store.data[checkpoint.pages[1], 5] ^= 1
    assert manager.add_request("b", TOKENS[:30] + [3]) == 0
    assert registry.get_sample_value("k3_prefix_cache_integrity_errors_total", {"where": "restore"}) == 1


def test_transfer_checks_fingerprints() -> None:
    manager, _ = make()
    run(manager, "a", TOKENS[:30])
    page = next(iter(manager.checkpoints.by_key.values())).pages[0]
    data, print_ = manager.store.export_page(page, LAYOUT.kda_page_used_bytes)
    data[3] ^= 8
    with pytest.raises(IntegrityError, match="fingerprint"):
        manager.store.import_page(page, data, print_)


def test_type_confusion_reads_garbage_and_debug_mode_catches_it() -> None:
    manager, _ = make()
    run(manager, "a", TOKENS[:30], finish=False)
    req = manager.requests["a"]
    mla_page, kda_page = req.blocks[0].pages[0], req.state_pages[0]
    conv, rec = manager.store.kda_views(kda_page, 0)
    manager.store.debug = False
    wrong_conv, wrong_rec = manager.store.kda_views(mla_page, 0)  # MLA latents read as KDA state
    # bf16 latents reinterpreted as float32 states: not within any tolerance of the real state, and
    # far outside the recurrence's integer range (or not finite)
    assert not torch.allclose(wrong_rec, rec, rtol=0.5) and not torch.equal(wrong_conv, conv)
    assert not bool(((wrong_rec == wrong_rec.round()) & (wrong_rec.abs() < 65521)).all())
    manager.store.debug = True
    with pytest.raises(PageKindError, match="holds MLA, accessed as KDA"):
        manager.store.kda_views(mla_page, 0)
    with pytest.raises(PageKindError, match="holds KDA, accessed as MLA"):
        manager.store.mla_rows(kda_page, 0)


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
