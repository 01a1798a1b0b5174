"""Batched, counter-based sampling (`services.engine.sampler`): the noise hash against a Python-integer
reference and pinned values, a row's token independent of the rest of the batch, and the empirical
distribution of many (seed, index) draws against a float64 oracle of the sampling distribution."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.engine.acceptance import accept_drafts, draft_token
from services.engine.params import GenerationOptions
from services.engine.sampler import (
    column_keys,
    gumbel_noise,
    noise_bits,
    sample_next,
    sample_rows,
    sampling_probs,
    token_seed,
)
from tests.support.mix_oracle import GOLDEN, MOD
from tests.support.mix_oracle import noise_bits as reference_bits


def options(temperature: float, top_k: int = 0, top_p: float = 1.0, seed: int = 0) -> GenerationOptions:
    return GenerationOptions(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, max_tokens=8, stop=(),
                             stop_token_ids=frozenset(), ignore_eos=True)


def test_noise_bits_pinned_values():
    """A change of the hash changes every sampled token of every seed: these values catch it."""
    got = noise_bits(torch.tensor([0, 1, MOD - 1]), 3).tolist()
    assert got[0] == [1517046713075839355, 7960286522194355700, 7036458801432265024]
    assert got[1][0] == 1097491722282735498
    assert got[2][2] == 2244677178587611952


def test_column_keys_are_built_once_per_vocab_and_device_and_never_written():
    cpu = torch.device("cpu")
    keys = column_keys(3, cpu)
    assert column_keys(3, cpu) is keys and column_keys(4, cpu) is not keys
    first = noise_bits(torch.tensor([0, 1, MOD - 1]), 3)
    assert keys.tolist() == [(v + 1) * GOLDEN % MOD for v in range(3)]  # noise_bits added into a copy
    assert noise_bits(torch.tensor([0, 1, MOD - 1]), 3).equal(first)


@settings(max_examples=40, deadline=None)
@given(keys=st.lists(st.integers(0, MOD - 1), min_size=1, max_size=4), vocab=st.integers(1, 40))
def test_noise_bits_equal_python_integer_reference(keys, vocab):
    got = noise_bits(torch.tensor(keys, dtype=torch.int64), vocab).tolist()
    assert got == [[reference_bits(key, v) for v in range(vocab)] for key in keys]


def test_gumbel_noise_is_minus_log_minus_log_of_an_odd_53_bit_fraction():
    keys = [token_seed(seed, index) for seed, index in ((0, 0), (7, 3), (2**62, 99))]
    got = gumbel_noise(torch.tensor(keys), 50)
    for key, row in zip(keys, got.tolist(), strict=True):
        for v, value in enumerate(row):
            u = (2 * (reference_bits(key, v) >> 11) + 1) / 2**53
            assert 0 < u < 1
            assert value == pytest.approx(-math.log(-math.log(u)), rel=1e-12, abs=1e-12)


VOCAB = 13
ROW_OPTIONS = st.builds(options, st.sampled_from([0.0, 0.0, 0.7, 1.3]), st.sampled_from([0, 3, VOCAB + 2]),
                        st.sampled_from([1.0, 0.8, 0.3]), st.integers(0, 2**63 - 1))


@settings(max_examples=60, deadline=None)
@given(data=st.data(), batch=st.integers(1, 6))
def test_a_rows_token_depends_only_on_its_logits_seed_and_index(data, batch):
    """Each request's token alone (`sample_next`) equals its token in any batch: other rows, their order,
    which of them are greedy, duplicates. Small integer logits make ties common."""
    logits = torch.tensor(data.draw(st.lists(st.lists(st.integers(-3, 3), min_size=VOCAB, max_size=VOCAB),
                                             min_size=batch, max_size=batch)), dtype=torch.float32)
    picked = data.draw(st.lists(st.integers(0, batch - 1), min_size=1, max_size=2 * batch))
    rows = [(row, data.draw(ROW_OPTIONS), data.draw(st.integers(0, 10**6))) for row in picked]
    alone = [sample_next(logits[row], opts, index) for row, opts, index in rows]
    assert sample_rows(logits, rows) == alone
    order = data.draw(st.permutations(range(len(rows))))
    assert sample_rows(logits, [rows[i] for i in order]) == [alone[i] for i in order]
    greedy = [(row, options(0.0), index) for row, _, index in rows]
    mixed = [r for pair in zip(rows, greedy, strict=True) for r in pair]
    assert sample_rows(logits, mixed)[::2] == alone


LOGITS = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0, 1.5, -0.5, 0.3])
DRAWS = 20_000


def oracle_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """float64, independent of the sampler: softmax(logits / T) over the top-k scores, then the smallest
    prefix by probability whose mass before each token is < top_p, renormalised."""
    scores = logits.double() / temperature
    if top_k:
        scores[scores < torch.sort(scores, descending=True).values[top_k - 1]] = -math.inf
    probs = torch.softmax(scores, 0)
    keep = torch.zeros(len(probs), dtype=torch.bool)
    mass = 0.0
    for token in torch.argsort(probs, descending=True).tolist():
        if mass < top_p and probs[token] > 0:
            keep[token] = True
        mass += float(probs[token])
    probs = probs * keep
    return probs / probs.sum()


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    kept = probs > 0
    expected = DRAWS * probs[kept]
    return float(((counts[kept] - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (1.0, 6, 0.7)])
def test_draws_over_seeds_and_indices_follow_the_sampling_distribution(temperature, top_k, top_p):
    """20k draws (seeds 0..1999 x indices 0..9) against the float64 oracle: chi-square with at most 7
    degrees of freedom below 40 (p ~ 1e-6), never a token truncation removed, and the test can tell the
    distribution from the untruncated one at twice the temperature."""
    counts = torch.zeros(len(LOGITS))
    logits = LOGITS.expand(2000, -1)
    for index in range(DRAWS // 2000):
        rows = [(seed, options(temperature, top_k, top_p, seed), index) for seed in range(2000)]
        counts += torch.bincount(torch.tensor(sample_rows(logits, rows)), minlength=len(LOGITS))
    want = oracle_probs(LOGITS, temperature, top_k, top_p)
    assert counts[want == 0].sum() == 0
    assert chi_square(counts, want) < 40
    torch.testing.assert_close(sampling_probs(LOGITS, options(temperature, top_k, top_p)).double(), want,
                               atol=1e-6, rtol=1e-5)
    assert chi_square(counts, oracle_probs(LOGITS, 2 * temperature, 0, 1.0)) > 100


def test_speculative_acceptance_keeps_the_targets_top_p_distribution():
    """Rejection sampling needs the normalised p: with top-p, the emitted token's frequencies match the
    target's renormalised nucleus whatever the draft proposes."""
    target_logits = torch.stack([LOGITS, torch.zeros(len(LOGITS))])
    draft_logits = LOGITS.flip(0)
    trials = 4000
    counts = torch.zeros(len(LOGITS))
    for seed in range(trials):
        opts = options(1.0, top_p=0.7, seed=seed)
        draft, q = draft_token(draft_logits, opts, 3)
        counts[accept_drafts(target_logits, [draft], [q], opts, 3)[0]] += 1
    p = oracle_probs(LOGITS, 1.0, 0, 0.7).float()
    assert 0.5 * float((counts / trials - p).abs().sum()) < 0.03
    assert 0.5 * float((counts / trials - torch.softmax(LOGITS, 0)).abs().sum()) > 0.1


@pytest.mark.gpu
def test_cuda_draws_equal_cpu_draws():
    """The hash is integer arithmetic (identical bits on CUDA) and the keys are float64, so a CUDA device
    draws the CPU's tokens from the same logits."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    keys = torch.tensor([0, 1, MOD - 1, token_seed(12345, 678)])
    assert noise_bits(keys.cuda(), 163_840).cpu().equal(noise_bits(keys, 163_840))
    logits = torch.randn(64, 163_840, generator=torch.Generator().manual_seed(0)) * 4
    rows = [(row, options((0.0, 0.7, 1.0, 1.3)[row % 4], (0, 0, 50, 7)[row % 4], (1.0, 0.9, 1.0, 0.5)[row % 4],
                          seed=row), row * 3) for row in range(64)]
    assert sample_rows(logits.cuda(), rows) == sample_rows(logits, rows)
