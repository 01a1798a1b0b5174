"""The bench's decode rows route like a served batch (bench/serve_decode's rows on the CPU, `nano` in bf16 as
on the device, the fast path eager).

Session 9's H200 runs found mini's 64 rows routed to the same 4 experts from the first MLA layer on: `Rank.fill`
reserves a context without a forward, and the pool has one free list for KDA and MLA pages, so once a sweep
recycles pages a row's context latents are a finished row's KDA state bytes (float32 read as bf16: Inf/NaN);
every row's hidden state turns NaN there, and NaN rows all pick the same top-k. A pool small enough to recycle
pages within the test reproduces it (the CPU bench's float32 pool does not: its stale bytes are finite)."""

from __future__ import annotations

import argparse
import math

import torch

from bench.serve_decode import decode_sweep_row, profile_forward, routed_step
from bench.serve_rank import Rank, random_model
from k3core.presets import preset

BATCH, CONTEXT = 16, 1024


def spread_bar(model: str, batch: int) -> int:
    """3/4 of the experts a layer reads at most, min(E, batch x top-k): nano at 16 rows 12 of 16 (64 uniform
    picks leave ~1.6 % of the experts unread); a collapsed batch reads top-k (4)."""
    c = preset(model)
    return math.ceil(0.75 * min(c.num_experts, batch * c.num_experts_per_token))


def bf16_rank(monkeypatch, num_pages: int) -> tuple[Rank, torch.nn.Module]:
    monkeypatch.setenv("K3_DECODE_FASTPATH", "1")
    monkeypatch.delenv("K3_DENSE_EXPERTS", raising=False)
    model = random_model(preset("nano"), "cpu", torch.bfloat16)
    args = argparse.Namespace(num_pages=num_pages, hash_block=512, prefix=0, increment=0, contexts=[CONTEXT],
                              steps=2, batches=[BATCH], budget=8192, device="cpu")
    return Rank(model, "nano", args, torch.bfloat16), model


def test_rows_spread_over_the_experts_when_the_pool_recycles_pages(monkeypatch):
    """Three rows of 16 requests at 1024 tokens in a pool that holds about two: from the second row on the
    requests' pages held earlier requests' KDA states. Every row's routing check and the profile's forward
    (after the rows: recycled pages too) touch >= 3/4 of the experts in every MoE layer, and the rows' own
    step reads no NaN (its fill zeroed the latents a prefill would have written)."""
    rank, model = bf16_rank(monkeypatch, num_pages=220)
    bar = spread_bar("nano", BATCH)
    rows = [decode_sweep_row(rank, model, BATCH, CONTEXT, 2, 1e10) for _ in range(3)]
    assert rank.manager.pool.num_free < 100  # the pool did recycle pages (~100 a row)
    assert [r["routing"]["experts_touched_min"] >= bar for r in rows] == [True] * 3, [r["routing"] for r in rows]
    assert all(r["routing"]["max_expert_load"] < BATCH for r in rows)
    touched = profile_forward(rank, BATCH, CONTEXT)["experts_touched"]
    assert len(touched) == 8 and min(touched) >= bar, touched


def test_fill_zeroes_the_latent_pages_it_reserves(monkeypatch):
    """Whatever a page held before (here: every byte of the pool 0xFF, a NaN in bf16 and float32), the MLA
    pages of filled requests read zero, their KDA state pages are zeroed before the first forward, and the
    rows' next step spreads over the experts."""
    rank, _ = bf16_rank(monkeypatch, num_pages=120)
    store = rank.manager.store
    store.data.fill_(0xFF)
    rids = [f"z{i}" for i in range(BATCH)]
    rank.fill(rids, CONTEXT)
    requests = [rank.manager.requests[r] for r in rids]
    latent = [p for req in requests for block in req.blocks for p in block.pages]
    state = [p for req in requests for p in req.state_pages]
    assert len(latent) == BATCH * (CONTEXT // 512) and state
    assert not store.data[latent].any() and not store.data[state].any()
    _, loads = routed_step(rank, rids, rank.next_tokens(BATCH, 0))
    assert min(sum(1 for n in layer if n) for layer in loads) >= spread_bar("nano", BATCH)
