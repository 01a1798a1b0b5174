"""The warm-up a worker runs at start, before its health turns SERVING and before it registers in etcd
(both follow the app's on_start hooks, which build the worker): a few throwaway prefill chunks and a decode
step per batch bucket, so that Triton's JIT compiles, cuBLAS / CUDA library start-up and the decode CUDA
graphs' captures (13 s for the first prefill of `mini` on an H200) are paid here, not by the first users.

Chunk shapes, because kernels specialise on sizes: the first chunk of a short prompt (no prefix, not a
hash-block multiple), the full-budget aligned chunk every long prompt runs, and the unaligned tail that
continues it over the cached prefix; on the decode worker that request then takes one decode step (the
fast path's real-request path), and the fast path runs each batch bucket up to `max_running` on its own
scratch pages (on CUDA with graphs, capturing that bucket's graph), the sampler included.

Nothing it computes becomes cacheable: its scratch requests are admitted with `cacheable=False` (no lookup,
no chain hashes), so the prefix index registers no block of theirs and no KDA checkpoint is taken, and their
pages return to the pool. Every TP rank runs the same sequence before the ranks' start barrier, so the
forwards' collectives pair up.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from k3core.cache.pool import OutOfPages
from services.engine.config import WARMUP_MODES, WorkerConfig
from services.engine.cuda_graphs import DEFAULT_BUCKETS
from services.engine.decode_fastpath import DecodeFastPath
from services.engine.executor import Executor
from services.engine.fast_prefill import WARMUP_ROWS
from services.engine.metrics import EngineMetrics
from services.engine.params import GenerationOptions
from services.engine.plan import ForwardItem, StepPlan
from services.engine.sampler import sample_rows

log = logging.getLogger("k3.worker.warmup")

_RID = "__warmup-{}"  # scratch requests live on the manager only, and are gone before the engine starts

_GREEDY = GenerationOptions(temperature=0.0, top_k=0, top_p=1.0, seed=0, max_tokens=1, stop=(),
                            stop_token_ids=frozenset(), ignore_eos=True)
# A seeded draw with top-k and top-p: the truncation's topk / sort run too (no global RNG is touched).
_SAMPLED = GenerationOptions(temperature=0.7, top_k=40, top_p=0.9, seed=1, max_tokens=1, stop=(),
                             stop_token_ids=frozenset(), ignore_eos=True)


@dataclass(frozen=True)
class WarmupPlan:
    prefill: tuple[tuple[int, ...], ...]  # per scratch request, its forwards' token counts in order
    decode_batches: tuple[int, ...]  # decode fast-path batch sizes (bucket sizes) run on scratch pages


@dataclass(frozen=True)
class WarmupReport:
    plan: WarmupPlan
    prefill_s: float
    decode_s: float
    skipped: tuple[str, ...]  # scratch requests the pool could not hold (a warning each)

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s


def wanted(mode: str, device: torch.device) -> bool:
    """"auto": on for CUDA only. On a CPU nothing is JIT-compiled (the reference path is eager torch) and the
    first forward costs what the next ones do, so a warm-up would only delay readiness."""
    if mode not in WARMUP_MODES:
        raise ValueError(f"warmup: one of {', '.join(WARMUP_MODES)}, got {mode!r}")
    return mode == "on" or (mode == "auto" and device.type == "cuda")


def warmup_tokens(count: int, vocab_size: int) -> list[int]:
    """The scratch requests' tokens (deterministic, so a test can look them up in the prefix cache)."""
    return [(7919 * i + 17) % vocab_size for i in range(count)]


def plan_warmup(config: WorkerConfig, role: str, fastpath: DecodeFastPath | None,
                prefill_fastpath: bool = False) -> WarmupPlan:
    hb = config.hash_block_tokens
    decode_step = (1,) if role == "decode" else ()
    # not a hash-block multiple (nor of 16, for hb >= 32)
    tail = max(1, min(hb // 2 + 1, config.max_model_len - len(decode_step)))
    room = config.max_model_len - tail - len(decode_step)
    aligned = min(config.step_token_budget, room) // hb * hb
    prefill = ((tail,), (aligned, tail, *decode_step)) if aligned > 0 else ((tail, *decode_step),)
    if prefill_fastpath:  # its AttnRes kernels also specialise on these row counts
        prefill += tuple((rows,) for rows in WARMUP_ROWS if rows <= config.max_model_len)
    return WarmupPlan(prefill, decode_buckets(fastpath, config.max_running) if role == "decode" else ())


def decode_buckets(fastpath: DecodeFastPath | None, max_running: int) -> tuple[int, ...]:
    """One batch size per bucket a decode step of at most `max_running` rows may use: the captured graphs'
    buckets (a batch is padded to its bucket), or the same sizes on the eager path (kernels specialise
    on the batch size's class, not on every size)."""
    if fastpath is None:
        return ()
    limit = min(max_running, fastpath.max_batch)
    if fastpath.graphs is not None:
        return tuple(b for b in fastpath.graphs.buckets if b < limit) + (fastpath.graphs.bucket(limit),)
    return tuple(b for b in DEFAULT_BUCKETS if b < limit) + (limit,)


def run_warmup(executor: Executor, plan: WarmupPlan, vocab_size: int) -> WarmupReport:
    started = time.perf_counter()
    skipped = []
    for index, chunks in enumerate(plan.prefill):
        rid = _RID.format(index)
        try:
            _scratch_request(executor, rid, chunks, vocab_size)
        except OutOfPages as exc:
            skipped.append(rid)
            log.warning("warm-up request skipped: the pool cannot hold it", extra={"chunks": chunks,
                                                                                  "error": str(exc)})
    _synchronize(executor.runner.device)
    prefill_done = time.perf_counter()
    for batch in plan.decode_batches:
        assert executor.fastpath is not None
        _scratch_decode(executor.fastpath, batch)
    _synchronize(executor.runner.device)
    return WarmupReport(plan, prefill_done - started, time.perf_counter() - prefill_done, tuple(skipped))


def _scratch_request(executor: Executor, rid: str, chunks: tuple[int, ...], vocab_size: int) -> None:
    """Prefill (and decode) a request without chain hashes through the executor's step, then release it."""
    manager = executor.manager
    total = sum(chunks)
    manager.add_request(rid, num_tokens=total, cacheable=False)  # OutOfPages: nothing taken
    req = manager.requests[rid]
    tokens = warmup_tokens(total, vocab_size)
    try:
        start = 0
        for i, count in enumerate(chunks):
            manager.reserve(rid, count)
            sample = i > 0 or len(chunks) == 1  # as the scheduler marks them: all but an aligned first chunk
            result = executor.execute(StepPlan(forward=[ForwardItem(rid, tokens[start:start + count], sample)]))
            start += count
        assert result.logits is not None
        sample_rows(result.logits, [(0, _GREEDY, 0), (0, _SAMPLED, 0)])
        if manager.store is not None:  # the integrity checksum every checkpoint and restore takes
            manager.store.fingerprint(req.state_pages[0], manager.layout.kda_page_used_bytes)
    finally:
        manager.finish(rid, turn_boundary=False)
        manager.commit_step()  # pages a step's copies still held go back to the pool now


def _scratch_decode(fastpath: DecodeFastPath, batch: int) -> None:
    """A decode step of `batch` rows, every row on the fast path's scratch pages (captures the bucket's
    CUDA graph on first use), and its greedy draw."""
    image, size = fastpath.staging(batch)
    fastpath.builder.build([], [], size, out=image)
    logits = fastpath.launch(image, batch)
    sample_rows(logits, [(row, _GREEDY, 0) for row in range(batch)])


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def warm_up(executor: Executor, config: WorkerConfig, role: str, *, export: bool) -> WarmupReport | None:
    """Run the warm-up if `config.warmup` wants it on this device; log it, and (`export`: rank 0) set the
    role's k3_<role>_warmup_seconds{stage="prefill"|"decode"|"total"} (0 when skipped; `EngineMetrics`).
    Every rank of a TP worker calls this with the same config, before the start barrier."""
    gauge = EngineMetrics.for_role(role).warmup_seconds if export else None
    if not wanted(config.warmup, executor.runner.device):
        log.info("warm-up skipped", extra={"warmup": config.warmup, "device": str(executor.runner.device)})
        if gauge is not None:
            for stage in ("prefill", "decode", "total"):
                gauge.labels(stage).set(0)
        return None
    plan = plan_warmup(config, role, executor.fastpath, executor.runner.prefill_fastpath() is not None)
    log.info("warm-up started", extra={"prefill_chunks": plan.prefill, "decode_batches": plan.decode_batches})
    report = run_warmup(executor, plan, config.model_config().vocab_size)
    log.info("warm-up finished", extra={
        "warmup_s": round(report.total_s, 4), "prefill_s": round(report.prefill_s, 4),
        "decode_s": round(report.decode_s, 4), "prefill_chunks": plan.prefill,
        "decode_batches": plan.decode_batches, "skipped": report.skipped, "rank": executor.rank})
    if gauge is not None:
        gauge.labels("prefill").set(report.prefill_s)
        gauge.labels("decode").set(report.decode_s)
        gauge.labels("total").set(report.total_s)
    return report
