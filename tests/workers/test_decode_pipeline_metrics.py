"""How the engine's decode steps ran and why they fell back (`PipelineMetrics`: k3_<role>_steps_total{mode},
k3_<role>_pipeline_fallbacks_total{stage, reason}), on scripted engines whose answer is known by hand.

Oracle: the schedule of each script, worked out step by step from the engine's rules (docs/serving.md,
"Look-ahead"): a request's prompt is one plain prefill step, its first decode step is plain too (it follows
a prefill), then the decode steps run ahead until something the look-ahead cannot plan around comes up."""

from __future__ import annotations

import pytest

from services.engine.metrics import Fallback, counts_since
from tests.workers.overlap_harness import ScriptedEngine, harness_model, options, prompt


@pytest.fixture(scope="module")
def nano():
    return harness_model()


def pipeline_counts(model, script: dict, lookahead: bool = True) -> dict[str, dict[str, int]]:
    """The counters' differences over `script` (the harness's engines share one metrics set)."""
    engine = ScriptedEngine(model, True, lookahead=lookahead)
    pipeline = engine.engine.metrics.pipeline
    before = pipeline.counts()
    engine.run(script)
    return counts_since(before, pipeline.counts())


def test_a_steady_batch_runs_ahead_every_step_after_its_first_decode_step(nano):
    greedy = options(nano.config.vocab_size, max_tokens=6, ignore_eos=True)
    counts = pipeline_counts(nano, {0: [("add", "a", prompt(0, 5), greedy), ("add", "b", prompt(1, 7), greedy)]})
    # prefill (token 1), the first decode step (token 2; plain: it follows a prefill), tokens 3-6 ahead
    assert counts == {"steps": {"plain": 2, "lookahead": 4}, "lookahead": {}, "overlap": {Fallback.PREFILL: 1}}


@pytest.mark.parametrize("lookahead", [True, False])
def test_an_admission_makes_the_step_plain(nano, lookahead):
    vocab = nano.config.vocab_size
    script = {0: [("add", "a", prompt(0, 5), options(vocab, max_tokens=8, ignore_eos=True))],
              3: [("add", "b", prompt(1, 7), options(vocab, max_tokens=4, ignore_eos=True))]}
    mode = "lookahead" if lookahead else "overlap"
    # a: prefill, decode (plain), 1 pipelined step; b arrives: its prefill joins a's decode (plain: admission),
    # then one plain decode step (after a prefill), then 3 pipelined (b's last token at a's 7th), a's last alone
    assert pipeline_counts(nano, script, lookahead) == {
        "steps": {"plain": 4, mode: 4}, "lookahead": {},
        "overlap": {Fallback.ADMISSION: 1, Fallback.PREFILL: 2}}


def test_a_row_crossing_a_block_runs_in_the_overlap_not_ahead(nano):
    greedy = options(nano.config.vocab_size, max_tokens=8, ignore_eos=True)
    # the 76-token prompt in two chunks (64 tokens a step: the second after a prefill, plain), the first decode
    # step plain; 80 tokens a block: the prompt and tokens 1-4 fill it, the step whose input (token 5) starts
    # the next block runs in the overlap, the other 5 decode steps ahead
    counts = pipeline_counts(nano, {0: [("add", "a", prompt(0, 76), greedy)]})
    assert counts == {"steps": {"plain": 3, "lookahead": 5, "overlap": 1},
                      "lookahead": {Fallback.BLOCK_CROSSING: 1}, "overlap": {Fallback.PREFILL: 2}}


def test_stop_strings_logprobs_and_too_many_stop_ids_each_name_their_stage(nano):
    vocab = nano.config.vocab_size
    for asked, expected in [({"stop": ["zz"]}, ("lookahead", Fallback.STOP_STRINGS)),
                            ({"stop_token_ids": [1, 2, 3, 4, 5]}, ("lookahead", Fallback.STOP_IDS)),
                            ({"logprobs": True}, ("overlap", Fallback.LOGPROBS))]:
        o = options(vocab, max_tokens=8, ignore_eos=True, **asked)
        counts = pipeline_counts(nano, {0: [("add", "a", prompt(0, 5), o)]})
        stage, reason = expected
        if stage == "lookahead":  # every decode step after the first runs in the overlap
            want = {"steps": {"plain": 2, "overlap": 6}, "lookahead": {reason: 6}, "overlap": {Fallback.PREFILL: 1}}
        else:  # every decode step is plain
            want = {"steps": {"plain": 8}, "lookahead": {}, "overlap": {Fallback.PREFILL: 1, reason: 6}}
        assert counts == want, asked


def test_a_cancel_settles_the_step_in_flight_and_the_next_runs_plain(nano):
    greedy = options(nano.config.vocab_size, max_tokens=8, ignore_eos=True)
    script = {0: [("add", "a", prompt(0, 5), greedy), ("add", "b", prompt(1, 5), greedy)], 3: [("cancel", "b")]}
    assert pipeline_counts(nano, script) == {"steps": {"plain": 3, "lookahead": 5}, "lookahead": {},
                                             "overlap": {Fallback.PREFILL: 1, Fallback.CANCEL: 1}}


@pytest.mark.parametrize("settle", [True, False])
def test_a_call_between_steps_runs_the_next_plain_only_when_it_settles(nano, settle):
    greedy = options(nano.config.vocab_size, max_tokens=8, ignore_eos=True)
    script = {0: [("add", "a", prompt(0, 5), greedy), ("add", "b", prompt(1, 5), greedy)],
              3: [("call", lambda engine: None, settle)]}
    # 8 tokens: the prefill and the first decode step plain, 6 decode steps ahead, one of which plain after a settle
    want = {"steps": {"plain": 3, "lookahead": 5}, "lookahead": {},
            "overlap": {Fallback.PREFILL: 1, Fallback.CALL: 1}} if settle else \
        {"steps": {"plain": 2, "lookahead": 6}, "lookahead": {}, "overlap": {Fallback.PREFILL: 1}}
    assert pipeline_counts(nano, script) == want
