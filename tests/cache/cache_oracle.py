"""Checks that every registered cache entry holds exactly the bytes of its declared token prefix."""

from __future__ import annotations

from functools import lru_cache

import torch
from cache_synth import SHAPE, reference

from k3core.cache.hashing import chain_hashes
from k3core.cache.layout import PoolLayout
from k3core.cache.manager import PrefixCacheManager
from k3core.cache.page_store import PageStore
from k3core.cache.pool import PageKind, PagePool


class PrefixOracle:
    """Remembers the token prefix behind every chain hash it has seen and renders expected page bytes."""

    def __init__(self, layout: PoolLayout) -> None:
        self.layout = layout
        self.prefix_of: dict[int, tuple[int, ...]] = {}
        pool = PagePool(1)
        self._scratch = PageStore(layout, pool)
        self._pool = pool

    def learn(self, tokens: list[int]) -> None:
        hb = self.layout.hash_block_tokens
        for i, h in enumerate(chain_hashes(tokens, hb)):
            self.prefix_of.setdefault(h, tuple(tokens[: (i + 1) * hb]))

    @lru_cache(maxsize=4096)  # noqa: B019 (one oracle per test run)
    def kda_bytes(self, tokens: tuple[int, ...]) -> torch.Tensor:
        convs, recs, _ = reference(list(tokens))
        lay = self.layout
        out = []
        for group in range(lay.num_kda_groups):
            self._pool.kind[0] = PageKind.KDA
            self._scratch.zero(0)
            for slot in range(lay.layers_per_group):
                layer = group * lay.layers_per_group + slot
                if layer < SHAPE.num_kda_layers:
                    conv, rec = self._scratch.kda_views(0, slot)
                    conv.copy_(convs[layer])
                    rec.copy_(recs[layer])
            out.append(self._scratch.read(0, lay.kda_page_used_bytes))
        return torch.stack(out)

    @lru_cache(maxsize=4096)  # noqa: B019
    def mla_bytes(self, tokens: tuple[int, ...], block: int, rows: int) -> torch.Tensor:
        """Expected bytes of physical block `block` holding its first `rows` tokens, per MLA group."""
        _, _, latents = reference(list(tokens))
        lay = self.layout
        start = block * lay.tokens_per_block
        out = []
        for group in range(lay.num_mla_groups):
            self._pool.kind[0] = PageKind.MLA
            self._scratch.zero(0)
            for slot in range(lay.layers_per_group):
                layer = group * lay.layers_per_group + slot
                if layer < SHAPE.num_mla_layers:
                    self._scratch.mla_rows(0, slot)[:rows].copy_(latents[layer][start : start + rows])
            out.append(self._scratch.read(0, lay.mla_prefix_bytes(rows)))
        return torch.stack(out)

    def check(self, manager: PrefixCacheManager) -> int:
        """Assert every committed entry on GPU and CPU matches its prefix; returns how many were checked."""
        store, lay, hb = manager.store, self.layout, self.layout.hash_block_tokens
        assert store is not None
        checked = 0
        for chain_hash, endpoint in manager.index.items():
            if not endpoint.ready:
                continue
            prefix = self.prefix_of[chain_hash]
            rows = endpoint.hash_blocks * hb
            got = torch.stack([store.read(p, lay.mla_prefix_bytes(rows)) for p in endpoint.block.pages])
            assert torch.equal(got, self.mla_bytes(prefix, endpoint.block.index, rows)), f"MLA {chain_hash:#x}"
            checked += 1
        for checkpoint in manager.checkpoints.by_key.values():
            if checkpoint.ready:
                prefix = self.prefix_of[checkpoint.key]
                assert len(prefix) == checkpoint.num_tokens
                got = torch.stack([store.read(p, lay.kda_page_used_bytes) for p in checkpoint.pages])
                assert torch.equal(got, self.kda_bytes(prefix)), f"checkpoint at {checkpoint.num_tokens}"
                checked += 1
        if manager.cpu is not None:
            for host in manager.cpu.blocks():
                for chain_hash, covered in host.endpoints:
                    expected = self.mla_bytes(self.prefix_of[chain_hash], host.index, covered * hb)
                    got = torch.stack([d[: expected.shape[1]] for d in host.data])
                    assert torch.equal(got, expected), f"host block {chain_hash:#x}"
                    checked += 1
            for host in manager.cpu.checkpoints():
                assert torch.equal(torch.stack(host.data), self.kda_bytes(self.prefix_of[host.key]))
                checked += 1
        return checked

    def check_private(self, manager: PrefixCacheManager, rid: str, tokens: list[int]) -> None:
        """A running request's private state and block table hold exactly its computed prefix."""
        req, store, lay = manager.requests[rid], manager.store, self.layout
        assert store is not None
        prefix = tuple(tokens[: req.num_computed])
        got = torch.stack([store.read(p, lay.kda_page_used_bytes) for p in req.state_pages])
        assert torch.equal(got, self.kda_bytes(prefix)), f"{rid} private state at {req.num_computed}"
        for k, block in enumerate(req.blocks):
            rows = min(lay.tokens_per_block, req.num_computed - k * lay.tokens_per_block)
            if rows > 0:
                got = torch.stack([store.read(p, lay.mla_prefix_bytes(rows)) for p in block.pages])
                assert torch.equal(got, self.mla_bytes(prefix, k, rows)), f"{rid} block {k}"
