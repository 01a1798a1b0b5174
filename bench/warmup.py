"""What the start-up warm-up saves the first users (services/engine/warmup.py): two fresh processes, each
with an empty Triton cache, build a decode rank as the worker does; "warm" runs the warm-up, "cold" does
not (the peer); then both serve the same first requests:

    python -m bench.warmup [--model mini --device cuda --dtype bfloat16 --num-pages 3000] [--json PATH]

Rows: the first prompt's TTFT (aligned chunks + an unaligned tail, as the scheduler cuts them) and a second
fresh prompt's (the steady state), the first decode step at batch 1 and at the largest batch
(`--max-running`, its CUDA-graph bucket) and the median of the next steps. Ratios: cold / warm for the first
request (what a user of a fresh worker pays), and first / steady within each process (1.0: nothing left to
warm). CPU dry run: `python -m bench.warmup --model nano --device cpu --dtype float32 --num-pages 256
--step-token-budget 64 --hash-block-tokens 16 --prompt 73 --max-running 4 --json /tmp/warmup.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bench.serve_engine import bench_executor
from bench.serve_rank import random_model, sync
from k3core.cache.manager import PrefixCacheManager
from services.engine.config import WorkerConfig
from services.engine.executor import Executor
from services.engine.model_runner import ModelRunner
from services.engine.plan import ForwardItem, StepPlan
from services.engine.warmup import warm_up


def prefill(executor: Executor, rid: str, tokens: list[int], budget: int) -> tuple[float, int]:
    """Seconds to the first token of a fresh prompt, chunked as the scheduler does; the token."""
    manager, started = executor.manager, time.perf_counter()
    manager.add_request(rid, tokens)
    while True:
        computed, count = manager.requests[rid].num_computed, manager.prefill_chunk(rid, budget)
        manager.reserve(rid, count)
        done = computed + count == len(tokens)
        result = executor.execute(StepPlan(forward=[ForwardItem(rid, tokens[computed:computed + count], done)]))
        if done:
            token = int(result.logits[0].argmax())
            sync()
            return time.perf_counter() - started, token


def decode_steps(executor: Executor, last: dict[str, int], steps: int) -> list[float]:
    """Seconds of `steps` greedy decode steps of the requests in `last` (rid -> pending token)."""
    manager, times = executor.manager, []
    for _ in range(steps):
        started = time.perf_counter()
        for rid, token in last.items():
            manager.append_tokens(rid, [token])
            manager.reserve(rid, 1)
        result = executor.execute(StepPlan(forward=[ForwardItem(rid, [t], True) for rid, t in last.items()]))
        last.update(zip(last, result.logits.argmax(-1).tolist(), strict=True))
        sync()
        times.append(time.perf_counter() - started)
    return times


def build_rank(config: WorkerConfig) -> Executor:
    """`worker.build_executor` with the weights drawn on the device (a CPU init of mini's 2.4B parameters
    would dominate the run)."""
    torch.set_num_threads(config.torch_threads)  # as build_model: one intra-op thread per rank
    model = random_model(config.model_config(), config.device, config.torch_dtype)
    manager = PrefixCacheManager(config.pool_layout(), config.num_pages, device=config.device)
    return bench_executor(manager, ModelRunner(model, config.device))


def child(args: argparse.Namespace) -> dict:
    config = WorkerConfig(model=args.model, device=args.device, dtype=args.dtype, num_pages=args.num_pages,
                          hash_block_tokens=args.hash_block_tokens, step_token_budget=args.step_token_budget,
                          max_running=args.max_running, warmup="on" if args.child == "warm" else "off")
    started = time.perf_counter()
    executor = build_rank(config)
    sync()
    row: dict = {"mode": args.child, "build_s": time.perf_counter() - started}
    report = warm_up(executor, config, "decode", export=False)
    row["warmup_s"] = report.total_s if report else 0.0
    # as in a worker: the warm-up ran on the start-up thread, the requests run on the engine's own thread
    # (so per-thread state, e.g. cuBLAS handles, that the warm-up did not cover shows in the first rows)
    with ThreadPoolExecutor(1) as engine_thread:
        row.update(engine_thread.submit(first_requests, executor, config, args.prompt, args.max_running).result())
    executor.close()
    return row


def first_requests(executor: Executor, config: WorkerConfig, prompt_tokens: int, max_running: int) -> dict:
    row: dict = {}
    vocab = config.model_config().vocab_size
    prompt = [[(13 * i + 7 * k + 1) % vocab for i in range(prompt_tokens)] for k in range(2)]
    row["ttft_first_s"], first = prefill(executor, "p0", prompt[0], config.step_token_budget)
    row["ttft_second_s"], _ = prefill(executor, "p1", prompt[1], config.step_token_budget)
    one = decode_steps(executor, {"p0": first}, 6)
    row["decode1_first_ms"], row["decode1_steady_ms"] = 1e3 * one[0], 1e3 * statistics.median(one[1:])
    batch = {}
    for k in range(max_running):
        _, batch[f"b{k}"] = prefill(executor, f"b{k}", [(k * 31 + i) % vocab for i in range(16)], 2048)
    many = decode_steps(executor, batch, 6)
    row["decodeB_first_ms"], row["decodeB_steady_ms"] = 1e3 * many[0], 1e3 * statistics.median(many[1:])
    row["batch"] = max_running
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mini")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-pages", type=int, default=3000)
    parser.add_argument("--hash-block-tokens", type=int, default=512)
    parser.add_argument("--step-token-budget", type=int, default=2048)
    parser.add_argument("--prompt", type=int, default=2048 + 7, help="tokens of each timed prompt")
    parser.add_argument("--max-running", type=int, default=64, help="the largest decode batch timed")
    parser.add_argument("--json", default="bench/results/warmup.json")
    parser.add_argument("--child", choices=("cold", "warm"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    rows = {}
    for mode in ("cold", "warm"):
        with tempfile.TemporaryDirectory() as cache:  # a fresh Triton cache: no compile carried over
            out = subprocess.run([sys.executable, "-m", "bench.warmup", *sys.argv[1:], "--child", mode],
                                 env={**os.environ, "TRITON_CACHE_DIR": cache}, check=True,
                                 stdout=subprocess.PIPE, text=True)
        rows[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    cold, warm = rows["cold"], rows["warm"]
    print(f"{args.model} on {args.device} ({args.dtype}); peer: the same process without the warm-up")
    print(f"{'':22}{'cold':>10}{'warm':>10}{'cold/warm':>11}{'cold 1st/steady':>17}{'warm 1st/steady':>17}")
    pairs = [("ttft_first_s", "ttft_second_s"), ("decode1_first_ms", "decode1_steady_ms"),
             ("decodeB_first_ms", "decodeB_steady_ms")]
    for first, steady in pairs:
        print(f"{first:22}{cold[first]:10.3f}{warm[first]:10.3f}{cold[first] / warm[first]:11.1f}"
              f"{cold[first] / cold[steady]:17.2f}{warm[first] / warm[steady]:17.2f}")
    print(f"{'warmup_s':22}{cold['warmup_s']:10.3f}{warm['warmup_s']:10.3f}   (batch B = {warm['batch']})")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
