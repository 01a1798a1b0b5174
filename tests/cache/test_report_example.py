"""K3 report figure 12: 6144-token physical blocks, 512-token hash blocks, a request matching 2800 cached
tokens hits at B = 2560 and recomputes only from there."""

from __future__ import annotations

import random

from k3core.cache.hashing import chain_hashes
from k3core.cache.layout import plan_layout, shape_from_config
from k3core.cache.manager import PrefixCacheManager
from k3core.presets import preset


def _run(manager: PrefixCacheManager, rid: str, tokens: list[int], chunk: int = 1024) -> None:
    """Prefill in chunks snapped to hash-block multiples (the last remainder runs alone), then commit."""
    req = manager.requests[rid]
    while req.num_computed < len(tokens):
        manager.reserve(rid, manager.prefill_chunk(rid, chunk))
        manager.pre_forward()
        manager.forward_done(rid)
        manager.commit_step()


def test_k3_tp1_hits_inside_a_6144_token_block() -> None:
    layout = plan_layout(shape_from_config(preset("k3"), "k3"), tp=1)
    assert (layout.tokens_per_block, layout.hash_block_tokens) == (6144, 512)
    manager = PrefixCacheManager(layout, num_pages=64)  # metadata only: K3 pages are 162 MiB each
    rng = random.Random(0)
    prompt = [rng.randrange(1000) for _ in range(2600)]  # its prompt-end checkpoint sits at 2560
    manager.add_request("a", prompt)
    _run(manager, "a", prompt)
    cached = list(prompt)
    for _ in range(700):  # "a" decodes to 3300 tokens; its latest checkpoint moves to 3072
        cached.append(rng.randrange(1000))
        manager.append_tokens("a", cached[-1:])
        _run(manager, "a", cached)
    manager.finish("a")
    assert sorted(c.num_tokens for c in manager.checkpoints.by_key.values()) == [2560, 3072]

    request = cached[:2800] + [rng.randrange(1000, 2000) for _ in range(1200)]
    hit = manager.lookup(chain_hashes(request, 512), len(request))
    assert hit.mla_tokens == 2560  # the hash block ending at 3072 differs; 2800 is not an endpoint
    assert manager.add_request("b", request) == 2560
    req = manager.requests["b"]
    assert req.num_computed == 2560 and len(req.blocks) == 1
    # Block 0 is "a"'s partial page: "b" gets a private copy-on-write copy of exactly 5 hash blocks.
    source = manager.index.find(req.chain[4]).block
    assert req.blocks[0] is not source and req.blocks[0].filled == 5
    assert manager.pre_forward() == []  # metadata only: no tensors to copy here
    forwards = []
    while req.num_computed < len(request):
        n = manager.prefill_chunk("b", 8192)
        forwards.append((req.num_computed, n))
        manager.reserve("b", n)
        manager.forward_done("b")
        manager.commit_step()
    assert forwards == [(2560, 1024), (3584, 416)]  # prefill resumes at B; the unaligned rest runs alone
