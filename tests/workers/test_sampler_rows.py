"""Batched sampling (`sampler.sample_rows`) gives exactly the row-by-row tokens of `sample_next`."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.engine import sampler
from services.engine.params import GenerationOptions

VOCAB = 13


def _options(temperature: float, top_k: int, top_p: float, seed: int) -> GenerationOptions:
    return GenerationOptions(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, max_tokens=8,
                             stop=(), stop_token_ids=frozenset(), ignore_eos=True)


ROW_OPTIONS = st.builds(_options, st.sampled_from([0.0, 0.0, 0.7, 1.3]), st.sampled_from([0, 3, VOCAB + 2]),
                        st.sampled_from([1.0, 0.8, 0.3]), st.integers(0, 2**31))


@settings(max_examples=60, deadline=None)
@given(data=st.data(), batch=st.integers(1, 6))
def test_sample_rows_equals_sample_next_row_by_row(data, batch):
    # Small integer logits: ties are common, and the first maximal index must win in both forms.
    logits = torch.tensor(data.draw(st.lists(st.lists(st.integers(-3, 3), min_size=VOCAB, max_size=VOCAB),
                                             min_size=batch, max_size=batch)), dtype=torch.float32)
    picked = data.draw(st.lists(st.integers(0, batch - 1), min_size=1, max_size=batch))  # any rows, any order
    rows = [(row, data.draw(ROW_OPTIONS), data.draw(st.integers(0, 50))) for row in picked]
    want = [sampler.sample_next(logits[row], options, index) for row, options, index in rows]
    assert sampler.sample_rows(logits, rows) == want


def test_greedy_rows_take_one_batched_argmax(monkeypatch):
    """All-greedy batches never reach the per-row path (which syncs once per row on a GPU)."""
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    def per_row(*args):
        raise AssertionError("a greedy row went through sample_next")

    monkeypatch.setattr(sampler, "sample_next", per_row)
    greedy = _options(0.0, 0, 1.0, 1)
    want = logits.argmax(-1)[[2, 0, 3]].tolist()
    assert sampler.sample_rows(logits, [(r, greedy, 0) for r in (2, 0, 3)]) == want
