"""The decode overlap (services/engine/decode_overlap.py) against the plain engine loop.

Oracle: the same engine with the overlap off, run on the same script of arrivals and cancellations (real
scheduler, cache manager, decode fast path on CPU, byte tokenizer). With the overlap on, every request's
stream (tokens, text, finish reason) is the plain one, a cancelled one's too (a cancellation takes the
step in flight's token first, as the plain loop has it); when a request leaves the cache manager its KDA
state pages hold the bytes they hold in the plain loop, its forwards and page ids are the plain ones (so a
request that stopped was never advanced by an extra step), and the pool, prefix index and checkpoints end
as the plain loop leaves them.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3.v1 import common_pb2
from services.engine.streams import token_chunk
from tests.workers.overlap_harness import (
    STOP,
    ScriptedEngine,
    compare_with_plain,
    harness_model,
    interleaving,
    options,
    prompt,
    scripted_requests,
)


@pytest.fixture(scope="module")
def nano():
    return harness_model()


def test_stops_mid_batch_leave_the_streams_and_states_of_the_plain_loop(nano):
    vocab = nano.config.vocab_size
    # A plain greedy run tells which tokens come when; then stop ids, a stop string and max_tokens are set to
    # end the requests at different steps of one batch, one of them past a hash boundary (44 + 4 = 48: a KDA
    # checkpoint taken in an overlapped step).
    probe = ScriptedEngine(nano, False).run({0: [("add", f"r{i}", prompt(i, n), options(vocab, max_tokens=12,
                                                                                       ignore_eos=True))
                                                 for i, n in enumerate((5, 44, 17, 30))]})
    stream = {rid: s for rid, s in probe.items()}
    r0, r1 = stream["r0"].tokens, stream["r1"].tokens
    text2 = stream["r2"].text
    requests = [
        ("r0", 5, options(vocab, max_tokens=12, stop_token_ids=[r0[3]], ignore_eos=True)),
        ("r1", 44, options(vocab, max_tokens=12, stop_token_ids=[r1[6]], ignore_eos=True)),
        ("r2", 17, options(vocab, max_tokens=12, stop=[text2[5:7]] if len(text2) > 7 else [], ignore_eos=True)),
        ("r3", 30, options(vocab, max_tokens=9, ignore_eos=True)),
        ("r4", 9, options(vocab, temperature=0.9, seed=4, max_tokens=11, ignore_eos=True)),
    ]
    script = {0: [("add", rid, prompt(i, n), o) for i, (rid, n, o) in enumerate(requests)]}
    plain, overlap = compare_with_plain(nano, script)
    assert overlap.overlapped >= 5  # the overlap did run the decode steps
    got = overlap.streams
    assert got["r0"].reason == got["r1"].reason == STOP
    assert got["r0"].tokens[-1] == r0[3] and len(got["r0"].tokens) <= 4
    assert len({len(s.tokens) for s in got.values()}) >= 3  # they left at different steps
    for rid, n, _ in requests:  # computed: the prompt and every token but the last
        assert overlap.computed[rid] == n + len(got[rid].tokens) - 1, rid


def test_cancellation_and_arrivals_mid_stream(nano):
    vocab = nano.config.vocab_size
    greedy = options(vocab, max_tokens=10, ignore_eos=True)
    script = {0: [("add", "a", prompt(0, 6), greedy), ("add", "b", prompt(1, 20), greedy)],
              2: [("add", "c", prompt(2, 3), options(vocab, temperature=0.7, seed=9, max_tokens=8))],
              4: [("cancel", "b")], 5: [("add", "d", prompt(3, 12), greedy)], 6: [("add", "e", [3], greedy)]}
    _, overlap = compare_with_plain(nano, script)
    assert overlap.overlapped > 0


def test_calls_between_steps_settle_the_step_in_flight_unless_told_not_to(nano):
    vocab = nano.config.vocab_size
    seen: list[tuple[bool, bool, bool]] = []  # (overlap engine, settle, a step in flight when it ran)

    def probe(settle: bool):
        return ("call", lambda engine: seen.append((engine.overlap.enabled, settle,
                                                    engine.overlap.inflight is not None)), settle)
    script = {0: [("add", f"c{i}", prompt(i, 8 + i), options(vocab, max_tokens=12, ignore_eos=True))
                  for i in range(3)], 4: [probe(False)], 6: [probe(True)], 8: [probe(False)]}
    compare_with_plain(nano, script)
    assert sorted(seen) == [(False, False, False), (False, False, False), (False, True, False),
                            (True, False, True), (True, False, True), (True, True, False)]


def test_preemption_under_a_full_pool(nano):
    vocab = nano.config.vocab_size
    # 12 usable pages: four requests of 2 KDA pages + 1 MLA page (80 tokens) each; crossing 80 tokens needs one more.
    script = {0: [("add", f"p{i}", prompt(i, 70 + 2 * i), options(vocab, temperature=0.5 * (i % 2), seed=i,
                                                                       max_tokens=14, ignore_eos=True))
                  for i in range(4)]}
    _, overlap = compare_with_plain(nano, script, num_pages=14)
    assert overlap.engine.scheduler.preemptions > 0
    assert overlap.overlapped > 0


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(requests=st.lists(scripted_requests(max_stop_ids=3), min_size=2, max_size=4), pages=st.sampled_from([16, 160]))
def test_interleavings_give_the_plain_streams(nano, requests, pages):
    compare_with_plain(nano, interleaving(nano.config.vocab_size, requests), num_pages=pages)


def test_rows_crossing_a_block_while_an_earlier_row_stops(nano):
    # Prompts of 76 tokens need their second 80-token block at their 5th token (position 80): r1 and r3 take
    # it in the same overlapped step in which r0 (ahead of them) stops, so their rows move up before the new
    # block is written into them, and the two blocks are allocated in the plain loop's order (page ids).
    vocab = nano.config.vocab_size
    greedy = options(vocab, max_tokens=12, ignore_eos=True)
    requests = [("r0", 76, options(vocab, max_tokens=5, ignore_eos=True)), ("r2", 60, greedy), ("r1", 76, greedy),
                ("r3", 76, options(vocab, temperature=0.8, seed=3, max_tokens=12, ignore_eos=True))]
    script = {0: [("add", rid, prompt(i, n), o) for i, (rid, n, o) in enumerate(requests)]}
    _, overlap = compare_with_plain(nano, script, budget=512)
    assert overlap.overlapped >= 8
    assert [len(blocks) for blocks, _ in (overlap.pages[r] for r in ("r0", "r1", "r3"))] == [1, 2, 2]


def test_only_the_first_chunk_carries_the_ttft_however_late_it_is_converted(nano):
    # The stream converts an output on its own thread, after the engine (one step ahead with the overlap)
    # may have accepted more tokens: here every chunk is converted once the requests are done.
    vocab = nano.config.vocab_size
    script = {0: [("add", "t0", prompt(0, 7), options(vocab, max_tokens=6, ignore_eos=True))],
              2: [("add", "t1", prompt(1, 20), options(vocab, max_tokens=5, ignore_eos=True))]}
    _, overlap = compare_with_plain(nano, script)
    for rid, stream in overlap.streams.items():
        req = overlap.requests[rid]
        chunks = [token_chunk(req, out) for out in stream.outputs]
        assert len(chunks) == len(req.output) > 1
        assert chunks[0].ttft_ms == pytest.approx(1e3 * (req.first_token_at - req.arrival))
        assert chunks[0].ttft_ms > 0 and all(c.ttft_ms == 0 for c in chunks[1:]), rid


def test_a_cancel_while_the_last_token_is_in_flight_keeps_that_token_and_the_turn(nano):
    # b's 7th token (its max_tokens) is drawn by step 7; the cancel arrives before step 8, when the overlap
    # still holds that token in flight: it is accepted first and ends the request as the plain loop does
    vocab = nano.config.vocab_size
    script = {0: [("add", "a", [5], options(vocab, max_tokens=1)),
                  ("add", "b", prompt(1, 26), options(vocab, max_tokens=7, ignore_eos=True))],
              8: [("cancel", "b")]}
    _, overlap = compare_with_plain(nano, script, num_pages=16)
    assert overlap.overlapped > 0
    assert len(overlap.streams["b"].tokens) == 7
    assert overlap.streams["b"].reason == common_pb2.FINISH_REASON_LENGTH


def _log_steps(scripted: ScriptedEngine) -> None:
    """After every step: (launched by the overlap, pages available, running rids, waiting rids)."""
    scripted.steps = []
    engine, step = scripted.engine, scripted.engine._step

    def logged() -> None:
        before = scripted.overlapped
        step()
        scheduler = engine.scheduler
        scripted.steps.append((scripted.overlapped - before, scripted.manager.pool.num_available,
                               {r.rid for r in scheduler.running}, {r.rid for r in scheduler.waiting}))
    engine._step = logged


def test_a_request_the_pool_cannot_admit_yet_keeps_the_steps_overlapped(nano):
    # 12 usable pages: four running requests (2 KDA pages + 1 MLA page each) take them all; "w" arrives at
    # step 1 and must wait (the scheduler's "wait": no room for its state and first block) until r0 has ended
    # and its pages are cached. Meanwhile every decode step stays overlapped, and w joins at the plain step.
    vocab = nano.config.vocab_size
    script = {0: [("add", f"r{i}", prompt(i, 10 + i), options(vocab, max_tokens=6 + 3 * i, ignore_eos=True))
                  for i in range(4)],
              1: [("add", "w", prompt(9, 5), options(vocab, max_tokens=4, ignore_eos=True))]}
    plain, overlap = compare_with_plain(nano, script, watch=_log_steps, num_pages=14)

    def admitted(scripted: ScriptedEngine) -> int:
        return next(n for n, (_, _, running, _) in enumerate(scripted.steps) if "w" in running)
    joined = admitted(plain)
    assert admitted(overlap) == joined >= 5
    waiting = overlap.steps[2:joined]  # step 0 prefills, step 1 (plain) leaves its tokens in flight
    assert all(available == 0 and "w" in queued for _, available, _, queued in waiting)  # the regime meant
    assert [launched for launched, *_ in waiting] == [1] * len(waiting)
