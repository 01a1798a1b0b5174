"""Sampling against hand-computed distributions, and the offline generation loop on nano."""

import math

import pytest
import torch

from k3core.generate import GenerationRequest, generate
from k3core.model import K3Model
from k3core.model.init import init_weights
from k3core.presets import preset
from k3core.sampling import RequestSampler, SamplingError, SamplingParams, filtered_probs, sample_batch

LOGITS = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))


def test_greedy_and_top_k_one_are_argmax():
    assert RequestSampler(SamplingParams(temperature=0)).sample(LOGITS) == 0
    assert RequestSampler(SamplingParams(temperature=5.0, top_k=1, seed=3)).sample(LOGITS) == 0


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = filtered_probs(LOGITS, SamplingParams(top_p=0.7))
    assert torch.allclose(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    assert torch.allclose(filtered_probs(LOGITS, SamplingParams(top_p=0.5)), torch.tensor([1.0, 0, 0, 0]))


def test_temperature_then_top_k():
    probs = filtered_probs(LOGITS, SamplingParams(temperature=2.0, top_k=2))
    kept = torch.tensor([0.5, 0.3]).sqrt()
    assert torch.allclose(probs[:2], kept / kept.sum()) and probs[2:].sum() == 0


def test_empirical_frequencies_match_the_filtered_distribution():
    sampler = RequestSampler(SamplingParams(temperature=1.0, top_p=0.9, seed=7))
    draws = torch.tensor([sampler.sample(LOGITS) for _ in range(4000)])
    expected = filtered_probs(LOGITS, sampler.params)
    for token in range(4):
        freq = float((draws == token).float().mean())
        assert abs(freq - float(expected[token])) < 4 * math.sqrt(0.25 / 4000) + 1e-9


def test_seeded_requests_are_reproducible_and_independent_of_the_batch():
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(20, 3, 50, generator=gen)
    alone = RequestSampler(SamplingParams(seed=11))
    tokens_alone = [alone.sample(r[0]) for r in rows]
    pair = [RequestSampler(SamplingParams(seed=11)), RequestSampler(SamplingParams(seed=99, top_k=5))]
    tokens_batched = [int(sample_batch(r[:2], pair)[0]) for r in rows]
    assert tokens_alone == tokens_batched


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"seed": -1}, "seed"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(SamplingError, match=field):
        SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def nano():
    return init_weights(K3Model(preset("nano")), seed=0).eval()


def _requests():
    return [
        GenerationRequest(
            [256, 72, 101, 108, 108, 111], 8, SamplingParams(temperature=0.8, top_p=0.95, seed=5)
        ),
        GenerationRequest([256], 6, SamplingParams(temperature=0)),
        GenerationRequest(list(range(60, 90)), 4, SamplingParams(temperature=1.2, top_k=20, seed=8)),
    ]


def test_generation_is_deterministic_and_batch_independent(nano):
    batched = generate(nano, _requests())
    assert [r.tokens for r in batched] == [r.tokens for r in generate(nano, _requests())]
    for request, result in zip(_requests(), batched, strict=True):
        (alone,) = generate(nano, [request], prefill_chunk=7)
        assert alone.tokens == result.tokens
        assert max(abs(a - b) for a, b in zip(alone.logprobs, result.logprobs, strict=True)) < 1e-4
    assert [len(r.tokens) for r in batched] == [8, 6, 4] and all(r.finish_reason == "length" for r in batched)


def test_generation_stops_on_a_stop_token(nano):
    (greedy,) = generate(nano, [GenerationRequest([256], 3, SamplingParams(temperature=0))])
    stop = greedy.tokens[1]
    (stopped,) = generate(nano, [GenerationRequest([256], 3, SamplingParams(temperature=0), (stop,))])
    assert stopped.tokens == greedy.tokens[:2] and stopped.finish_reason == "stop"
    with pytest.raises(ValueError, match="prompt"):
        GenerationRequest([], 3)
