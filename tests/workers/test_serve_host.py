"""The host side of a decode step keeps its semantics where it was made cheaper: the scheduler's token
slices, sampling from the graph's bf16 logits (no float32 copy), the tokens/s window as a running sum,
and the host benchmark's engine step itself (a stand-in forward; bench/serve_host*.py)."""

from __future__ import annotations

import argparse
import collections
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram

from bench import serve_host, serve_host_costs, serve_host_standins
from services.engine import metrics as metrics_module
from services.engine.metrics import LATENCY_BUCKETS, BatchedObservations, EngineMetrics
from services.engine.params import GenerationOptions
from services.engine.request import EngineRequest
from services.engine.sampler import sample_rows, token_logprobs
from services.engine.scheduler import _token_slice


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 9), max_size=6), st.lists(st.integers(0, 9), max_size=6), st.data())
def test_token_slice_is_a_slice_of_prompt_plus_output(prompt, output, data):
    req = EngineRequest("r", prompt, None, lambda out: None, output=output)  # type: ignore[arg-type]
    start = data.draw(st.integers(0, len(prompt) + len(output) + 1))
    end = data.draw(st.integers(start, len(prompt) + len(output) + 2))
    assert _token_slice(req, start, end) == (prompt + output)[start:end]


def _options(temperature: float, seed: int, top_logprobs: int) -> GenerationOptions:
    return GenerationOptions(temperature=temperature, top_k=5 if temperature else 0, top_p=0.9, seed=seed,
                             max_tokens=8, stop=(), stop_token_ids=frozenset(), ignore_eos=True, logprobs=True,
                             top_logprobs=top_logprobs)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(4, 40), st.integers(0, 2**31), st.data())
def test_sampling_bf16_logits_equals_sampling_their_float32_copy(batch, vocab, seed, data):
    # coarse values: many exact ties, where argmax must still pick the first maximum in both dtypes
    logits = (torch.randint(-4, 4, (batch, vocab), generator=torch.Generator().manual_seed(seed)) / 2).bfloat16()
    rows = [(row, _options(data.draw(st.sampled_from([0.0, 0.7])), seed + row, data.draw(st.integers(0, 3))),
             data.draw(st.integers(0, 50))) for row in range(batch)]
    tokens = sample_rows(logits, rows)
    assert tokens == sample_rows(logits.float(), rows)
    asked = [(row, options, token) for (row, options, _), token in zip(rows, tokens, strict=True)]
    assert token_logprobs(logits, asked) == token_logprobs(logits.float(), asked)


def test_tokens_per_second_window_equals_the_sum_over_its_last_ten_seconds(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(metrics_module.time, "monotonic", lambda: now[0])
    metrics = EngineMetrics.for_role("test_serve_host")
    seen: collections.deque[tuple[float, int]] = collections.deque()
    for step in range(300):
        now[0] += (step * 7919 % 13) / 10  # 0 .. 1.2 s apart
        count = step % 5 + 1
        metrics.record_tokens(count)
        seen.append((now[0], count))
        window = [(t, c) for t, c in seen if now[0] - t <= 10]
        expected = sum(c for _, c in window) / max(now[0] - window[0][0], 1.0)
        assert metrics.current_tokens_per_second == expected


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.sampled_from([0.0, *LATENCY_BUCKETS, 61.0]),
                          st.floats(0, 100, allow_nan=False)), max_size=50))
def test_batched_observations_equal_one_observe_per_value(values):
    """The oracle is prometheus_client's own `observe`: same cumulative bucket counts (bounds included) and
    count, the same sum up to the order of the float additions."""
    one_by_one = Histogram("one_by_one", "", buckets=LATENCY_BUCKETS, registry=CollectorRegistry())
    batched = Histogram("batched", "", buckets=LATENCY_BUCKETS, registry=CollectorRegistry())
    gathered = BatchedObservations(batched)
    for value in values:
        one_by_one.observe(value)
        gathered.add(value)
    gathered.flush()
    gathered.flush()  # nothing left: changes nothing

    def samples(histogram):
        (metric,) = histogram.collect()
        return {(s.name[len(metric.name):], s.labels.get("le")): s.value for s in metric.samples
                if not s.name.endswith("_created")}
    expected, got = samples(one_by_one), samples(batched)
    assert len(got) == len(LATENCY_BUCKETS) + 3  # the buckets, +Inf, count and sum
    assert {k: v for k, v in got.items() if k[0] != "_sum"} == {k: v for k, v in expected.items() if k[0] != "_sum"}
    assert math.isclose(got[("_sum", None)], expected[("_sum", None)], rel_tol=1e-12, abs_tol=1e-12)


def test_host_bench_runs_the_engine_step_with_its_stand_in_forward():
    args = argparse.Namespace(model="nano", context=40, max_model_len=256, hash_block=16, vocab=16, steps=3,
                              warmup=1, batches=[3], replay_ms=0.0, freeze_heap=False)
    row = serve_host.measure(args, 3)  # asserts every request got one token per step
    # overlapped steps (the default): no schedule call, the next step's image built while one runs
    assert row["batch"] == 3 and row["overlap"] and row["schedule"]["p50_ms"] == 0
    assert all(row[stage]["p50_ms"] > 0 for stage in ("build", "launch", "accept", "step", "idle"))
    assert 0 < row["to_launch"]["p50_ms"] <= row["idle"]["p50_ms"]  # a part of each step's idle
    assert "gpu_idle" not in row


def test_stream_burst_times_both_queues_delivering_every_output():
    result = serve_host_costs.stream_burst_ms(3, bursts=2)  # returns only once every reader got every output
    assert result["readers"] == 3 and result["output_queue_ms"] > 0 and result["asyncio_queue_ms"] > 0


def test_host_bench_runs_through_two_hash_boundary_commits(monkeypatch):
    """The setup's commit (context 32, blocks of 16) and the step reaching 48 take checkpoints; the second
    commit settles the first's fingerprints, which on the meta pool have no bytes to copy out."""
    queued, settled = [], []

    class Counted(serve_host.PendingFingerprints):
        def __init__(self, lanes: torch.Tensor) -> None:
            super().__init__(lanes)
            queued.append(len(lanes))

        def result(self) -> list[int]:
            settled.append(self)
            return super().result()
    monkeypatch.setattr(serve_host, "PendingFingerprints", Counted)
    args = argparse.Namespace(model="nano", context=32, max_model_len=256, hash_block=16, vocab=16, steps=16,
                              warmup=1, batches=[2], replay_ms=0.0, freeze_heap=False)
    row = serve_host.measure(args, 2)  # asserts every request got one token per step
    assert row["batch"] == 2
    assert len(queued) >= 2 and all(queued) and settled  # two commits' checkpoints; the first one settled


def test_emulated_device_clock_counts_the_gap_between_a_replay_end_and_the_next_launch(monkeypatch):
    now = [10.0]
    monkeypatch.setattr(serve_host_standins.time, "perf_counter", lambda: now[0])
    # a sleep of s advances the clock by s; sleep(0) (the wait's spin, GIL released) by a microsecond
    monkeypatch.setattr(serve_host_standins.time, "sleep", lambda s: now.__setitem__(0, now[0] + (s or 1e-6)))
    clock = serve_host_standins.DeviceClock(0.003)
    clock.replayed()  # busy until 10.003
    now[0] += 0.001
    clock.replayed()  # launched while busy: queued, busy until 10.006, no idle
    assert clock.idle == 0 and abs(clock.busy_until - 10.006) < 1e-12
    clock.wait()  # the tokens: the host sleeps, then spins, until the device is done
    assert 10.006 <= now[0] < 10.006 + 1.1e-6 and clock.late == now[0] - 10.006
    resumed = now[0]
    now[0] += 0.0005
    clock.replayed()  # the host's critical path after the tokens: 0.5 ms of device idle (and the spin's overshoot)
    assert abs(clock.idle - (resumed - 10.006 + 0.0005)) < 1e-12


def test_host_bench_with_an_emulated_device_reports_its_idle():
    args = argparse.Namespace(model="nano", context=40, max_model_len=256, hash_block=16, vocab=16, steps=3,
                              warmup=1, batches=[2], replay_ms=1.0, freeze_heap=False)
    row = serve_host.measure(args, 2)
    assert row["replay_ms"] == 1.0 and row["gpu_idle"]["p50_ms"] >= 0
    assert row["step"]["mean_ms"] >= 0.9  # each step waits for the previous replay's tokens


def test_host_bench_fingerprints_compare_the_row_batched_and_per_page_forms():
    result = serve_host_costs.fingerprints_ms(5, 99, reps=1)  # asserts both forms give the same values
    assert result["pages"] == 5 and result["row_batched_ms"] > 0 and result["per_page_ms"] > 0
