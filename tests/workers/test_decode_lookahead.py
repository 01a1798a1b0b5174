"""The decode look-ahead (services/engine/decode_lookahead.py) against the plain engine loop.

Oracle: the same engine with the overlap off, on the same script (`compare_with_plain`: streams, the KDA
state bytes, forwards and page ids of each request when it leaves, the pool / prefix index / checkpoints at
the end). The look-ahead launches a step before the previous step's tokens are on the host, its tokens
read on the device; a row whose token stops its request runs on the scratch pages: the state test fails if
that row's forward touched its own state (the request would have been advanced by an extra step).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3.v1 import common_pb2
from services.engine.config import WorkerConfig
from services.engine.decode_fastpath import ENV as FASTPATH_ENV
from services.engine.decode_fastpath import LOOKAHEAD_ENV, OVERLAP_ENV, lookahead_wanted
from services.engine.decode_inputs import STOP_WIDTH, DecodeInputBuilder, DecodeInputs
from services.engine.decode_lookahead import stop_table
from tests.workers.overlap_harness import (
    STOP,
    ScriptedEngine,
    batch_noise_floor,
    compare_with_plain,
    harness_model,
    interleaving,
    options,
    prompt,
    scripted_requests,
)

# The look-ahead's states against the measured noise floor (overlap_harness.batch_noise_floor). Measured on this
# test's script: the largest look-ahead difference was 1.06x the floor on the CPU (1.26e-5 / 1.19e-5) and 1.11x
# on the H200 (1.79e-4 / 1.61e-4; the plain engine run twice there: bit-equal); one step moves a state by 1.1-3.1.
NOISE_MARGIN = 4


@pytest.fixture(scope="module")
def nano():
    return harness_model()


def test_resolve_on_device_reads_the_draw_and_parks_stopped_rows_on_scratch():
    # hand-computed: 3 rows of 4; row 0 from draw row 2, row 1 from draw row 0 (hits its stop id 7), row 2 the
    # image's own token; the padding row keeps its token.
    layout = type("Layout", (), dict(num_kda_groups=2, num_mla_groups=1, tokens_per_block=4, layers_per_group=2))()
    builder = DecodeInputBuilder(layout, 3, scratch_kda=90, scratch_mla=91, lookahead=True)
    image = builder.prepare([], 4)
    builder.token_slots(image, 4)[:] = [0, 0, 33, 0]
    parts = builder._host_parts(image, 4)
    parts[1][:] = [[1, 2, 3, 90], [4, 5, 6, 90]]
    parts[4][:] = [[10, 11, 12, builder.scratch_base]]
    source, stops = builder.ahead_parts(image, 4)
    source[:3] = [2, 0, -1]
    stops[:, :3] = np.array([[5, 7, 33]] + [[-1] * 3] * (STOP_WIDTH - 1))
    inp = builder.view(torch.from_numpy(image.copy()), 4)
    got = inp.resolve_on_device(torch.tensor([7, 8, 9, 10]), 90, builder.scratch_base)
    assert got.tokens.tolist() == [9, 7, 33, 0]  # row 2's 33 is its stop id, but not a drawn token: it runs
    assert got.kda_slots.tolist() == [[1, 90, 3, 90], [4, 90, 6, 90]]
    assert got.row_base.tolist() == [[10, builder.scratch_base, 12, builder.scratch_base]]
    assert inp.tokens.tolist() == [0, 0, 33, 0]  # the image itself is not written


def test_stop_table_holds_each_rows_ids_and_eos_or_refuses():
    class Req:
        def __init__(self, ids, ignore_eos=False):
            self.options = type("Options", (), dict(stop_token_ids=frozenset(ids), ignore_eos=ignore_eos))()
    table, fits = stop_table([Req([5]), Req([], ignore_eos=True), Req([3, 1, 2]), Req([4, 1, 2, 3]), Req([])], eos=9)
    assert table.T.tolist() == [[5, 9, -1, -1], [-1] * 4, [1, 2, 3, 9], [-1] * 4, [9, -1, -1, -1]]
    assert fits.tolist() == [True, True, True, False, True]  # five ids with the EOS: not run ahead
    table, fits = stop_table([Req([1, 2, 3, 4])], eos=None)
    assert table.T.tolist() == [[1, 2, 3, 4]] and fits.all()


def test_the_look_ahead_is_on_by_default_at_tp_1(nano, monkeypatch):
    monkeypatch.delenv(LOOKAHEAD_ENV, raising=False)
    assert lookahead_wanted(sharded=False) and not lookahead_wanted(sharded=True)  # TP > 1: the overlap is off
    scripted = ScriptedEngine(nano, True, lookahead=None)  # the fast path reads the setting
    assert scripted.engine.executor.fastpath.lookahead and scripted.engine.overlap.lookahead is not None
    monkeypatch.setenv(LOOKAHEAD_ENV, "0")
    assert not lookahead_wanted(sharded=False)
    assert ScriptedEngine(nano, True, lookahead=None).engine.overlap.lookahead is None


def test_the_look_ahead_is_off_where_the_overlap_cannot_run_it(monkeypatch):
    # Its images' source/stops parts and the forward's prologue would be paid for nothing: with the overlap off,
    # and on a decode worker with a draft model (the overlap is off there).
    from services.engine.worker import build_executor  # the worker's own construction of its executor

    monkeypatch.delenv(LOOKAHEAD_ENV, raising=False)
    monkeypatch.setenv(OVERLAP_ENV, "0")
    assert not lookahead_wanted(sharded=False)
    monkeypatch.delenv(OVERLAP_ENV)
    assert lookahead_wanted(sharded=False) and not lookahead_wanted(sharded=False, speculative=True)
    monkeypatch.setenv(FASTPATH_ENV, "1")  # the decode fast path on the CPU
    for draft, role, want in (("", "decode", True), ("nano", "decode", False), ("nano", "prefill", True)):
        config = WorkerConfig.load(role, ["--model", "nano", "--num-pages", "64", "--draft-model", draft], env={})
        fast = build_executor(config, role, 0, common_pb2.InstanceId(), None).fastpath
        assert fast.lookahead is want and fast.builder.lookahead is want, (draft, role)


def _stops_mid_batch(nano, **engine_args) -> None:
    vocab = nano.config.vocab_size
    probe = ScriptedEngine(nano, False, **engine_args).run({0: [
        ("add", f"r{i}", prompt(i, n), options(vocab, max_tokens=12, ignore_eos=True))
        for i, n in enumerate((5, 44, 17, 30))]})
    r0, r1 = probe["r0"].tokens, probe["r1"].tokens
    requests = [
        ("r0", 5, options(vocab, max_tokens=12, stop_token_ids=[r0[3]], ignore_eos=True)),
        ("r1", 44, options(vocab, max_tokens=12, stop_token_ids=[r1[6], 1, 2], ignore_eos=True)),  # 48: a checkpoint
        ("r2", 17, options(vocab, max_tokens=12)),  # the model's EOS stops it where it comes
        ("r3", 30, options(vocab, max_tokens=9, ignore_eos=True)),
        ("r4", 9, options(vocab, temperature=0.9, seed=4, max_tokens=11, ignore_eos=True)),
    ]
    script = {0: [("add", rid, prompt(i, n), o) for i, (rid, n, o) in enumerate(requests)]}
    # The states may differ from the plain engine's by what other batches do to them on this device, measured
    # here (a few ulps on the CPU); an extra step of a request moves its state by ~1 (1.1-3.1 a step here).
    tolerance = NOISE_MARGIN * batch_noise_floor(nano, script, **engine_args)
    assert tolerance < 1e-2
    _, ahead = compare_with_plain(nano, script, lookahead=True, state_atol=tolerance, **engine_args)
    assert ahead.ahead >= 5  # the look-ahead did run the decode steps
    got = ahead.streams
    assert got["r0"].reason == got["r1"].reason == STOP and got["r0"].tokens[-1] == r0[3]
    assert len({len(s.tokens) for s in got.values()}) >= 3


def test_stops_by_id_eos_and_max_tokens_mid_batch(nano, monkeypatch):
    parked = _parked_rows(monkeypatch)
    _stops_mid_batch(nano)
    assert sum(parked) == 2  # r0's and r1's stop ids came in look-ahead steps: their next forwards ran on scratch


@pytest.mark.gpu
def test_stops_mid_batch_on_the_gpu_in_cuda_graphs(nano):
    """The same on CUDA: the fast path in its graphs, the prologue captured, the draw published on the device."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _stops_mid_batch(nano, device="cuda")


def _parked_rows(monkeypatch) -> list[int]:
    """Per look-ahead forward on the CPU (the prologue's torch form): how many request rows it ran on the
    scratch pages (their drawn token stopped them)."""
    parked: list[int] = []
    resolve = DecodeInputs.resolve_on_device

    def counting(self: DecodeInputs, drawn: torch.Tensor, kda: int, base: int) -> DecodeInputs:
        got = resolve(self, drawn, kda, base)
        parked.append(int(((got.kda_slots[0] == kda) & (self.kda_slots[0] != kda)).sum()))
        return got
    monkeypatch.setattr(DecodeInputs, "resolve_on_device", counting)
    return parked


@pytest.mark.parametrize("by", ["eos", "stop id"])
def test_a_follow_up_turn_after_a_stop_reuses_the_same_state(nano, by, monkeypatch):
    # The first turn ends on its EOS (a token the probe shows it draws, made the engines' EOS) or a stop id in
    # a look-ahead step (its next forward ran on scratch); the second turn (prompt + reply + more) hits the
    # prefix cache's turn checkpoint and must give the plain tokens.
    vocab = nano.config.vocab_size
    first = prompt(3, 29)
    probe = ScriptedEngine(nano, False).run({0: [("add", "t", first, options(vocab, max_tokens=10,
                                                                            ignore_eos=True))]})
    stop = probe["t"].tokens[5]
    turn = options(vocab, max_tokens=10, stop_token_ids=[stop] if by == "stop id" else [])
    other = options(vocab, max_tokens=14, ignore_eos=True)
    reply = probe["t"].tokens[: probe["t"].tokens.index(stop) + 1]
    script = {0: [("add", "t", first, turn), ("add", "o", prompt(4, 12), other)],
              12: [("add", "t2", first + reply + [9, 8, 7], options(vocab, max_tokens=8, ignore_eos=True)),
                   ("add", "o2", prompt(5, 6), other)]}

    def eos(scripted: ScriptedEngine) -> None:
        if by == "eos":
            scripted.engine.output.eos_token_id = stop
    parked = _parked_rows(monkeypatch)
    plain, ahead = compare_with_plain(nano, script, watch=eos, lookahead=True)
    assert ahead.ahead > 0 and ahead.streams["t"].tokens == reply and ahead.streams["t"].reason == STOP
    assert sum(parked) == 1  # t's stop came in a look-ahead step: its next forward ran on scratch
    assert ahead.requests["t2"].cached_tokens == plain.requests["t2"].cached_tokens > 0


def test_cancellation_arrivals_and_block_crossings(nano):
    vocab = nano.config.vocab_size
    greedy = options(vocab, max_tokens=12, ignore_eos=True)
    in_flight: list[bool] = []  # at the cancel, per engine: is a look-ahead step in flight (its draw's rows)?

    def look(engine) -> None:
        in_flight.append(engine.overlap.inflight is not None and engine.overlap.inflight.rows is not None)
    script = {0: [("add", "a", prompt(0, 76), greedy), ("add", "b", prompt(1, 20), greedy),
                  ("add", "x", prompt(6, 78), options(vocab, max_tokens=4, ignore_eos=True))],
              2: [("add", "c", prompt(2, 3), options(vocab, temperature=0.7, seed=9, max_tokens=8))],
              6: [("call", look, False), ("cancel", "b")], 7: [("add", "d", prompt(3, 12), greedy)]}
    _, ahead = compare_with_plain(nano, script, lookahead=True, budget=512)
    assert ahead.ahead > 0
    assert in_flight == [False, True]  # the plain engine's, then the look-ahead's: b cancelled mid look-ahead


# derandomized: the look-ahead's batches differ from the plain ones (rows that stopped), so values may differ
# by ulps (overlap_harness.LOOKAHEAD_STATE_ATOL); fixed examples keep a near-tie from making the test flaky
@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# up to 5 stop ids: a row with more than STOP_WIDTH (with its EOS) is not run ahead
@given(requests=st.lists(scripted_requests(max_stop_ids=5), min_size=2, max_size=4), pages=st.sampled_from([16, 160]))
def test_interleavings_give_the_plain_streams(nano, requests, pages):
    compare_with_plain(nano, interleaving(nano.config.vocab_size, requests), lookahead=True, num_pages=pages)


def test_the_state_check_fails_when_a_stopped_row_runs_on_its_own_state(nano, monkeypatch):
    # The oracle can fail: with the stopped rows not parked on scratch, the look-ahead's extra forward of a
    # request that stopped moves its KDA state far past the harness's tolerance.
    resolve = DecodeInputs.resolve_on_device

    def unmasked(self: DecodeInputs, drawn: torch.Tensor, kda: int, base: int) -> DecodeInputs:
        return replace(resolve(self, drawn, kda, base), kda_slots=self.kda_slots, row_base=self.row_base)
    monkeypatch.setattr(DecodeInputs, "resolve_on_device", unmasked)
    vocab = nano.config.vocab_size
    probe = ScriptedEngine(nano, False).run({0: [("add", "s", prompt(0, 9), options(vocab, max_tokens=8,
                                                                                   ignore_eos=True))]})
    stop = probe["s"].tokens[4]
    script = {0: [("add", "s", prompt(0, 9), options(vocab, max_tokens=8, stop_token_ids=[stop], ignore_eos=True)),
                  ("add", "o", prompt(1, 7), options(vocab, max_tokens=12, ignore_eos=True))]}
    with pytest.raises(AssertionError, match="s: KDA state differs"):
        compare_with_plain(nano, script, lookahead=True)
    monkeypatch.undo()
    _, ahead = compare_with_plain(nano, script, lookahead=True)
    assert ahead.ahead > 0


def test_a_stop_the_devices_table_misses_is_an_error_not_a_divergence(nano, monkeypatch):
    # The host's finish must be the stop table's (the device's check): with the table emptied, the device runs
    # the stopping row's next forward on the request's own state while the host ends it, and the step raises.
    from services.engine import decode_lookahead
    monkeypatch.setattr(decode_lookahead, "stop_table", lambda requests, eos: (np.full((STOP_WIDTH, len(requests)), -1),
                                                                              np.ones(len(requests), dtype=bool)))
    vocab = nano.config.vocab_size
    probe = ScriptedEngine(nano, False).run({0: [("add", "s", prompt(0, 9), options(vocab, max_tokens=8,
                                                                                   ignore_eos=True))]})
    script = {0: [("add", "s", prompt(0, 9), options(vocab, max_tokens=8, stop_token_ids=[probe["s"].tokens[4]],
                                                     ignore_eos=True)),
                  ("add", "o", prompt(1, 7), options(vocab, max_tokens=12, ignore_eos=True))]}
    with pytest.raises(RuntimeError, match="'s': the device's stop check disagrees"):
        ScriptedEngine(nano, True, lookahead=True).run(script)
