"""The fused decode-glue kernels (kernels/fused) on the device at the `mini` preset's decode shapes, each
against its peer: max |difference| and device time of both. The peer is the plain-torch reference
composition, except for the experts' gate|up GEMM, whose peer is the form the fast path ran before it
(cuBLAS over the stacked [E*2F, l] weights + the Triton SiTU kernel). The experts' rows also give the rate at
which the weights stream against the device's copy bandwidth measured in the same run (a decode GEMM's
roofline); the routed form's gate|up (each expert over its routed rows) against torch._grouped_mm + the SiTU
kernel on the same rows. `down`: the experts' down projection in Triton against cuBLAS's batched GEMM (the
routed form's against torch._grouped_mm); `mla`: the paged
MLA decode at the serve pool's pages per tiling, against the launcher's rule (bench/serve_glue_gemms.py). At
the sweep's token counts, the router and these kernels run in a few tilings each (the launchers' defaults
first; elsewhere the default tile in both load forms). Last, one whole latent-MoE layer of the fast path
(`MoeDecode`) per token count, in each dense form and the routed form (`K3_DENSE_EXPERTS`) with and without
the router's side branch (`K3_DECODE_BRANCHES`), and in the grouped form, against `SparseMoE` for the difference (its per-expert loop syncs the host:
not timed).
`--groups skinny` (bench/serve_glue_projections.py): every decode projection
(`fast_decoder.distinct_projections`) in the skinny GEMM's candidate tilings against cuBLAS as the fast path
calls it, weights cycled through enough copies to come from HBM. `--groups floor` (the same file): one launch
that only copies each residual-add GEMM's weight (what a GEMM of that size is up against). `--compile-only
--shard I N` launches a share of the cases once (run shards in parallel to fill Triton's cache before a timed
run).

    python -m bench.serve_glue [--model mini] [--tokens 1 16 64 128 256] [--sweep 64] [--out bench/results/serve_glue.json]

Device time: `reps` calls captured in one CUDA graph and replayed (as the fast path runs them): timing eager
calls back to back measures the host's launch rate instead (the first version of this bench did, and its
"fused us" were 20-80 us for kernels that take a few).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.serve_glue_gemms import (
    DOWN_CONFIGS,
    EXPERT_CONFIGS,
    MLA_VARIANTS,
    ROUTED_CONFIGS,
    ROUTED_DOWN_CONFIGS,
    Case,
    default_tiles,
    down_cases,
    expert_cases,
    mla_cases,
    routed_expert_cases,
)
from bench.serve_glue_projections import read_floor_cases, skinny_cases
from bench.serve_rank import copy_bandwidth, set_environ
from k3core.config import K3Config
from k3core.layers.moe import SparseMoE
from k3core.presets import preset
from kernels.fused import (
    gated_heads_triton,
    mla_latent_write_triton,
    moe_align_triton,
    moe_combine_triton,
    moe_router_triton,
    naive,
    rms_norm_rows_triton,
    skinny_gemm_triton,
)
from kernels.perf import harness
from services.engine import fast_ffn
from services.engine.fast_attention import BRANCHES_ENV
from services.engine.fast_ffn import MoeDecode, grouped_mm_available

ROUTER_CONFIGS = [  # (block_t, block_h, num_warps, num_stages, H splits; None: the launcher's rule)
    (16, 256, 4, 4, None), (16, 256, 4, 4, 1), (16, 128, 4, 3, None), (16, 256, 8, 4, None), (64, 256, 4, 3, None)]


def device_us(fn: Callable[[], object], reps: int = 20) -> float:
    """Device microseconds of one call: `reps` calls captured in one CUDA graph, replayed (the kernel
    benchmark's `harness.time_ms`; a case that cannot be captured is an error here, not timed eagerly)."""
    if not torch.cuda.is_available():  # CPU dry run (TRITON_INTERPRET=1): wall time
        fn()
        began = time.perf_counter()
        fn()
        return (time.perf_counter() - began) * 1e6
    ms, method = harness.time_ms(fn, inner=reps)
    if method != "graph":
        raise RuntimeError("a serve_glue case could not be captured in a CUDA graph")
    return ms * 1e3


@contextmanager
def harness_env(values: dict[str, str]) -> Iterator[None]:
    """The environment with `values` set, restored after (a fast-path form chosen while a case runs)."""
    before = {key: os.environ.get(key) for key in values}
    set_environ(dict(values))
    try:
        yield
    finally:
        set_environ(before)


def router_cases(c: K3Config, tokens: int, gen: torch.Generator, configs: list[tuple[int, ...]]) -> dict[str, Case]:
    """The router (logits GEMM + selection) per block shape, against the torch reference."""
    x = torch.randn(tokens, c.hidden_size, device=gen.device, generator=gen).to(torch.bfloat16)
    router = (torch.randn(c.num_experts, c.hidden_size, device=gen.device, generator=gen)
              / c.hidden_size ** 0.5).to(torch.bfloat16)
    bias, k = torch.randn(c.num_experts, device=gen.device, generator=gen) * 0.1, c.num_experts_per_token
    return {f"moe_route t{bt} h{bh} w{warps} s{stages} split{'auto' if sp is None else sp}": (
        lambda t=(bt, bh, warps, stages, sp): moe_router_triton.moe_route(
            x, router, bias, k, block_t=t[0], block_h=t[1], num_warps=t[2], num_stages=t[3], splits=t[4]),
        lambda: naive.moe_route(x, router, bias, k), 0) for bt, bh, warps, stages, sp in configs}


def moe_layer_case(c: K3Config, tokens: int, gen: torch.Generator) -> dict[str, Case]:
    """One latent-MoE layer of the fast path (router to the residual add), random weights as bench.serve's."""
    with torch.device(gen.device):
        moe = SparseMoE(c)
    with torch.no_grad():
        for name, param in moe.named_parameters():
            if name.endswith("norm.weight") or name.endswith("e_score_correction_bias"):
                param.fill_(1.0 if name.endswith("norm.weight") else 0.0)
            else:
                param.normal_(0.0, param.shape[-1] ** -0.5, generator=gen)
    moe = moe.to(torch.bfloat16).eval()
    fast = MoeDecode(moe, c, grouped_mm_available(gen.device, torch.bfloat16))
    x = torch.randn(tokens, c.hidden_size, device=gen.device, generator=gen).to(torch.bfloat16)
    residual = torch.zeros_like(x)
    if not fast.dense(tokens):
        with torch.no_grad():
            diff = float((fast(x) - moe(x)).abs().max())
        return {f"MoeDecode layer (grouped), diff {diff:.3g}": (torch.no_grad()(lambda: fast(x, residual)), None, 0)}
    found: dict[str, Case] = {}
    if fast.grouped:  # the grouped form in the dense range too (a peer of the routed form: the same rows)
        grouped = MoeDecode(moe, c, True)
        grouped.dense = lambda tokens: False
        with torch.no_grad():
            diff = float((grouped(x) - moe(x)).abs().max())
        found[f"MoeDecode layer (grouped, branches 1), diff {diff:.3g}"] = (
            torch.no_grad()(lambda: grouped(x, residual)), None, 0)
    # Each dense form (K3_DENSE_EXPERTS) and the routed one, with the router on a side branch or in the chain
    # (K3_DECODE_BRANCHES), set while its calls are captured.
    for form, branches in itertools.product((*fast_ffn.DENSE_FORMS, fast_ffn.ROUTED_FORM), ("1", "0")):
        settings = {fast_ffn.DENSE_FORM_ENV: form, BRANCHES_ENV: branches}

        def call(settings=settings):
            with harness_env(settings), torch.no_grad():
                return fast(x, residual)
        with harness_env(settings), torch.no_grad():
            diff = float((fast(x) - moe(x)).abs().max())
        kind = form if form == fast_ffn.ROUTED_FORM else f"dense {form}"
        found[f"MoeDecode layer ({kind}, branches {branches}), diff {diff:.3g}"] = (call, None, 0)
    return found


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
    q_lora = c.q_lora_rank or hidden
    mla_in = torch.randn(tokens, q_lora + rank + rope, device=dev, generator=gen).to(bf)  # [q_a | kv_a]
    q_norm = torch.rand(q_lora, device=dev, generator=gen).to(bf) + 0.5
    combine_args = (rows, indices, weights, tokens, 1, norm_w, c.rms_norm_eps, gemm_out[:, latent:], "situ",
                    c.situ_beta, c.situ_linear_beta)
    pools = (pool.clone(), pool.clone())

    def write(module, target):
        module.mla_latent_write(kv, kv_norm, c.rms_norm_eps, target, where)
        return target

    return {
        "moe_align": (lambda: moe_align_triton.moe_align(indices, experts), lambda: naive.moe_align(indices, experts)),
        "moe_combine": (lambda: moe_combine_triton.moe_combine(*combine_args), lambda: naive.moe_combine(*combine_args)),
        "mla_latent_write": (lambda: write(mla_latent_write_triton, pools[0]), lambda: write(naive, pools[1])),
        "gated_heads": (lambda: gated_heads_triton.gated_heads(o, gate), lambda: naive.gated_heads(o, gate)),
        # the peer: what the fast path ran before (torch's rms_norm copies the strided slice first)
        "rms_norm_rows (q_a slice)": (lambda: rms_norm_rows_triton.rms_norm_rows(mla_in[:, :q_lora], q_norm, 1e-6),
                                      lambda: F.rms_norm(mla_in[:, :q_lora], (q_lora,), q_norm, 1e-6)),
    }


GROUPS = ("glue", "router", "experts", "down", "mla", "layer", "skinny", "floor")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mini", help="preset whose shapes are timed (nano for a CPU dry run)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 128, 256])
    parser.add_argument("--sweep", type=int, nargs="*", default=[64], help="token counts of the block-shape sweep")
    parser.add_argument("--groups", nargs="+", default=list(GROUPS), choices=GROUPS, help="which cases to time")
    parser.add_argument("--out", default="bench/results/serve_glue.json")
    parser.add_argument("--compile-only", action="store_true",
                        help="launch each fused case once, time nothing (fills Triton's cache: run shards in parallel)")
    parser.add_argument("--shard", type=int, nargs=2, default=(0, 1), metavar=("I", "N"),
                        help="only every N-th case, from the I-th")
    args = parser.parse_args()
    config = preset(args.model)
    on_gpu = torch.cuda.is_available()
    gen = torch.Generator(device="cuda" if on_gpu else "cpu").manual_seed(0)
    copy = copy_bandwidth("cuda", 1 << 30) / 1e9 if on_gpu else float("nan")
    print(f"copy bandwidth {copy:.0f} GB/s (the experts' GEMM roofline)")
    rows = []
    print(f"{'kernel':<60} {'tokens':>6} {'max |diff|':>11} {'fused us':>9} {'peer us':>9} {'speedup':>8} "
          f"{'fused GB/s':>10} {'of copy':>8}")
    for tokens in args.tokens:
        sweep = tokens in args.sweep
        groups = set(args.groups)
        timed = {name: (*pair, 0) for name, pair in cases(config, tokens, gen).items()} if "glue" in groups else {}
        if "router" in groups:
            timed |= router_cases(config, tokens, gen, ROUTER_CONFIGS if sweep else ROUTER_CONFIGS[:1])
        dense_range = tokens <= fast_ffn.DENSE_MAX_TOKENS  # the dense experts' and routed forms' (MoeDecode.dense)
        if dense_range and "experts" in groups:
            timed |= expert_cases(config, tokens, gen, EXPERT_CONFIGS if sweep else default_tiles(EXPERT_CONFIGS))
        if dense_range and "down" in groups:
            timed |= down_cases(config, tokens, gen, DOWN_CONFIGS if sweep else default_tiles(DOWN_CONFIGS))
        if dense_range and {"experts", "down"} & groups:  # the routed form's (sweep: every tiling, else default)
            timed |= routed_expert_cases(
                config, tokens, gen, (ROUTED_CONFIGS if sweep else ROUTED_CONFIGS[:1]) if "experts" in groups else [],
                (ROUTED_DOWN_CONFIGS if sweep else ROUTED_DOWN_CONFIGS[:1]) if "down" in groups else [])
        if "mla" in groups and sweep:
            timed |= mla_cases(config, tokens, gen, MLA_VARIANTS)
        if "skinny" in groups and tokens <= skinny_gemm_triton.MAX_ROWS:
            timed |= skinny_cases(config, tokens, gen, sweep)
        if "floor" in groups and tokens == max(args.tokens):  # no rows: once
            timed |= read_floor_cases(config, gen)
        if "layer" in groups:
            timed |= moe_layer_case(config, tokens, gen)
        for index, (name, (fused, reference, weight_bytes)) in enumerate(timed.items()):
            if index % args.shard[1] != args.shard[0]:
                continue
            if args.compile_only:
                fused()
                continue
            diff = max_diff(fused(), reference()) if reference else float("nan")
            fused_us = device_us(fused)
            peer_us = device_us(reference) if reference else float("nan")
            gbps = weight_bytes / fused_us / 1e3
            rows.append({"kernel": name, "tokens": tokens, "max_abs_diff": diff, "fused_us": fused_us,
                         "peer_us": peer_us, "weight_gbps": gbps or None, "of_copy": gbps / copy if gbps else None,
                         "peer_gbps": weight_bytes / peer_us / 1e3 if weight_bytes else None})
            rate = f"{gbps:>10.0f} {gbps / copy:>7.0%}" if gbps else ""
            print(f"{name:<60} {tokens:>6} {diff:>11.3g} {fused_us:>9.1f} {peer_us:>9.1f} "
                  f"{peer_us / fused_us:>7.1f}x {rate}", flush=True)
    if args.compile_only:
        return
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name() if on_gpu else "cpu",
                                           "copy_gbps": copy, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
