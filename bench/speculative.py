"""Speculative decoding on the CPU engine: tokens per verify step and wall time, against the same engine
without a draft (the named peer).

    python -m bench.speculative [--requests 4] [--max-tokens 48] [--out bench/results/speculative.json]

Runs the decode worker's engine in-process (nano with 4 KDA/MLA heads, seeded random weights, hash blocks
of 16) with no draft (the peer), then with two drafts: the target itself (every draft agrees: the upper
bound) and other weights (the lower bound: greedy, it practically never agrees; sampled at temperature 1.5
it agrees with probability sum(min(p, q)), partial acceptance). A draft model that is both small and
close to the target needs trained weights, which this machine has not. Tokens per verify = tokens a
request emits per target verify forward (accepted + 1); "vs peer" = the peer's wall time over ours. On
the CPU the draft is as large as the target and the reference layers' multi-token path costs several
decode steps, so the wall-time ratio shows the overhead here, not a production gain; tokens per verify is
what carries over to a small draft on a GPU, where a verify forward costs about one decode step.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

from k3.v1 import common_pb2
from services.engine.config import WorkerConfig
from services.engine.params import GenerationOptions
from services.engine.request import EngineRequest, StepOutput
from services.engine.worker import Worker

OVERRIDES = {"kda_num_heads": 4, "num_attention_heads": 4}
DRAFT_SEEDS = {"target itself": 0, "other weights": 7}
CASES = [(0.0, "target itself", (1, 3, 5)), (0.0, "other weights", (1, 3, 5)), (1.5, "target itself", (3,)),
         (1.5, "other weights", (1, 3, 5))]


def run(args: argparse.Namespace, draft: str | None, num_tokens: int, temperature: float) -> dict:
    flags = ["--model-overrides", json.dumps(OVERRIDES), "--hash-block-tokens", "16", "--num-pages", "128"]
    if draft is not None:
        flags += ["--draft-model", "nano", "--draft-model-overrides", json.dumps(OVERRIDES),
                  "--draft-weights-seed", str(DRAFT_SEEDS[draft]), "--num-speculative-tokens", str(num_tokens)]
    worker = Worker(WorkerConfig.load("decode", flags, env={}), "decode")
    engine = worker.start(common_pb2.InstanceId(service="decode"))
    done = [threading.Event() for _ in range(args.requests)]
    counts = [0] * args.requests

    def sink(i: int):
        def emit(out: StepOutput) -> None:
            counts[i] += len(out.token_ids)
            if out.finish_reason or out.error:
                done[i].set()
        return emit

    started = time.perf_counter()
    for i in range(args.requests):
        params = common_pb2.SamplingParams(temperature=temperature, seed=i, max_tokens=args.max_tokens,
                                           ignore_eos=True)
        opts = GenerationOptions.from_proto(params, vocab_size=300, max_tokens_limit=4096)
        prompt = [(13 * i + j) % 250 + 1 for j in range(24 + 8 * i)]
        engine.submit(EngineRequest(f"b{i}", prompt, opts, sink(i)))
    for event in done:
        event.wait(600)
    seconds = time.perf_counter() - started
    spec = engine.speculator
    worker.stop()
    row = {"draft": draft or "none (peer)", "temperature": temperature, "n": num_tokens if draft else 0,
           "tokens": sum(counts), "seconds": round(seconds, 3)}
    if spec is not None and spec.verifies:
        row |= {"acceptance_rate": round(spec.accepted / spec.proposed, 3),
                "tokens_per_verify": round((spec.accepted + spec.verifies) / spec.verifies, 3)}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--out", default="bench/results/speculative.json")
    args = parser.parse_args()
    peers = {t: run(args, None, 0, t) for t in sorted({t for t, _, _ in CASES})}
    rows = list(peers.values())
    for temperature, draft, sizes in CASES:
        for n in sizes:
            row = run(args, draft, n, temperature)
            row["speedup_vs_peer"] = round(peers[temperature]["seconds"] / row["seconds"], 3)
            rows.append(row)
    print(f"{'draft':<14} {'T':>4} {'n':>2} {'accept':>7} {'tok/verify':>10} {'seconds':>8} {'vs peer':>8}")
    for row in rows:
        print(f"{row['draft']:<14} {row['temperature']:>4} {row['n']:>2} {row.get('acceptance_rate', '-'):>7} "
              f"{row.get('tokens_per_verify', '-'):>10} {row['seconds']:>8} {row.get('speedup_vs_peer', '-'):>8}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": "CPU (2 shared cores)", "model": "nano", "requests": args.requests,
                                          "max_tokens": args.max_tokens, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
