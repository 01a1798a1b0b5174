"""The cost-aware eviction order (`k3core.cache.retention`): what no checkpoint can use goes first, then
superseded turn boundaries, then whole conversations least recently used first; a block whose loss would
strand a checkpoint is never taken while anything else is idle. Metadata-only managers (page ids and
hashes): the order is what is checked here, the bytes are checked by the state machines."""

from __future__ import annotations

import random

import pytest
from cache_synth import VOCAB, tiny_layout

from k3core.cache.checkpoints import Checkpoint, CheckpointPolicy
from k3core.cache.hashing import chain_hashes
from k3core.cache.manager import PrefixCacheManager
from k3core.cache.pool import PageKind, PagePool
from k3core.cache.prefix_index import Block
from k3core.cache.retention import Retention

LAYOUT = tiny_layout(hash_block=4, tokens_per_block=12)  # 2 KDA groups (2-page checkpoints), 1 MLA group


def conversation(seed: int, length: int) -> list[int]:
    return [random.Random(seed).randrange(VOCAB) for _ in range(length)]


def turn(manager: PrefixCacheManager, rid: str, tokens: list[int]) -> int:
    """Admit, prefill in 8-token chunks snapped to the hash grid, finish as a turn boundary."""
    hit = manager.add_request(rid, tokens)
    while manager.requests[rid].num_computed < len(tokens):
        manager.reserve(rid, manager.prefill_chunk(rid, 8))
        manager.forward_done(rid)
        manager.commit_step()
    manager.finish(rid)
    return hit


def resident_boundary(manager: PrefixCacheManager, checkpoint: Checkpoint) -> int:
    """The hit a request extending the checkpoint's prefix gets (its boundary when nothing is missing)."""
    chain = checkpoint.prefix_hashes(LAYOUT.hash_block_tokens)
    return manager.lookup(chain, checkpoint.num_tokens + 1).num_tokens


def test_pool_evicts_the_lowest_tier_first_lru_within() -> None:
    pool = PagePool(4, num_tiers=2)
    owners = []
    for tier in (1, 0, 1, 0):

        class Entry:
            def __init__(self, page: int) -> None:
                self.page = page

            def evict(self) -> None:
                pool.release(self.page)
                owners.remove(self)

        page = pool.allocate(PageKind.MLA, 0)[0]
        entry = Entry(page)
        owners.append(entry)
        pool.adopt(page, entry, tier)
        pool.decref(page)
    first_low, second_low = owners[1], owners[3]
    pool.evict_one()
    assert first_low not in owners and second_low in owners
    pool.set_tier(owners[0].page, 0)  # moved down: now the next victim after the remaining tier-0 entry
    pool.evict_one()
    pool.evict_one()
    assert [o.page for o in owners] == [2]
    pool.check_invariants()


def test_blocks_past_the_last_checkpoint_are_evicted_before_any_conversation() -> None:
    manager = PrefixCacheManager(LAYOUT, 40, policy=CheckpointPolicy(keep_prompt_end=False))
    a, b = conversation(1, 30), conversation(2, 30)
    turn(manager, "a", a)
    turn(manager, "b", b)
    (ckpt_a,) = [c for c in manager.checkpoints.by_key.values() if c.owner == "a"]
    manager.drop_checkpoint(ckpt_a)  # a's conversation lost its checkpoint: its blocks are worthless now
    blocks_a = {id(manager.index.answering(h)) for h in chain_hashes(a, 4)}
    assert all(manager.pool.tier[p] == Retention.WORTHLESS for h in chain_hashes(a, 4)
               for p in manager.index.answering(h).pages)
    evicted: list[object] = []
    for _ in blocks_a:
        page = next(p for lru in manager.pool._cached for p in lru)
        evicted.append(manager.pool.owner[page])
        manager.pool.evict_one()
    assert {id(o) for o in evicted} == blocks_a
    (ckpt_b,) = manager.checkpoints.by_key.values()
    assert resident_boundary(manager, ckpt_b) == 28  # b untouched


def test_superseded_turn_boundary_goes_before_a_live_conversation() -> None:
    manager = PrefixCacheManager(LAYOUT, 40, policy=CheckpointPolicy(keep_prompt_end=False))
    a, b = conversation(1, 40), conversation(2, 30)
    turn(manager, "a1", a[:22])  # turn end at 20
    turn(manager, "b", b)
    assert turn(manager, "a2", a) == 20  # a's next turn extends the first: turn end at 40 supersedes 20
    old = manager.checkpoints.find(chain_hashes(a, 4)[4])
    assert old is not None and old.superseded
    assert all(manager.pool.tier[p] == Retention.SUPERSEDED for p in old.pages)
    while manager.checkpoints.find(chain_hashes(a, 4)[4]) is not None:
        manager.pool.evict_one()
    for checkpoint in manager.checkpoints.by_key.values():
        assert resident_boundary(manager, checkpoint) == checkpoint.num_tokens  # a at 40 and b whole


def test_a_recomputed_duplicate_answers_no_lookup_and_is_worthless() -> None:
    manager = PrefixCacheManager(LAYOUT, 40, policy=CheckpointPolicy(keep_prompt_end=False, branch_points=False))
    shared = conversation(3, 24)
    turn(manager, "a", shared + [1] * 6)
    manager.drop_checkpoint(next(iter(manager.checkpoints.by_key.values())))
    turn(manager, "b", shared + [2] * 6)  # a miss: b recomputes the shared blocks (standby copies)
    req_blocks = [o for o in manager.pool.owner if isinstance(o, Block) and not o.endpoints and o.standby]
    assert req_blocks and all(manager.pool.tier[p] == Retention.WORTHLESS for b in req_blocks for p in b.pages)
    (ckpt_b,) = manager.checkpoints.by_key.values()
    assert resident_boundary(manager, ckpt_b) == 28


@pytest.mark.parametrize("seed", range(3))
def test_under_pressure_no_resident_checkpoint_is_stranded(seed: int) -> None:
    """Many conversations through a small pool: after every turn each checkpoint still has its whole
    prefix (eviction takes a conversation's checkpoint before the blocks it needs), and the least recently
    used conversation is the one that left."""
    rng = random.Random(seed)
    manager = PrefixCacheManager(LAYOUT, 30, policy=CheckpointPolicy(keep_prompt_end=False,
                                                                      max_pool_fraction=1.0))
    contexts = {s: conversation(10 + s, rng.randrange(12, 40)) for s in range(6)}
    for t in range(60):
        s = rng.randrange(6)
        turn(manager, f"{s}:{t}", contexts[s])
        contexts[s] = contexts[s] + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 9))]
        for checkpoint in manager.checkpoints.by_key.values():
            assert resident_boundary(manager, checkpoint) == checkpoint.num_tokens
        manager.pool.check_invariants()


def test_lru_eviction_keeps_one_tier() -> None:
    manager = PrefixCacheManager(LAYOUT, 40, policy=CheckpointPolicy(eviction="lru"))
    turn(manager, "a", conversation(1, 30))
    assert set(manager.pool.tier) == {0} and len(manager.pool._cached) == 1
    with pytest.raises(ValueError, match="eviction"):
        CheckpointPolicy(eviction="fifo")


@pytest.mark.parametrize("eviction", ["value", "lru"])
def test_pressure_takes_recomputed_duplicates_before_an_older_conversation(eviction: str) -> None:
    """b misses (a's checkpoint lies past their shared prefix) and recomputes the shared blocks. Those
    copies answer no lookup; under pressure the value order takes them and both conversations stay
    reusable, where one LRU over entries takes a's checkpoint (the oldest entry) and loses a."""
    policy = CheckpointPolicy(keep_prompt_end=False, eviction=eviction, branch_points=False)
    manager = PrefixCacheManager(LAYOUT, 30, policy=policy)
    shared = conversation(4, 24)
    a, b = shared + conversation(5, 12), shared + conversation(6, 12)
    turn(manager, "a", a)
    assert turn(manager, "b", b) == 0
    filler = manager.pool.allocate(PageKind.MLA, 0, manager.pool.num_free + 2)  # 2 pages must be evicted
    kept = sorted(c.num_tokens for c in manager.checkpoints.by_key.values()
                  if resident_boundary(manager, c) == c.num_tokens)
    assert kept == ([36, 36] if eviction == "value" else [36])
    for page in filler:
        manager.pool.decref(page)
    manager.pool.check_invariants()


def test_waypoints_let_pressure_trim_a_conversation_from_its_tail() -> None:
    """A long prefill keeps a waypoint checkpoint every 16 tokens. Under pressure the conversation loses
    its turn end and the blocks past its deepest waypoint first; its next turn still hits there."""
    policy = CheckpointPolicy(keep_prompt_end=False, waypoint_tokens=16, max_pool_fraction=1.0)
    manager = PrefixCacheManager(LAYOUT, 40, policy=policy)
    long = conversation(7, 50)
    turn(manager, "a", long)  # chunks end at 8, 16 (waypoint), ..., 32 (waypoint), 40, 48: turn end 48
    kept = sorted(c.num_tokens for c in manager.checkpoints.by_key.values())
    assert kept == [16, 32, 48]
    filler = manager.pool.allocate(PageKind.MLA, 0, manager.pool.num_free)
    while manager.checkpoints.find(chain_hashes(long, 4)[11]) is not None:  # the turn end (48) goes first
        manager.pool.evict_one()
    assert sorted(c.num_tokens for c in manager.checkpoints.by_key.values()) == [16, 32]
    manager.pool.evict_one()  # the block past the deepest waypoint (tokens 36-47) is worthless now
    for page in filler:
        manager.pool.decref(page)
    assert turn(manager, "a2", long + [1, 2, 3]) == 32  # its next turn starts from the waypoint...
    waypoint = manager.checkpoints.find(chain_hashes(long, 4)[7])
    assert waypoint is not None and not waypoint.superseded  # ...which stays a waypoint of the conversation
    (end,) = [c for c in manager.checkpoints.by_key.values() if c.num_tokens == 52]
    assert [w.num_tokens for w in end.waypoints] == [16, 32]


def test_a_conversations_waypoints_follow_its_turns() -> None:
    policy = CheckpointPolicy(keep_prompt_end=False, waypoint_tokens=16, max_pool_fraction=1.0)
    manager = PrefixCacheManager(LAYOUT, 60, policy=policy)
    tokens = conversation(8, 40)
    turn(manager, "t0", tokens)
    assert turn(manager, "t1", tokens + [5] * 6) == 40
    (end,) = [c for c in manager.checkpoints.by_key.values() if c.num_tokens == 44]
    assert [w.num_tokens for w in end.waypoints] == [16, 32]  # inherited from the first turn's prefill
