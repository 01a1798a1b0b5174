"""Decode throughput and TTFT of one engine rank, against the decode step's memory roofline and a named peer.

    python -m bench.serve [--model mini] [--batches 1 16 64 256] [--contexts 1024 4096] [--steps 10]
                          [--prefix 32768] [--increment 512] [--peer-batches 1 16] [--time-limit 420]
                          [--variant NAME=ENV=value,... ...] [--repeats 1]

Runs one TP-1 rank in-process on seeded random weights: the paged pool (`k3core.cache`), the reference
layers for prefill (`ModelRunner`), and the decode fast path the executor uses on CUDA (`DecodeFastPath`:
kernels through `kernels.dispatch` on the pool's pages, one CUDA graph per batch bucket).
- decode: B requests at `context` tokens (pages reserved and marked computed without a prefill forward:
  the cost of a decode step does not depend on the cached values), `--steps` timed steps after a warm-up of
  the engine's own loop (3 steps, the heap freeze, 2 more; `bench.serve_engine`: `Engine._step` with its
  scheduler, executor, host/device overlap, batched sampling, output processing and streams; it needs grpcio
  and prometheus-client, from `.device/wheels` on the device), each row fed a pseudo-random token (see
  there). K3_DECODE_OVERLAP=0 measures the plain loop (each step waits for its tokens before the next is
  planned).
  Roofline of a step = (weights touched + KDA state read and write + MLA latent read) / copy bandwidth
  measured in the same run.
- TTFT: a fresh `--prefix` + `--increment` prompt (uncached), then the same prefix with a different
  increment (restored from the prefix cache: MLA blocks + the KDA checkpoint at the prefix end).
- peer: Hugging Face transformers' `kimi_linear` model on the Kimi-Linear form of the preset (`<model>-kl`)
  with the same weights (our state dict loaded into it), decode at the same batch and context; ours runs
  the same `-kl` model. Greedy tokens of both on one prompt are compared as a check.
- variants (`--variant`, repeatable): each decode row is measured once per variant in turn, in one process on
  one rank (a fair comparison: same weights, pool, clocks), each under its environment settings (e.g.
  K3_GREEDY_ARGMAX=torch, K3_GRAPH_INPUT_COPY=0), the CUDA graphs captured again for each.
Rows are written to `--out` as they are measured. Parts: `serve_rank` (the rank), `serve_decode` (sweep,
roofline, profile), `serve_engine` (the engine loop of a decode row), `serve_check` (--check), `serve_ttft`,
`serve_peer`; only `serve_engine` imports the service runtime.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from bench.serve_check import check_fast_path
from bench.serve_decode import SWEEP_HEADER, apply_variant, decode_sweep_row, parse_variant, profile_forward
from bench.serve_peer import run_peer
from bench.serve_rank import Rank, copy_bandwidth, random_model
from bench.serve_ttft import save, ttft
from k3core.presets import preset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mini")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prefix", type=int, default=32768)
    parser.add_argument("--increment", type=int, default=512)
    parser.add_argument("--peer-batches", type=int, nargs="*", default=[1, 16])
    parser.add_argument("--peer-context", type=int, default=1024)
    parser.add_argument("--peer-steps", type=int, default=5)
    parser.add_argument("--num-pages", type=int, default=16000)
    parser.add_argument("--hash-block", type=int, default=512)
    parser.add_argument("--budget", type=int, default=8192, help="prefill tokens per forward")
    parser.add_argument("--check", action="store_true", help="compare one fast-path step with the reference")
    parser.add_argument("--profile", type=int, nargs="*", default=[], help="print the kernel profile at these batches")
    parser.add_argument("--variant", action="append", default=[], type=parse_variant,
                        help="name=ENV=value,...: every decode row once per variant, in turn (the same rank), "
                             "with these settings over the starting environment; repeat the flag")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of the variants per decode row")
    parser.add_argument("--time-limit", type=float, default=420.0, help="skip what would start after this")
    parser.add_argument("--out", default="bench/results/serve.json")
    args = parser.parse_args()
    began = time.perf_counter()
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    bandwidth = copy_bandwidth(args.device, (1 << 30) if args.device.startswith("cuda") else (1 << 26))
    model = random_model(preset(args.model), args.device, dtype)
    rank = Rank(model, args.model, args, dtype)
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    result: dict = {"model": args.model, "device": f"{device_name}, torch {torch.__version__}", "dtype": str(dtype),
                    "copy_bandwidth_Bps": bandwidth, "fast_path": rank.fast is not None,
                    "cuda_graphs": bool(rank.fast and rank.fast.graphs), "decode": [], "skipped": []}
    print(f"model {args.model} on {device_name} ({dtype}); copy bandwidth {bandwidth / 1e9:.0f} GB/s; "
          f"fast path {result['fast_path']}, graphs {result['cuda_graphs']}")
    print(SWEEP_HEADER)
    if args.check and rank.fast is not None:
        result["fast_path_check"] = check_fast_path(rank)
    variants = args.variant or [("", {})]
    base = {key: os.environ.get(key) for _, settings in variants for key in settings}
    result["variants"] = dict(variants)
    for context in args.contexts:
        for batch in args.batches:
            for _ in range(args.repeats):
                for name, settings in variants:
                    if time.perf_counter() - began > args.time_limit:
                        result["skipped"].append(f"decode batch {batch} context {context} {name}")
                        continue
                    if args.variant:
                        apply_variant(rank, settings, base)
                    result["decode"].append(decode_sweep_row(rank, model, batch, context, args.steps, bandwidth,
                                                             name))
                    save(args.out, result)
    if args.variant:
        apply_variant(rank, {}, base)
    # After the timed rows: once the profiler has run, CUPTI stays attached to the process and every later graph
    # launch costs the host ~0.1-0.2 ms more (session 6: launch call 45 -> 238 us at batch 64 when profiled first).
    for batch in args.profile if rank.fast is not None else []:
        result.setdefault("profile", []).append(profile_forward(rank, batch, args.contexts[0]))
        save(args.out, result)
    if time.perf_counter() - began < args.time_limit and args.prefix:
        result["ttft"] = ttft(rank, [(11 * j) % rank.vocab + 1 for j in range(args.prefix)], args.increment)
        t = result["ttft"]
        print(f"TTFT {args.prefix}+{args.increment}: uncached {t['uncached_s']:.3f} s, prefix hit "
              f"({t['hit_tokens']} tokens) {t['cached_s']:.3f} s: {t['speedup']:.0f}x", flush=True)
        save(args.out, result)
    else:
        result["skipped"].append("ttft")
    del rank
    if time.perf_counter() - began < args.time_limit and args.peer_batches:
        result["peer_kimi_linear"] = run_peer(args, dtype)
    else:
        result["skipped"].append("peer")
    result["wall_s"] = time.perf_counter() - began
    save(args.out, result)


if __name__ == "__main__":
    main()
