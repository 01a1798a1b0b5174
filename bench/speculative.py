"""Speculative decoding on the CPU engine: tokens per verify step and wall time, against the same engine
without a draft (the named peer).

    python -m bench.speculative [--requests 4] [--max-tokens 48] [--out bench/results/speculative.json]

Runs the decode worker's engine in-process (nano with 4 KDA/MLA heads, seeded random weights, greedy, hash
blocks of 16) with no draft, then with three drafts: the target itself (every draft agrees: the upper
bound), the target with a perturbed RMSNorm epsilon (agrees often, not always), and other weights (agrees
almost never: the lower bound). Tokens per verify step = emitted tokens per request and target forward;
"speedup" is wall time of the peer over wall time with the draft. On the CPU the draft costs as much per
token as the target (same size), so the wall-time ratio shows the overhead, not a production gain; tokens
per step is what carries over to a small draft on a GPU.
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
DRAFTS = {
    "target itself": OVERRIDES,
    "perturbed target": {**OVERRIDES, "rms_norm_eps": 0.05},
    "other weights": OVERRIDES,
}


def run(args: argparse.Namespace, draft: str | None, num_tokens: int) -> dict:
    flags = ["--model-overrides", json.dumps(OVERRIDES), "--hash-block-tokens", "16", "--num-pages", "128"]
    if draft is not None:
        flags += ["--draft-model", "nano", "--draft-model-overrides", json.dumps(DRAFTS[draft]),
                  "--num-speculative-tokens", str(num_tokens)]
        if draft == "other weights":
            flags += ["--draft-weights-seed", "7"]
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
        params = common_pb2.SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        opts = GenerationOptions.from_proto(params, vocab_size=300, max_tokens_limit=4096)
        prompt = [(13 * i + j) % 250 + 1 for j in range(24 + 8 * i)]
        engine.submit(EngineRequest(f"b{i}", prompt, opts, sink(i)))
    for event in done:
        event.wait(600)
    seconds = time.perf_counter() - started
    spec = engine.speculator
    worker.stop()
    row = {"draft": draft or "none (peer)", "n": num_tokens if draft else 0, "tokens": sum(counts),
           "seconds": round(seconds, 3)}
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
    peer = run(args, None, 0)
    rows = [peer]
    for draft in DRAFTS:
        for n in (1, 3, 5):
            row = run(args, draft, n)
            row["speedup_vs_peer"] = round(peer["seconds"] / row["seconds"], 3)
            rows.append(row)
    print(f"{'draft':<18} {'n':>2} {'accept':>7} {'tok/verify':>10} {'seconds':>8} {'vs peer':>8}")
    for row in rows:
        print(f"{row['draft']:<18} {row['n']:>2} {row.get('acceptance_rate', '-'):>7} "
              f"{row.get('tokens_per_verify', '-'):>10} {row['seconds']:>8} {row.get('speedup_vs_peer', '-'):>8}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": "CPU (2 shared cores)", "model": "nano", "requests": args.requests,
                                          "max_tokens": args.max_tokens, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
