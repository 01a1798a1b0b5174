"""The fused decode-glue kernels (kernels/fused) on the device at the `mini` preset's decode shapes, each
against its plain-torch reference composition (the peer): max |difference| and device time of both.

    python -m bench.serve_glue [--tokens 1 64 256] [--out bench/results/serve_glue.json]

Device time: `reps` calls captured in one CUDA graph and replayed (as the fast path runs them): timing eager
calls back to back measures the host's launch rate instead (the first version of this bench did, and its
"fused us" were 20-80 us for kernels that take a few).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from k3core.presets import preset
from kernels.fused import (
    gated_heads_triton,
    mla_latent_write_triton,
    moe_align_triton,
    moe_combine_triton,
    moe_router_triton,
    naive,
)


def device_us(fn: Callable[[], object], reps: int = 20) -> float:
    fn()
    if not torch.cuda.is_available():  # CPU dry run (TRITON_INTERPRET=1): wall time
        began = time.perf_counter()
        fn()
        return (time.perf_counter() - began) * 1e6
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def max_diff(a: object, b: object) -> float:
    pairs = zip(a, b, strict=True) if isinstance(a, tuple) else [(a, b)]
    return max(float((x.double() - y.double()).abs().max()) for x, y in pairs)


def cases(tokens: int, gen: torch.Generator) -> dict[str, tuple[Callable, Callable]]:
    """name -> (fused launch, torch reference) on mini's shapes at `tokens` decode rows."""
    c = preset("mini")
    dev, bf = gen.device, torch.bfloat16
    hidden, experts, k, latent = c.hidden_size, c.num_experts, c.num_experts_per_token, c.routed_expert_hidden_size
    shared_f = c.moe_intermediate_size * c.num_shared_experts
    x = torch.randn(tokens, hidden, device=dev, generator=gen).to(bf)
    router = torch.randn(experts, hidden, device=dev, generator=gen) / hidden ** 0.5
    bias = (torch.randn(experts, device=dev, generator=gen) * 0.1).to(bf)
    weights, indices = naive.moe_route_logits(F.linear(x.float(), router), bias, k)
    rows = torch.randn(experts * tokens, latent, device=dev, generator=gen).to(bf)
    gemm_out = torch.randn(tokens, latent + 2 * shared_f, device=dev, generator=gen).to(bf)
    norm_w = torch.rand(latent, device=dev, generator=gen).to(bf) + 0.5
    rank, rope, heads, v_dim = c.kv_lora_rank, c.qk_rope_head_dim, c.num_attention_heads, c.v_head_dim
    kv = torch.randn(tokens, rank + rope + 64, device=dev, generator=gen).to(bf)[:, 64:]
    pool = torch.randn(8 * tokens + 8, rank + rope, device=dev, generator=gen).to(bf)
    where = torch.randperm(pool.shape[0], device=dev, generator=gen)[:tokens]
    kv_norm = torch.rand(rank, device=dev, generator=gen).to(bf) + 0.5
    o = torch.randn(heads, tokens, v_dim, device=dev, generator=gen).to(bf)
    gate = torch.randn(tokens, heads * v_dim + 32, device=dev, generator=gen).to(bf)[:, 32:]
    combine_args = (rows, indices, weights, tokens, 1, norm_w, c.rms_norm_eps, gemm_out[:, latent:], "situ",
                    c.situ_beta, c.situ_linear_beta)
    pools = (pool.clone(), pool.clone())

    def write(module, target):
        module.mla_latent_write(kv, kv_norm, c.rms_norm_eps, target, where)
        return target

    return {
        "moe_route_logits (+ GEMM)": (lambda: moe_router_triton.moe_route_logits(F.linear(x.float(), router), bias, k),
                                      lambda: naive.moe_route_logits(F.linear(x.float(), router), bias, k)),
        "moe_align": (lambda: moe_align_triton.moe_align(indices, experts), lambda: naive.moe_align(indices, experts)),
        "moe_combine": (lambda: moe_combine_triton.moe_combine(*combine_args), lambda: naive.moe_combine(*combine_args)),
        "mla_latent_write": (lambda: write(mla_latent_write_triton, pools[0]), lambda: write(naive, pools[1])),
        "gated_heads": (lambda: gated_heads_triton.gated_heads(o, gate), lambda: naive.gated_heads(o, gate)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--out", default="bench/results/serve_glue.json")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda" if torch.cuda.is_available() else "cpu").manual_seed(0)
    rows = []
    print(f"{'kernel':<28} {'tokens':>6} {'max |diff|':>11} {'fused us':>9} {'torch us':>9} {'speedup':>8}")
    for tokens in args.tokens:
        for name, (fused, reference) in cases(tokens, gen).items():
            diff = max_diff(fused(), reference())
            fused_us, torch_us = device_us(fused), device_us(reference)
            rows.append({"kernel": name, "tokens": tokens, "max_abs_diff": diff, "fused_us": fused_us,
                         "torch_us": torch_us})
            print(f"{name:<28} {tokens:>6} {diff:>11.3g} {fused_us:>9.1f} {torch_us:>9.1f} {torch_us / fused_us:>7.1f}x",
                  flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                                           "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
