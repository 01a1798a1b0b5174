"""Scheduler-side prefix-cache work per decode step with 256 running requests (CPU, metadata only).

    python bench/cache_ops.py [--running 256] [--steps 3000] [--context 20000] [--churn 2]

One step is what the engine's scheduler and executor ask of the manager: for every running request the
sampled token (`append_tokens`, which hashes a 512-token block whenever one fills), `reserve`,
`forward_done` (endpoint registration, a KDA snapshot on every hash boundary), then `pre_forward` and one
`commit_step`. Every `--churn` steps one request finishes its turn (`finish`) and its conversation's next
turn is admitted (`add_request`: two-phase lookup, pins, copy-on-write, a 200-token prefill in the same
step), so lookups, anchoring, supersession and eviction are in the measured path too. K3 shapes at TP 8
(1024-token physical blocks), the pool sized so that it stays full and evicts.

Wall time per step includes the preemption of this shared 2-core machine; thread CPU time per step does
not, so the two together separate code cost from machine noise. Garbage-collector passes are counted and
timed (`gc.callbacks`). The run is repeated with `gc.freeze()` after setup (everything allocated so far is
moved out of the collector's reach, so full collections stop scanning the long-lived cache metadata), a
call the serving process makes once after warm-up.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from array import array
from pathlib import Path

from k3core.cache.checkpoints import CheckpointPolicy
from k3core.cache.hashing import chain_hashes
from k3core.cache.layout import plan_layout, shape_from_config
from k3core.cache.manager import PrefixCacheManager
from k3core.presets import preset

RESULTS = Path(__file__).resolve().parent / "results" / "cache_ops.json"
BUDGET_MS = 1.0
VOCAB = 160_000
TOOL_TOKENS = 200


class GcClock:
    """Counts and times garbage-collector passes by generation."""

    def __init__(self) -> None:
        self.passes = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.passes[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self._start


def _summary(samples_ns: list[int]) -> dict:
    ordered = sorted(samples_ns)
    n = len(ordered)
    return {"mean_ms": sum(ordered) / n / 1e6, "p50_ms": ordered[n // 2] / 1e6,
            "p99_ms": ordered[int(n * 0.99)] / 1e6, "max_ms": ordered[-1] / 1e6}


def measure(running: int = 256, steps: int = 3000, context: int = 20_000, churn: int = 2, seed: int = 0,
            freeze: bool = False, prehash: bool = False, policy: CheckpointPolicy | None = None,
            hash_block: int = 512) -> dict:
    """Time `steps` decode steps of `running` requests; returns wall and CPU-time statistics per step.
    `prehash`: an arriving turn's chain hashes are computed before the step (where the request arrived)
    and passed with its tokens, instead of being hashed inside `add_request`."""
    layout = plan_layout(shape_from_config(preset("k3"), "k3"), tp=8, hash_block_tokens=hash_block)
    rng = random.Random(seed)
    per_block = layout.tokens_per_block
    # Room for every running request's blocks, state and latest checkpoint, and about a quarter more, so
    # that finished turns stay cached and admissions evict.
    live = (context + running + steps) // per_block + 2 + 2 * layout.num_kda_groups
    manager = PrefixCacheManager(layout, int(1.25 * running * live), policy=policy)
    rids: list[str] = []
    turn = 0
    for i in range(running):  # staggered, so that requests cross hash boundaries on different steps
        rids.append(f"r{i}:0")
        manager.add_request(rids[-1], [rng.randrange(VOCAB) for _ in range(context + 37 * i)])
        while manager.requests[rids[-1]].num_computed < context + 37 * i:
            manager.reserve(rids[-1], manager.prefill_chunk(rids[-1], 8192))
            manager.forward_done(rids[-1])
            manager.commit_step()
    # Sampled tokens, tool results and which turn ends when are drawn before the clock starts.
    sampled = iter([rng.randrange(VOCAB) for _ in range(running * steps)])
    tool = array("q", [rng.randrange(VOCAB) for _ in range(TOOL_TOKENS)])
    ending = [rng.randrange(running) for _ in range(steps)]
    gc.collect()
    if freeze:
        gc.freeze()
    clock = GcClock()
    gc.callbacks.append(clock)
    wall, cpu = [], []
    try:
        for step in range(steps):
            begin, begin_cpu = time.perf_counter_ns(), time.thread_time_ns()
            if churn and step % churn == 0:  # a turn ends; the conversation's next turn arrives
                done = rids[ending[step]]
                # The next turn's prompt (and, with prehash, its hashes) is built where it arrives: off
                # the clock.
                paused = time.perf_counter_ns(), time.thread_time_ns()
                prompt = manager.requests[done].tokens + tool
                chain = chain_hashes(prompt, layout.hash_block_tokens) if prehash else None
                begin += time.perf_counter_ns() - paused[0]
                begin_cpu += time.thread_time_ns() - paused[1]
                manager.finish(done)
                turn += 1
                rid = rids[ending[step]] = f"{done.split(':')[0]}:{turn}"
                manager.add_request(rid, prompt, chain=chain)
            for rid in rids:
                req = manager.requests[rid]
                if req.num_computed == req.num_tokens:  # decode: the sampled token becomes known
                    manager.append_tokens(rid, [next(sampled)])
                    manager.reserve(rid, 1)
                else:  # the next turn's new tokens, in one chunk
                    manager.reserve(rid, manager.prefill_chunk(rid, 8192))
            manager.pre_forward()
            for rid in rids:
                manager.forward_done(rid)
            manager.commit_step()
            cpu.append(time.thread_time_ns() - begin_cpu)
            wall.append(time.perf_counter_ns() - begin)
    finally:
        gc.callbacks.remove(clock)
        if freeze:
            gc.unfreeze()
    return {"running": running, "steps": steps, "context": context, "churn_every": churn, "gc_freeze": freeze,
            "prehash": prehash, "hash_block": hash_block,
            "eviction": manager.policy.eviction, "pool_pages": manager.pool.num_pages,
            "evictions": manager.pool.evictions, "wall": _summary(wall), "cpu": _summary(cpu),
            "gc_passes": clock.passes, "gc_ms": [1e3 * s for s in clock.seconds]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--context", type=int, default=20_000)
    parser.add_argument("--churn", type=int, default=2, help="a turn ends every N steps (0: none)")
    args = parser.parse_args()
    runs = []
    configs = [  # (turns end, eviction, gc.freeze, prehash, hash block)
        (0, "value", False, False, 512), (args.churn, "value", False, False, 512),
        (args.churn, "value", True, False, 512), (args.churn, "value", False, True, 512),
        (args.churn, "value", False, False, 256), (args.churn, "lru", False, False, 512)]
    for churn, eviction, freeze, prehash, hash_block in configs:
        runs.append(measure(args.running, args.steps, args.context, churn, freeze=freeze, prehash=prehash,
                            policy=CheckpointPolicy(eviction=eviction), hash_block=hash_block))
    print(f"cache ops per decode step, {args.running} running, K3 TP8 metadata, budget {BUDGET_MS} ms")
    print("| turn ends | hash block | eviction | gc.freeze | arriving turn hashed | wall p50 | wall p99 | wall mean | cpu p50 "
          "| cpu p99 | cpu mean | budget / cpu mean | budget / wall mean | gc passes (gen0/1/2) | gc ms (gen0/1/2) "
          "| evictions |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for run in runs:
        w, c = run["wall"], run["cpu"]
        ends = f"every {run['churn_every']} steps" if run["churn_every"] else "none (decode only)"
        hashed = "-" if not run["churn_every"] else "before the step" if run["prehash"] else "in add_request"
        print(f"| {ends} | {run['hash_block']} | {run['eviction']} | {run['gc_freeze']} | {hashed} "
              f"| {w['p50_ms']:.3f} | {w['p99_ms']:.3f} | {w['mean_ms']:.3f} | {c['p50_ms']:.3f} | {c['p99_ms']:.3f} | {c['mean_ms']:.3f} "
              f"| {BUDGET_MS / c['mean_ms']:.2f}x | {BUDGET_MS / w['mean_ms']:.2f}x "
              f"| {'/'.join(map(str, run['gc_passes']))} | {'/'.join(f'{ms:.1f}' for ms in run['gc_ms'])} "
              f"| {run['evictions']:,} |")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"args": vars(args), "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
