"""Prefill forwards through `services.engine.fast_prefill` (the decode fast path's fused forms around the
reference attention layers; on this CPU K3_DECODE_FASTPATH=1 runs them with the kernels' references): the
logits of every chunk, a chunk after cached context and a batch mixing a chunk with a decode row equal those
of k3core's model on its contiguous cache (the oracle), and the cache it writes serves the next steps as the
reference's does. K3_PREFILL_FASTPATH=0 gives the reference prefill back."""

from __future__ import annotations

import pytest
import torch

from k3core.cache.layout import plan_layout, shape_from_config
from k3core.cache.manager import PrefixCacheManager
from services.engine.model_runner import ModelRunner
from tests.workers.oracle import build_reference

PROMPTS = {"a": [(13 * j) % 250 + 1 for j in range(40)], "b": [(7 * j + 3) % 250 + 1 for j in range(21)]}


@pytest.fixture(params=["nano", "nano-kl"])  # Block AttnRes and the plain residual
def setup(request, monkeypatch):
    monkeypatch.setenv("K3_DECODE_FASTPATH", "1")
    model = build_reference(request.param, seed=3)
    layout = plan_layout(shape_from_config(model.config, request.param), 1, conv_dtype=torch.float32,
                         mla_dtype=torch.float32, hash_block_tokens=16)
    manager = PrefixCacheManager(layout, 64, device="cpu")
    runner = ModelRunner(model, "cpu", max_model_len=128, max_batch=4)
    assert runner.decode_fastpath(manager, tp_size=1) is not None and runner.fast_prefill is not None
    calls = []
    forward = runner.fast_prefill.forward
    runner.fast_prefill.forward = lambda *a: calls.append(1) or forward(*a)
    return model, manager, runner, calls


@torch.no_grad()
def _reference(model, prompt: list[int]) -> torch.Tensor:
    return model.prefill(torch.tensor(prompt), model.new_sequence_cache(), 0)


def _step(manager, runner, rows: dict[str, list[int]]) -> torch.Tensor:
    for rid, tokens in rows.items():
        manager.reserve(rid, len(tokens))
    manager.pre_forward()
    logits = runner.forward(list(rows.values()), manager.batch_view(list(rows)))
    for rid in rows:
        manager.forward_done(rid)
    manager.commit_step()
    return logits


def test_chunks_after_context_and_mixed_batches_match_the_reference(setup):
    model, manager, runner, calls = setup
    a, b = PROMPTS["a"], PROMPTS["b"]
    want_a, want_b = _reference(model, a), _reference(model, b)
    manager.add_request("a", a[:-1])
    manager.add_request("b", b[:-1])
    close = dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(_step(manager, runner, {"a": a[:24]})[0], want_a[23], **close)
    got = _step(manager, runner, {"a": a[24:-1], "b": b[:-1]})  # a chunk after 24 cached tokens, b's first
    torch.testing.assert_close(got, torch.stack([want_a[-2], want_b[-2]]), **close)
    assert len(calls) == 2
    for rid, prompt in PROMPTS.items():
        manager.append_tokens(rid, prompt[-1:])
    # decode-only (the reference layers) from the cache the fast prefill wrote, then a mixed batch
    torch.testing.assert_close(_step(manager, runner, {"a": a[-1:], "b": b[-1:]}),
                               torch.stack([want_a[-1], want_b[-1]]), **close)
    assert len(calls) == 2
    tail = [5, 6, 7]  # a chunk of a beside a decode row of b
    manager.append_tokens("a", tail)
    manager.append_tokens("b", [8])
    got = _step(manager, runner, {"a": tail, "b": [8]})
    torch.testing.assert_close(got, torch.stack([_reference(model, a + tail)[-1], _reference(model, b + [8])[-1]]),
                               **close)
    assert len(calls) == 3


def test_the_switch_gives_the_reference_prefill_back(setup, monkeypatch):
    model, manager, runner, calls = setup
    monkeypatch.setenv("K3_PREFILL_FASTPATH", "0")
    manager.add_request("a", PROMPTS["a"])
    got = _step(manager, runner, {"a": PROMPTS["a"][:30]})
    torch.testing.assert_close(got[0], _reference(model, PROMPTS["a"])[29], rtol=1e-4, atol=1e-4)
    assert not calls
