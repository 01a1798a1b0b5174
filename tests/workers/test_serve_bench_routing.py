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

import pytest
import torch

from bench.serve_decode import decode_sweep_row, profile_forward, routed_step
from bench.serve_rank import Rank, random_model
from k3core.presets import preset

BATCH, CONTEXT = 16, 1024


def spread_bar(model: str, batch: int) -> int:
    """3/4 of the experts a layer reads when `batch` tokens pick top-k of E uniformly: E (1 - (1 - k/E)^batch),
    which is min(E, batch x top-k) where one term dominates (nano at 16 rows: 15.8 -> 12; mini at 64: 32 -> 24)
    and the honest count in between (mini at 8 rows: 21.0 -> 16, not 3/4 of 32). A collapsed batch reads top-k."""
    c = preset(model)
    experts, k = c.num_experts, c.num_experts_per_token
    return math.ceil(0.75 * experts * (1 - (1 - k / experts) ** batch))


def bf16_rank(monkeypatch, num_pages: int, model_name: str = "nano") -> tuple[Rank, torch.nn.Module]:
    """The bench's rank in bf16 (the device's dtype; the CPU bench runs float32). mini gets a 1024-token
    vocabulary (its LM head would dominate the CPU time; the bench's rows use ids up to 998)."""
    monkeypatch.setenv("K3_DECODE_FASTPATH", "1")
    monkeypatch.delenv("K3_DENSE_EXPERTS", raising=False)
    config = preset(model_name)
    model = random_model(config if model_name == "nano" else config.replace(vocab_size=1024), "cpu", torch.bfloat16)
    args = argparse.Namespace(num_pages=num_pages, hash_block=512, prefix=0, increment=0, contexts=[CONTEXT],
                              steps=2, batches=[64], budget=8192, device="cpu")
    return Rank(model, model_name, args, torch.bfloat16), model


def check_rows_spread(monkeypatch, model_name: str, batch: int, num_pages: int) -> None:
    """Three rows of `batch` requests at 1024 tokens in a pool that holds about two: later rows' pages held
    earlier requests' KDA states. Every row's routing check and the profile's forward (after the rows:
    recycled pages too) touch >= 3/4 of the experts in every MoE layer (without the fill's zeroing: top-k
    from the first MLA layer on)."""
    rank, model = bf16_rank(monkeypatch, num_pages, model_name)
    bar = spread_bar(model_name, batch)
    rows = [decode_sweep_row(rank, model, batch, CONTEXT, 2, 1e10) for _ in range(3)]
    assert rank.manager.pool.num_free < num_pages // 2  # the pool did recycle pages
    assert [r["routing"]["experts_touched_min"] >= bar for r in rows] == [True] * 3, [r["routing"] for r in rows]
    assert all(r["routing"]["max_expert_load"] < batch and r["routing"]["finite_rows"] == batch for r in rows)
    profile = profile_forward(rank, batch, CONTEXT)
    touched = profile["experts_touched"]
    assert profile["finite_rows"] == batch
    moe_layers = sum(model.config.is_moe_layer(i) for i in range(model.config.num_hidden_layers))
    assert len(touched) == moe_layers and min(touched) >= bar, touched


def test_rows_spread_over_the_experts_when_the_pool_recycles_pages(monkeypatch):
    check_rows_spread(monkeypatch, "nano", BATCH, num_pages=220)  # ~100 pages a row


@pytest.mark.slow
def test_mini_rows_spread_over_the_experts_when_the_pool_recycles_pages(monkeypatch):
    """mini's layers (1024-token vocabulary), 8 rows: ~180 pages a row (minutes and ~6 GiB on this CPU)."""
    check_rows_spread(monkeypatch, "mini", 8, num_pages=400)


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
    _, loads, finite = routed_step(rank, rids, rank.next_tokens(BATCH, 0))
    assert finite == BATCH and min(sum(1 for n in layer if n) for layer in loads) >= spread_bar("nano", BATCH)
