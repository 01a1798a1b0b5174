"""The fused decode-glue kernels (kernels/fused) on the device at the `mini` preset's decode shapes, each
against its peer: max |difference| and device time of both. The peer is the plain-torch reference
composition, except for the experts' GEMMs, whose peer is the form the fast path ran before them (cuBLAS
over the stacked weights + the Triton SiTU kernel; cuBLAS's batched GEMM). Those rows also give the rate at
which the experts' weights stream, against the device's copy bandwidth measured in the same run (the
roofline of a decode GEMM), and a few block shapes of the fused kernels at the sweep's token counts.

    python -m bench.serve_glue [--model mini] [--tokens 1 16 64 128 256] [--sweep 64] [--out bench/results/serve_glue.json]

Device time: `reps` calls captured in one CUDA graph and replayed (as the fast path runs them): timing eager
calls back to back measures the host's launch rate instead (the first version of this bench did, and its
"fused us" were 20-80 us for kernels that take a few).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from k3core.config import K3Config
from k3core.presets import preset
from kernels.fused import (
    expert_gemm_triton,
    gated_heads_triton,
    mla_latent_write_triton,
    moe_align_triton,
    moe_combine_triton,
    moe_router_triton,
    naive,
)
from kernels.moe import situ_glu_triton

EXPERT_CONFIGS = [  # (block_n, block_k, num_warps, num_stages); the launchers' defaults first
    (64, 64, 4, 4), (32, 64, 4, 5), (64, 64, 4, 3), (32, 128, 4, 4), (64, 128, 4, 3), (128, 64, 8, 3)]
WEIGHT_COPIES = 3  # distinct weight sets cycled through the timed calls: 150-300 MB, far past the 50 MB L2


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


def copy_gbps(gen: torch.Generator, mib: int = 512) -> float:
    """The device's copy bandwidth (read + write bytes per second) in GB/s: a decode GEMM's roofline."""
    src = torch.empty(mib << 20, dtype=torch.uint8, device=gen.device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / device_us(lambda: dst.copy_(src), reps=10) / 1e3


def weight_copies(shape: tuple[int, ...], gen: torch.Generator) -> list[torch.Tensor]:
    """WEIGHT_COPIES random bf16 weights of `shape`, to cycle through (each timed form its own cycle, both
    starting at the first copy, so their first outputs compare on equal inputs)."""
    return [(torch.randn(shape, device=gen.device, generator=gen) / shape[-1] ** 0.5).to(torch.bfloat16)
            for _ in range(WEIGHT_COPIES)]


def expert_cases(c: K3Config, tokens: int, gen: torch.Generator, configs: list[tuple[int, int, int, int]]
                 ) -> dict[str, tuple[Callable, Callable, int]]:
    """name -> (fused, the previous fast-path form, weight bytes read per call) for the dense experts."""
    dev, bf = gen.device, torch.bfloat16
    experts, ffn, latent = c.num_experts, c.moe_intermediate_size, c.routed_expert_hidden_size
    h = torch.randn(tokens, 4 * latent, device=dev, generator=gen).to(bf)
    z = h[:, :latent]  # a column slice of the x GEMM's output, as in MoeDecode
    act = torch.randn(experts, tokens, ffn, device=dev, generator=gen).to(bf)
    w13s, w2s = weight_copies((experts, 2 * ffn, latent), gen), weight_copies((experts, latent, ffn), gen)
    beta = (c.situ_beta, c.situ_linear_beta)

    def gate_up_cublas(w13: torch.Tensor) -> torch.Tensor:
        gate_up = F.linear(z, w13.view(experts * 2 * ffn, latent)).view(tokens * experts, 2 * ffn)
        return situ_glu_triton.situ_glu_fused(gate_up, *beta).view(tokens, experts, ffn).transpose(0, 1)

    def each_call(fn: Callable[[torch.Tensor], torch.Tensor], weights: list[torch.Tensor]) -> Callable[[], torch.Tensor]:
        cycle = itertools.cycle(weights)
        return lambda: fn(next(cycle))

    out = {}
    for n, k, warps, stages in configs:
        tune = {"block_n": n, "block_k": k, "num_warps": warps, "num_stages": stages}
        out[f"expert_gate_up_glu n{n} k{k} w{warps} s{stages}"] = (
            each_call(lambda w, t=tune: expert_gemm_triton.expert_gate_up_glu(z, w, "situ", *beta, **t), w13s),
            each_call(gate_up_cublas, w13s), experts * 2 * ffn * latent * 2)
        out[f"expert_down n{n} k{k} w{warps} s{stages}"] = (
            each_call(lambda w, t=tune: expert_gemm_triton.expert_down(act, w, **t), w2s),
            each_call(lambda w: torch.bmm(act, w.transpose(1, 2)), w2s), experts * latent * ffn * 2)
    return out


def max_diff(a: object, b: object) -> float:
    pairs = zip(a, b, strict=True) if isinstance(a, tuple) else [(a, b)]
    return max(float((x.double() - y.double()).abs().max()) for x, y in pairs)


def cases(c: K3Config, tokens: int, gen: torch.Generator) -> dict[str, tuple[Callable, Callable]]:
    """name -> (fused launch, torch reference) on the model's shapes at `tokens` decode rows."""
    dev, bf = gen.device, torch.bfloat16
    hidden, experts, k, latent = c.hidden_size, c.num_experts, c.num_experts_per_token, c.routed_expert_hidden_size
    shared_f = c.moe_intermediate_size * c.num_shared_experts
    x = torch.randn(tokens, hidden, device=dev, generator=gen).to(bf)
    router = (torch.randn(experts, hidden, device=dev, generator=gen) / hidden ** 0.5).to(bf)
    bias = (torch.randn(experts, device=dev, generator=gen) * 0.1).to(bf)
    weights, indices = naive.moe_route(x, router, bias, k)
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
        "moe_route": (lambda: moe_router_triton.moe_route(x, router, bias, k), lambda: naive.moe_route(x, router, bias, k)),
        "moe_align": (lambda: moe_align_triton.moe_align(indices, experts), lambda: naive.moe_align(indices, experts)),
        "moe_combine": (lambda: moe_combine_triton.moe_combine(*combine_args), lambda: naive.moe_combine(*combine_args)),
        "mla_latent_write": (lambda: write(mla_latent_write_triton, pools[0]), lambda: write(naive, pools[1])),
        "gated_heads": (lambda: gated_heads_triton.gated_heads(o, gate), lambda: naive.gated_heads(o, gate)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mini", help="preset whose shapes are timed (nano for a CPU dry run)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 128, 256])
    parser.add_argument("--sweep", type=int, nargs="*", default=[64], help="token counts of the block-shape sweep")
    parser.add_argument("--out", default="bench/results/serve_glue.json")
    args = parser.parse_args()
    config = preset(args.model)
    gen = torch.Generator(device="cuda" if torch.cuda.is_available() else "cpu").manual_seed(0)
    copy = copy_gbps(gen) if torch.cuda.is_available() else float("nan")
    print(f"copy bandwidth {copy:.0f} GB/s (the experts' GEMM roofline)")
    rows = []
    print(f"{'kernel':<36} {'tokens':>6} {'max |diff|':>11} {'fused us':>9} {'peer us':>9} {'speedup':>8} "
          f"{'fused GB/s':>10} {'of copy':>8}")
    for tokens in args.tokens:
        configs = EXPERT_CONFIGS if tokens in args.sweep else EXPERT_CONFIGS[:1]
        timed = {name: (*pair, 0) for name, pair in cases(config, tokens, gen).items()}
        if tokens <= 128:  # the dense experts' range (MoeDecode._dense)
            timed |= expert_cases(config, tokens, gen, configs)
        for name, (fused, reference, weight_bytes) in timed.items():
            diff = max_diff(fused(), reference())
            fused_us, torch_us = device_us(fused), device_us(reference)
            gbps = weight_bytes / fused_us / 1e3
            rows.append({"kernel": name, "tokens": tokens, "max_abs_diff": diff, "fused_us": fused_us,
                         "peer_us": torch_us, "weight_gbps": gbps or None, "of_copy": gbps / copy if gbps else None})
            rate = f"{gbps:>10.0f} {gbps / copy:>7.0%}" if gbps else ""
            print(f"{name:<36} {tokens:>6} {diff:>11.3g} {fused_us:>9.1f} {torch_us:>9.1f} "
                  f"{torch_us / fused_us:>7.1f}x {rate}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                                           "copy_gbps": copy, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
