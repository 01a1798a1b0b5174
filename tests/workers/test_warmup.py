"""The start-up warm-up in-process (services/engine/warmup.py), on the CPU forms of the paths it warms:
the pool and the prefix cache are left exactly as found, the shapes are the ones the scheduler runs, and a
pool too small for a shape skips it without a trace. The real-process readiness test is
test_warmup_worker.py."""

from __future__ import annotations

import pytest
import torch

from k3.v1 import common_pb2
from k3core.cache.hashing import chain_hashes
from k3core.cache.manager import PrefixCacheManager
from services.engine.config import WorkerConfig
from services.engine.cuda_graphs import DEFAULT_BUCKETS
from services.engine.decode_fastpath import ENV as FASTPATH_ENV
from services.engine.executor import Executor
from services.engine.plan import ForwardItem, StepPlan
from services.engine.warmup import plan_warmup, wanted, warm_up, warmup_tokens
from services.engine.worker import build_executor
from services.runtime.config import ConfigError

HASH_BLOCK = 16


def config(**changes) -> WorkerConfig:
    base = dict(model="nano", hash_block_tokens=HASH_BLOCK, step_token_budget=64, num_pages=64, max_running=4,
                warmup="on")
    return WorkerConfig(**{**base, **changes})


@pytest.fixture
def fast_executor(monkeypatch) -> Executor:
    """A decode rank with the decode fast path in its CPU (eager) form, so the bucket steps run too."""
    monkeypatch.setenv(FASTPATH_ENV, "1")
    executor = build_executor(config(), "decode", 0, common_pb2.InstanceId(), None)
    assert executor.fastpath is not None
    yield executor
    executor.close()


def pool_state(manager: PrefixCacheManager) -> tuple:
    pool = manager.pool
    return pool.num_free, pool.num_cached, list(pool.refcount), dict(manager.requests), \
        len(manager.checkpoints.by_key), manager.step_open


def prefill_for_real(executor: Executor, rid: str, tokens: list[int], chunk: int) -> None:
    """A request's prompt through the manager as the scheduler runs one (admitted with its chain, an
    aligned chunk, then the rest), then finished."""
    manager = executor.manager
    manager.add_request(rid, tokens)
    for start, end in ((0, chunk), (chunk, len(tokens))):
        manager.reserve(rid, end - start)
        executor.execute(StepPlan(forward=[ForwardItem(rid, tokens[start:end], end == len(tokens))]))
    manager.finish(rid)
    manager.commit_step()


def cached(manager: PrefixCacheManager, prompt: list[int]) -> tuple[int, int]:
    """(tokens the KDA + MLA hit restores, tokens the MLA blocks alone match)"""
    hit = manager.lookup(chain_hashes(prompt, HASH_BLOCK), len(prompt))
    return hit.num_tokens, hit.mla_tokens


def test_warmup_leaves_the_pool_and_the_prefix_cache_as_found(fast_executor):
    manager = fast_executor.manager
    before = pool_state(manager)
    report = warm_up(fast_executor, config(), "decode", export=False)
    assert report is not None and not report.skipped
    # the shapes the scheduler runs: a short first chunk, the full-budget aligned chunk, its unaligned tail
    # over the cached prefix and a decode step; the fast path's batch buckets up to max_running; the prefill
    # fast path's row-count classes (services/engine/fast_prefill.WARMUP_ROWS)
    assert report.plan.prefill == ((9,), (64, 9, 1), (2,), (12,))
    assert report.plan.decode_batches == (1, 2, 4)
    assert pool_state(manager) == before
    manager.pool.check_invariants()
    vocab = config().model_config().vocab_size
    prompts = [warmup_tokens(sum(chunks), vocab) for chunks in report.plan.prefill]
    assert [cached(manager, prompt) for prompt in prompts] == [(0, 0)] * 4
    # control: the same tokens prefilled as a request are found, so the lookup above could have failed
    prefill_for_real(fast_executor, "real", prompts[1], 64)
    assert cached(manager, prompts[1]) == (64, 64)


def test_a_pool_too_small_skips_the_request_and_keeps_the_pool(monkeypatch):
    monkeypatch.setenv(FASTPATH_ENV, "0")
    small = config(num_pages=4, step_token_budget=512, max_model_len=4096)
    executor = build_executor(small, "prefill", 0, common_pb2.InstanceId(), None)
    try:
        before = pool_state(executor.manager)
        report = warm_up(executor, small, "prefill", export=False)
        assert report is not None
        assert report.plan.prefill == ((9,), (512, 9))
        assert report.skipped == ("__warmup-1",)  # 521 tokens do not fit 4 pages; the 9-token one does
        assert pool_state(executor.manager) == before
    finally:
        executor.close()


def test_the_row_count_chunks_only_with_the_prefill_fast_path(fast_executor, monkeypatch):
    # K3_PREFILL_FASTPATH=0: the decode fast path runs, the prefill one does not, nor do its warm-up chunks
    monkeypatch.setenv("K3_PREFILL_FASTPATH", "0")
    report = warm_up(fast_executor, config(), "decode", export=False)
    assert report is not None and report.plan.prefill == ((9,), (64, 9, 1))
    assert plan_warmup(config(max_model_len=5), "decode", None, prefill_fastpath=True).prefill == ((4, 1), (2,))


def test_plan_follows_the_scheduler_and_the_limits():
    # prefill worker: no decode step, no buckets
    assert plan_warmup(config(), "prefill", None).prefill == ((9,), (64, 9))
    assert plan_warmup(config(), "prefill", None).decode_batches == ()
    # the aligned chunk is the budget rounded down to hash blocks, and fits max_model_len with its tail
    assert plan_warmup(config(step_token_budget=70), "decode", None).prefill == ((9,), (64, 9, 1))
    assert plan_warmup(config(max_model_len=40), "decode", None).prefill == ((9,), (16, 9, 1))
    assert plan_warmup(config(max_model_len=12), "decode", None).prefill == ((9, 1),)
    assert plan_warmup(config(max_model_len=5), "decode", None).prefill == ((4, 1),)
    # a 512-token hash block: the tail (257) is neither a hash-block nor a 16 multiple
    assert plan_warmup(config(hash_block_tokens=512, step_token_budget=2048), "prefill", None).prefill == \
        ((257,), (2048, 257))


def test_decode_buckets_cover_every_batch_up_to_max_running(fast_executor):
    from services.engine.warmup import decode_buckets
    for max_running in (1, 3, 4, 64, 100, 256):
        buckets = decode_buckets(fast_executor.fastpath, max_running)
        # every batch size the engine may run is at most one of them, and its class (bucket) is warmed
        assert max(buckets) == min(max_running, 256)
        assert all(b in DEFAULT_BUCKETS or b == max_running for b in buckets)
        assert all(any(b <= w for w in buckets) for b in range(1, max_running + 1))
    assert decode_buckets(None, 64) == ()


def test_auto_is_on_for_cuda_only_and_bad_modes_are_refused():
    assert wanted("auto", torch.device("cuda", 0)) and not wanted("auto", torch.device("cpu"))
    assert wanted("on", torch.device("cpu")) and not wanted("off", torch.device("cuda", 0))
    with pytest.raises(ValueError, match="warmup"):
        wanted("sometimes", torch.device("cpu"))
    with pytest.raises(ConfigError, match="warmup: one of auto, on, off"):
        WorkerConfig.load("decode", ["--warmup", "sometimes"])


def test_skipped_warmup_exports_zero():
    from prometheus_client import REGISTRY

    executor = build_executor(config(warmup="off"), "prefill", 0, common_pb2.InstanceId(), None)
    try:
        assert warm_up(executor, config(warmup="off"), "prefill", export=True) is None
    finally:
        executor.close()
    assert REGISTRY.get_sample_value("k3_prefill_warmup_seconds", {"stage": "total"}) == 0
