"""Speculative decoding's pieces alone: the acceptance rule against hand-computed cases and against the
target's distribution (its guarantee), the KDA replay against token-by-token decode, and the worker flags."""

from __future__ import annotations

import json

import pytest
import torch

from k3.v1 import common_pb2
from k3core.cache.contiguous import ContiguousBatchCache
from services.engine.acceptance import accept_drafts, draft_token
from services.engine.config import WorkerConfig
from services.engine.params import GenerationOptions
from services.engine.sampler import sampling_probs
from services.engine.verify_replay import ProjectionCapture, VerifyBatchCache, replay_accepted
from tests.workers.cluster import OVERRIDES
from tests.workers.oracle import build_reference


def _options(temperature: float, seed: int = 0, top_k: int = 0) -> GenerationOptions:
    params = common_pb2.SamplingParams(temperature=temperature, seed=seed, max_tokens=8, top_k=top_k)
    return GenerationOptions.from_proto(params, vocab_size=300, max_tokens_limit=99)


def test_greedy_keeps_drafts_up_to_the_first_mismatch_then_the_targets_token():
    logits = torch.eye(5)[[3, 1, 4, 2]]  # the target's argmax after each position: 3, 1, 4, then 2
    assert accept_drafts(logits, [3, 1, 4], None, _options(0), 0) == [3, 1, 4, 2]  # all + bonus
    assert accept_drafts(logits, [3, 0, 4], None, _options(0), 0) == [3, 1]  # correction at the mismatch
    assert accept_drafts(logits, [2, 1, 4], None, _options(0), 0) == [3]
    with pytest.raises(ValueError, match="one more"):
        accept_drafts(logits, [3, 1], None, _options(0), 0)


@pytest.mark.parametrize("top_k", [0, 3])
def test_sampled_tokens_have_the_targets_distribution_whatever_the_draft(top_k):
    """The first emitted token over many seeds: its frequencies match the target's p (total variation),
    not the draft's q, though the draft proposes from a very different q."""
    target_logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0, 1.5], [0.0] * 6])
    draft_logits = torch.tensor([-1.0, 0.0, 2.0, 1.0, 1.5, -2.0])
    trials = 4000
    counts = torch.zeros(6)
    accepted = 0
    for seed in range(trials):
        opts = _options(1.0, seed, top_k)
        draft, q = draft_token(draft_logits, opts, 5)
        emitted = accept_drafts(target_logits, [draft], [q], opts, 5)
        counts[emitted[0]] += 1
        accepted += len(emitted) == 2
    p = sampling_probs(target_logits[0], _options(1.0, top_k=top_k))
    q = sampling_probs(draft_logits, _options(1.0, top_k=top_k))
    assert 0.5 * (counts / trials - p).abs().sum() < 0.03
    assert 0.5 * (counts / trials - q).abs().sum() > 0.2  # the test can tell p from q
    assert accepted / trials == pytest.approx(float(torch.minimum(p, q).sum()), abs=0.03)  # the rule's rate


def test_sampled_acceptance_is_a_function_of_seed_and_position():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(1))
    q = [torch.softmax(torch.randn(20, generator=torch.Generator().manual_seed(s)), 0) for s in (2, 3)]
    runs = {tuple(accept_drafts(logits, [4, 7], q, _options(0.8, seed=9), 11)) for _ in range(3)}
    assert len(runs) == 1


def _problems(*flags: str) -> list[str]:
    overrides = json.dumps({"kda_num_heads": 4, "num_attention_heads": 4})
    config = WorkerConfig(model_overrides=overrides)
    for name, value in zip(flags[::2], flags[1::2], strict=True):
        setattr(config, name, type(getattr(config, name))(value))
    return config.validate()


def test_draft_flags_are_checked_and_name_the_field():
    assert _problems("draft_model", "nano") == []
    assert "draft_model: unknown preset" in _problems("draft_model", "tiny")[0]
    assert "num_speculative_tokens" in _problems("draft_model", "nano", "num_speculative_tokens", "0")[0]
    assert _problems("draft_model", "nano", "tp_size", "2") == []  # every rank verifies its own heads
    assert "draft_model_overrides" in _problems("draft_model", "nano", "draft_model_overrides", "[1]")[0]
    mismatch = _problems("draft_model", "nano", "draft_model_overrides", '{"vocab_size": 512}')
    assert "share the tokenizer" in mismatch[0]


@torch.no_grad()
def test_replaying_a_kept_prefix_gives_the_state_of_decoding_it_token_by_token():
    """The mechanism alone: a verify forward over two windows with its KDA writes dropped, then the replay of
    2 and 3 kept tokens from the captured projections; every KDA layer's state and conv window equal those of
    plain one-token decode of the same tokens, and the kept MLA rows equal that run's rows."""
    model = build_reference("nano", OVERRIDES)
    prompts, windows, kept = [[5, 9, 17, 33, 2], [40, 41, 42]], [[7, 8, 9, 10], [11, 12, 13]], [2, 3]
    spec, plain = ([model.new_sequence_cache() for _ in prompts] for _ in range(2))
    for caches in (spec, plain):
        for prompt, cache in zip(prompts, caches, strict=True):
            model.prefill(torch.tensor(prompt), cache, 0)
    capture = ProjectionCapture(model)
    view = VerifyBatchCache(ContiguousBatchCache(spec, [len(w) for w in windows]))
    with capture.capturing():
        model(torch.tensor([t for w in windows for t in w]), view, logits_for="all")
    commit = ContiguousBatchCache(spec, kept)  # the pre-window states: the verify forward wrote none
    replay_accepted(capture.layers, capture.inputs, commit, [len(w) for w in windows], kept)
    commit.commit()
    for window, count, cache in zip(windows, kept, plain, strict=True):
        for token in window[:count]:
            model.decode(torch.tensor([token]), [cache])
    for ours, reference in zip(spec, plain, strict=True):
        assert ours.length == reference.length
        torch.testing.assert_close(ours.kda_state, reference.kda_state, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours.kda_conv, reference.kda_conv, atol=1e-5, rtol=1e-5)
        for layer in range(len(model.config.mla_layers)):
            torch.testing.assert_close(ours.mla_rows(layer, ours.length), reference.mla_rows(layer, ours.length),
                                       atol=1e-5, rtol=1e-5)
    assert not torch.allclose(spec[0].kda_state, plain[1].kda_state)  # the states are not trivially equal
