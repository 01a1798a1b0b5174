"""Partial-rollout bookkeeping and the auto-throttle, as properties over random runs."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from services.trainer.rollouts import PartialRolloutScheduler
from services.trainer.throttle import AutoThrottle, EngineSignals


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.floats(0.1, 1.0), st.integers(0, 10_000))
def test_partial_rollouts_finish_everything_in_complete_groups(prompts, k, lam, seed):
    rng = random.Random(seed)
    sched = PartialRolloutScheduler(k, lam)
    remaining = {}  # trajectory key -> generation steps still needed
    groups, iteration, new = [], 0, [f"p{i}" for i in range(prompts)]
    while True:
        batch = sched.start_iteration(new if iteration == 0 else [])
        if not batch:
            break
        paused_before = [t.key for t in batch if t.key in remaining]
        assert [t.key for t in batch[: len(paused_before)]] == paused_before  # resumed first
        for t in batch:
            remaining.setdefault(t.key, rng.randint(1, 5))
        while not sched.should_pause():
            key = min(sched.active, key=lambda key: remaining[key])
            sched.record_tokens(key, [1] * remaining[key], [0.0] * remaining[key], version=iteration)
            group = sched.finish(key, reward=rng.random())
            if group:
                assert len(group) == k and len({t.prompt_id for t in group}) == 1
                groups.append(group)
        assert sched.iteration_done >= lam * sched.iteration_total
        for t in sched.pause_rest():
            remaining[t.key] = max(1, remaining[t.key] - 1)
        iteration += 1
        assert iteration < 100
    assert sorted(g[0].prompt_id for g in groups) == sorted(f"p{i}" for i in range(prompts))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 512), st.integers(0, 512), st.floats(0, 1)), max_size=50))
def test_throttle_stays_in_bounds(signals):
    throttle = AutoThrottle(min_concurrency=4, max_concurrency=256, concurrency=64)
    for running, waiting, usage in signals:
        value = throttle.update(EngineSignals(running, waiting, usage))
        assert 4 <= value <= 256


def test_throttle_backs_off_under_pressure_and_recovers():
    throttle = AutoThrottle(min_concurrency=2, max_concurrency=128, concurrency=64)
    for _ in range(20):
        throttle.update(EngineSignals(running=64, waiting=0, kv_usage=0.97))
    assert throttle.concurrency == 2
    for _ in range(40):
        throttle.update(EngineSignals(running=2, waiting=0, kv_usage=0.1))
    assert throttle.concurrency == 128
