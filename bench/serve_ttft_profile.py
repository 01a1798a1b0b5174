"""Where one warm prefix hit's time goes (issue #5: the 32K+512 hit's forward against its FLOP roofline):

    python -m bench.serve_ttft_profile [--model mini] --prefix 32768 --increment 512 [--out DIR]

After the warm-ups bench.serve_ttft runs (JIT), the prefix uncached (it fills the cache) and two hits, one
more hit is measured four ways: (1) the forward's host time (until `forward` returns, no sync) against its
synced time: equal means the host, not the device, sets the pace; (2) torch.profiler: kernels by device
time, host ops by self time, the device's busy share of the forward, launches and synchronising calls, and
host time per sublayer kind (`prefill.kda`, `.mla`, and with K3_PREFILL_FASTPATH=0 `.moe`, `.mlp`: ranges
around the model's modules, which the fast prefill calls for attention only);
(3) cProfile of the host side by function; (4) the synchronising CUDA calls with the line that made each
(torch.cuda.set_sync_debug_mode). Writes DIR/ttft_profile.json, the tables and the chrome trace (gzipped).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import pstats
import time
import warnings
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from bench.serve_rank import Rank, sync
from bench.serve_trace_gaps import export_trace, union_length
from bench.serve_ttft import _prefill, prefill_rank, prefix_tokens, warm_up

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def label_sublayers(model: torch.nn.Module, stack: ExitStack) -> None:
    """A record_function range around every attention and feed-forward module of the model (hooks removed
    when `stack` closes); the AttnRes ops between them are the `prefill.attnres` gaps of the block."""
    for layer in model.model.layers:
        kind = type(layer.self_attn).__name__
        ffn = layer.block_sparse_moe if layer.is_moe else layer.mlp
        for module, name in ((layer.self_attn, "kda" if "Delta" in kind else "mla"), (ffn, "moe" if layer.is_moe
                                                                                         else "mlp")):
            ranges: list = []

            def enter(_m, _args, _ranges=ranges, _name=name):
                _ranges.append(record_function(f"prefill.{_name}").__enter__())

            def leave(_m, _args, _out, _ranges=ranges):
                _ranges.pop().__exit__(None, None, None)

            stack.callback(module.register_forward_pre_hook(enter).remove)
            stack.callback(module.register_forward_hook(leave).remove)


def host_and_synced(rank: Rank, rid: str, tokens: list[int]) -> dict[str, float]:
    """The forward's seconds until it returns (host) and until the device is done (synced)."""
    runner, times = rank.runner, {}
    call = runner.forward

    def timed(*args, **kwargs):
        sync()
        began = time.perf_counter()
        out = call(*args, **kwargs)
        times["host_s"] = time.perf_counter() - began
        sync()
        times["synced_s"] = time.perf_counter() - began
        return out

    runner.forward = timed
    try:
        _prefill(rank, rid, tokens)
    finally:
        del runner.forward
    return times


def profiled(rank: Rank, rid: str, tokens: list[int], out: Path) -> dict:
    cuda = torch.cuda.is_available()
    with ExitStack() as stack:
        label_sublayers(rank.runner.model, stack)
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            with record_function("prefill.forward_hit"):
                _prefill(rank, rid, tokens)
    events = prof.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    hit = next(e for e in events if e.name == "prefill.forward_hit")
    labels: Counter = Counter()
    for e in events:
        if e.name.startswith("prefill.") and e.name != "prefill.forward_hit":
            labels[e.name] += e.cpu_time_total / 1e6
    calls = Counter(e.name for e in events if e.device_type == torch.autograd.DeviceType.CPU)
    averages = prof.key_averages()
    tables = {"kernels": averages.table(sort_by="self_device_time_total", row_limit=35, max_name_column_width=70),
              "host": averages.table(sort_by="self_cpu_time_total", row_limit=35, max_name_column_width=70)}
    for name, text in tables.items():
        (out / f"ttft_profile_{name}.txt").write_text(text)
    export_trace(prof, out / "ttft_profile_trace.json.gz")
    return {"hit_wall_s": hit.cpu_time_total / 1e6, "kernel_s": sum(k.time_range.elapsed_us() for k in kernels) / 1e6,
            "device_busy_s": union_length([(k.time_range.start, k.time_range.end) for k in kernels]) / 1e6,
            "kernels": len(kernels), "sublayer_host_s": dict(labels),
            "launches": {n: c for n, c in calls.items() if "aunch" in n},
            "sync_calls": {n: c for n, c in calls.items() if n.startswith(SYNC_CALLS)}, "tables": tables}


def host_functions(rank: Rank, rid: str, tokens: list[int], out: Path) -> str:
    """cProfile of one hit, by own time and by cumulative time (the first 30 of each)."""
    prof = cProfile.Profile()
    prof.runcall(_prefill, rank, rid, tokens)
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(45)
    (out / "ttft_profile_cprofile.txt").write_text(text.getvalue())
    return text.getvalue()


def sync_sites(rank: Rank, rid: str, tokens: list[int]) -> dict[str, int]:
    """Where the hit synchronises with the device: warning site (file:line) -> count."""
    if not torch.cuda.is_available():
        return {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            _prefill(rank, rid, tokens)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return dict(Counter(f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mini")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prefix", type=int, default=32768)
    parser.add_argument("--increment", type=int, default=512)
    parser.add_argument("--num-pages", type=int, default=3000)
    parser.add_argument("--hash-block", type=int, default=512)
    parser.add_argument("--budget", type=int, default=8192)
    parser.add_argument("--out", default="bench/results/ttft_profile")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rank, _ = prefill_rank(args, args.prefix + args.increment)
    warm_up(rank, 0)
    prefix = prefix_tokens(args.prefix, 0, rank.vocab)
    rank.budget = math.gcd(rank.budget, len(prefix))
    uncached, _ = _prefill(rank, "miss", prefix + [5] * args.increment, keep_turn=True)
    hits = [_prefill(rank, f"hit{k}", prefix + [9 + k] * args.increment)[0] for k in range(2)]
    result = {"model": args.model, "prefix": args.prefix, "increment": args.increment, "uncached_s": uncached,
              "hits_s": hits, **host_and_synced(rank, "host", prefix + [12] * args.increment)}
    result["profile"] = profiled(rank, "prof", prefix + [13] * args.increment, out)
    result["sync_sites"] = sync_sites(rank, "syncs", prefix + [14] * args.increment)
    cprofile = host_functions(rank, "cprof", prefix + [15] * args.increment, out)
    (out / "ttft_profile.json").write_text(json.dumps(result, indent=2))
    p = result["profile"]
    print(f"{args.model} {args.prefix}+{args.increment}: uncached {uncached:.3f} s, hits "
          f"{' '.join(f'{h * 1e3:.1f}' for h in hits)} ms; forward host {result['host_s'] * 1e3:.1f} ms, synced "
          f"{result['synced_s'] * 1e3:.1f} ms; profiled hit {p['hit_wall_s'] * 1e3:.1f} ms, device busy "
          f"{p['device_busy_s'] * 1e3:.1f} ms in {p['kernels']} kernels")
    print("sublayer host s:", {k: round(v * 1e3, 2) for k, v in p["sublayer_host_s"].items()})
    print("launches:", p["launches"], "syncs:", p["sync_calls"], "sync sites:", result["sync_sites"])
    print(p["tables"]["kernels"])
    print(p["tables"]["host"][:6000])
    print(cprofile[:9000])


if __name__ == "__main__":
    main()
