"""TTFT of a long prompt uncached, then with its prefix restored from the prefix cache (bench/serve.py's TTFT
section, or alone over several sizes):

    python -m bench.serve_ttft [--model mini] --prefix 32768 131072 --increment 512 4096 [--num-pages 3000]

Each row: the first prefill of the row (`warmup_s`: an unrelated prompt of a full-budget chunk and a short
tail, `warm_up`; in a fresh process it
includes the one-time JIT of the prefill kernels, which a worker pays once at start, not per request, so
it is reported and kept out of the rows below), a second such prompt (`warmup_again_s`), the prompt uncached,
its first prefix hit (`hit_cold_s`: the first restore of that entry) and the median of two more hits with
other increments (`hit_warm_s`), with one hit's time split into admission (lookup, integrity check,
restore copies), forward, and step commit (snapshot of the new prompt end). Each row's prefix has its own
tokens, so no row hits another's. With two or more prefix sizes at one increment, the uncached time is fit
as a*P + b*P^2 (the MLA attention is quadratic) and the hit as c + d*P, and both are extrapolated to
`--extrapolate` tokens (the K3 report's 400K-token prefix).
`--compare` measures every row twice in one process: `reference` (K3_PREFILL_FASTPATH=0: the reference
layers for the whole prefill forward, and MLA values unpadded, so SDPA's memory-efficient kernel), then
`fast` (the default: services/engine/fast_prefill.py, values padded for flash attention); `--check`
compares the two forms' logits of one uncached prompt.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TypeVar

import torch

from bench.serve_rank import Rank, random_model, set_environ, sync
from k3core.layers import mla
from k3core.model import K3Model
from k3core.presets import preset
from kernels.perf import harness
from services.engine import fast_prefill

T = TypeVar("T")
WARMUP_TAIL = 7  # warm-up prompts: one full-budget chunk and this unaligned tail, as a worker's warm-up runs


def gemm_flops_per_s(device: str) -> float:
    """Dense bf16 matmul throughput measured here (the kernel benchmark's `harness.matmul_flops`; float32 on
    the CPU, wall time): the compute roofline of the rows."""
    if device.startswith("cuda"):
        return harness.matmul_flops()
    n = 1024
    a, b = (torch.randn(n, n, device=device) for _ in range(2))
    a @ b
    reps = 10
    return 2 * n**3 * reps / _timed(lambda: [a @ b for _ in range(reps)])[0]


def forward_flops(model: K3Model, context: int, new: int) -> float:
    """Matmul FLOPs of one prefill forward of `new` tokens after `context` cached ones: every token through
    the weights it reads (the routed experts' share top_k / E), each MLA layer's expansion of every cached
    latent into keys and values, and its attention of the new queries over their causal keys."""
    c = model.config
    dense = experts = 0
    for name, param in model.named_parameters():
        if "embed_tokens" not in name and "lm_head" not in name:
            if ".experts." in name:
                experts += param.numel()
            else:
                dense += param.numel()
    active = dense + experts * c.num_experts_per_token / max(c.num_experts, 1)
    mla, heads = len(c.mla_layers), c.num_attention_heads
    expand = 2 * (context + new) * c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim)
    attend = 2 * heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim) * new * (context + (new + 1) / 2)
    return 2 * active * new + mla * (expand + attend)


def prompt_flops(model: K3Model, start: int, end: int, chunk: int) -> float:
    """FLOPs of prefilling tokens [start, end) in forwards of at most `chunk` tokens."""
    return sum(forward_flops(model, pos, min(chunk, end - pos)) for pos in range(start, end, chunk))


def _timed(run: Callable[[], T]) -> tuple[float, T]:
    """(seconds, result) of `run()`, the device synced before and after."""
    sync()
    started = time.perf_counter()
    out = run()
    sync()
    return time.perf_counter() - started, out


def _prefill(rank: Rank, rid: str, tokens: list[int], keep_turn: bool = False) -> tuple[float, int]:
    """(seconds to the first token, prompt tokens served by the cache) of one prompt, then finished."""
    seconds, (_, hit) = _timed(lambda: rank.prefill(rid, tokens))
    rank.finish([rid], keep_turn)
    return seconds, hit


def _split(rank: Rank, rid: str, tokens: list[int]) -> dict[str, float]:
    """One hit's seconds by phase (each phase synced, so they add up to a little more than the hit)."""
    phases = {"admission_s": 0.0, "forward_s": 0.0, "commit_s": 0.0}
    targets = [(rank.manager, "add_request", "admission_s"), (rank.manager, "pre_forward", "admission_s"),
               (rank.runner, "forward", "forward_s"), (rank.manager, "forward_done", "commit_s"),
               (rank.manager, "commit_step", "commit_s")]
    for obj, name, phase in targets:
        def timed(*args, _call=getattr(obj, name), _phase=phase, **kwargs):
            seconds, out = _timed(lambda: _call(*args, **kwargs))
            phases[_phase] += seconds
            return out

        setattr(obj, name, timed)  # an instance attribute over the method, removed below
    try:
        _prefill(rank, rid, tokens)
    finally:
        for obj, name, _ in targets:
            delattr(obj, name)
    return phases


def warm_up(rank: Rank, row: int) -> list[float]:
    """Seconds of two warm-up prompts of a full-budget chunk and an unaligned tail, then (where the prefill
    fast path runs) its row-count classes, as a worker's warm-up runs them: every kernel variant the rows
    need, so no JIT compile falls in the timed prefills (a 2048-token warm-up chunk once left the
    8192-token chunks' router kernel uncompiled)."""
    vocab, length = rank.vocab, rank.budget + WARMUP_TAIL
    warm = [_prefill(rank, f"warm{row}.{k}", [(t * (5 + k) + 31 * row) % vocab + 1 for t in range(length)])[0]
            for k in range(2)]
    for rows in fast_prefill.WARMUP_ROWS if rank.runner.prefill_fastpath() is not None else ():
        _prefill(rank, f"warm{row}r{rows}", [(t * 3 + row) % vocab + 1 for t in range(rows)])
    return warm


def ttft(rank: Rank, prefix: list[int], increment: int, row: int = 0, peak: float | None = None) -> dict:
    """Time to first token of `prefix` + `increment` new tokens, uncached and with the prefix cached (MLA
    blocks + the KDA checkpoint at the prefix end). `row` keeps the request ids and warm-up prompts of
    several calls on one rank apart. `work_ratio` is the uncached over the hit matmul FLOPs: the speedup if
    both ran equally efficiently; with `peak` (FLOP/s), each one's time at that roofline too."""
    tag = str(row)
    warm = warm_up(rank, row)
    budget = rank.budget
    rank.budget = math.gcd(budget, len(prefix))  # a forward ends at the prefix: its checkpoint is kept
    try:
        uncached, _ = _prefill(rank, f"miss{tag}", prefix + [5] * increment, keep_turn=True)
        cold, hit = _prefill(rank, f"hit{tag}", prefix + [9] * increment)
        warm_hits = [_prefill(rank, f"hit{tag}w{k}", prefix + [20 + k] * increment)[0] for k in range(2)]
        phases = _split(rank, f"hit{tag}s", prefix + [30] * increment)
    finally:
        rank.budget = budget
    cached = statistics.median(warm_hits)
    model, total = rank.runner.model, len(prefix) + increment
    work = {"uncached_tflop": prompt_flops(model, 0, total, math.gcd(budget, len(prefix))) / 1e12,
            "hit_tflop": prompt_flops(model, hit, total, budget) / 1e12}
    work["work_ratio"] = work["uncached_tflop"] / work["hit_tflop"]
    if peak:
        work |= {"uncached_roof_s": work["uncached_tflop"] * 1e12 / peak, "hit_roof_s": work["hit_tflop"] * 1e12 / peak}
    return {"prefix": len(prefix), "increment": increment, "warmup_s": warm[0], "warmup_again_s": warm[1],
            "uncached_s": uncached, "hit_cold_s": cold, "hit_warm_s": cached, "cached_s": cached,
            "hit_split": phases, "hit_tokens": hit, "speedup": uncached / cached, "speedup_cold": uncached / cold,
            **work}


def extrapolate(rows: list[dict], target: int) -> dict | None:
    """Uncached a*P + b*P^2 and hit c + d*P through the two largest prefixes of the most common increment,
    at `target` prefix tokens; None without two prefix sizes at one increment."""
    increment = statistics.mode(r["increment"] for r in rows)
    same = sorted({r["prefix"]: r for r in rows if r["increment"] == increment}.values(), key=lambda r: r["prefix"])
    if len(same) < 2:
        return None
    (p1, u1, h1), (p2, u2, h2) = ((r["prefix"], r["uncached_s"], r["hit_warm_s"]) for r in same[-2:])
    b = (u2 / p2 - u1 / p1) / (p2 - p1)
    a = u1 / p1 - b * p1
    d = (h2 - h1) / (p2 - p1)
    uncached, hit = a * target + b * target**2, h1 + d * (target - p1)
    return {"prefix": target, "increment": increment, "from_prefixes": [p1, p2], "uncached_s": uncached,
            "hit_s": hit, "speedup": uncached / hit}


FORMS = ("reference", "fast")  # --compare's prefill forms, in the order measured


@contextmanager
def prefill_form(form: str) -> Iterator[None]:
    """The prefill as `form` (one of FORMS; see the module docstring), the previous settings restored after."""
    env, padded = os.environ.get(fast_prefill.ENV), mla.PAD_VALUES_FOR_FLASH
    fast = form == "fast"
    set_environ({fast_prefill.ENV: "1" if fast else "0"})
    mla.PAD_VALUES_FOR_FLASH = fast
    try:
        yield
    finally:
        mla.PAD_VALUES_FOR_FLASH = padded
        set_environ({fast_prefill.ENV: env})


def form_check(rank: Rank, length: int) -> dict[str, float | bool]:
    """Last-token logits of one prompt shorter than a hash block (never cached), in both FORMS."""
    prompt = [(37 * j) % rank.vocab + 1 for j in range(length)]
    logits = []
    for k, form in enumerate(FORMS):
        with prefill_form(form):
            _prefill(rank, f"check{k}", prompt)
        logits.append(rank.last_logits.float())
    diff = (logits[0] - logits[1]).abs().max().item()
    return {"max_abs_diff": diff, "scale": logits[0].abs().max().item(),
            "same_argmax": bool(logits[0].argmax() == logits[1].argmax())}


def prefill_rank(args: argparse.Namespace, longest: int) -> tuple[Rank, torch.dtype]:
    """A rank on seeded random weights (bf16 on CUDA, float32 on the CPU) whose runner is sized for one
    sequence of `longest` prompt tokens and no decode steps."""
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = random_model(preset(args.model), args.device, dtype)
    sizing = argparse.Namespace(**{**vars(args), "prefix": longest, "increment": 0, "batches": [1],
                                   "contexts": [0], "steps": 0})
    return Rank(model, args.model, sizing, dtype), dtype


def prefix_tokens(length: int, row: int, vocab: int) -> list[int]:
    """A prefix of its own per row (the first token already differs, so no row hits another's cache)."""
    return [(11 * j + 17 * row) % vocab + 1 for j in range(length)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mini")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prefix", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--increment", type=int, nargs="+", default=[4096], help="one, or one per prefix")
    parser.add_argument("--num-pages", type=int, default=3000)
    parser.add_argument("--hash-block", type=int, default=512)
    parser.add_argument("--budget", type=int, default=8192, help="prefill tokens per forward")
    parser.add_argument("--extrapolate", type=int, default=400_000)
    parser.add_argument("--time-limit", type=float, default=300.0, help="skip rows that would start after this")
    parser.add_argument("--compare", action="store_true", help="each row with the reference prefill, then the fast one")
    parser.add_argument("--check", action="store_true", help="the two prefill forms' logits of one prompt")
    parser.add_argument("--out", default="bench/results/serve_ttft.json")
    args = parser.parse_args()
    increments = args.increment * len(args.prefix) if len(args.increment) == 1 else args.increment
    if len(increments) != len(args.prefix):
        parser.error(f"--increment takes one value or one per prefix ({len(args.prefix)}), got {len(increments)}")
    began = time.perf_counter()
    rank, dtype = prefill_rank(args, max(p + i for p, i in zip(args.prefix, increments, strict=True)))
    model = rank.runner.model
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    peak = gemm_flops_per_s(args.device)
    result: dict = {"model": args.model, "device": f"{device}, torch {torch.__version__}", "dtype": str(dtype),
                    "gemm_flops_per_s": peak, "rows": [], "skipped": []}
    print(f"{args.model} on {device} ({dtype}); dense matmul {peak / 1e12:.0f} TFLOP/s measured (the roofline)")
    if args.check:
        result["check"] = form_check(rank, args.hash_block - 3)
        print("reference / fast logits of one uncached prompt:", result["check"])
    forms = FORMS if args.compare else (None,)
    print(f"{'form':>6} {'prefix':>8} {'incr':>6} {'1st prefill':>11} {'again':>7} {'uncached':>9} {'roof':>7} {'hit cold':>9} "
          f"{'hit warm':>9} {'roof':>7} {'ratio':>6} {'work':>6}  hit split (admission / forward / commit ms)")
    cases = [(length, increment, form) for length, increment in zip(args.prefix, increments, strict=True)
             for form in forms]
    for row, (length, increment, form) in enumerate(cases):
        if time.perf_counter() - began > args.time_limit:
            result["skipped"].append(f"prefix {length} increment {increment} {form or ''}")
            continue
        with prefill_form(form) if form else nullcontext():
            r = ttft(rank, prefix_tokens(length, row, rank.vocab), increment, row, peak)
        r["form"] = form
        split = " / ".join(f"{1e3 * v:.1f}" for v in r["hit_split"].values())
        print(f"{form or '':>6} {length:>8} {increment:>6} {r['warmup_s']:>10.3f}s {r['warmup_again_s']:>6.3f}s "
              f"{r['uncached_s']:>8.3f}s {r['uncached_roof_s']:>6.3f}s {r['hit_cold_s']:>8.3f}s "
              f"{r['hit_warm_s']:>8.3f}s {r['hit_roof_s']:>6.3f}s {r['speedup']:>5.0f}x {r['work_ratio']:>5.0f}x  "
              f"{split}", flush=True)
        result["rows"].append(r)
        save(args.out, result)
    rows = [r for r in result["rows"] if r["form"] in (None, "fast")]
    e = result["extrapolated"] = extrapolate(rows, args.extrapolate) if rows else None
    if e:
        end = e["prefix"] + e["increment"]
        e["work_ratio"] = prompt_flops(model, 0, end, args.budget) / prompt_flops(model, e["prefix"], end, args.budget)
        print(f"extrapolated to {e['prefix']}+{e['increment']} (from {e['from_prefixes']}): uncached "
              f"{e['uncached_s']:.1f} s, hit {e['hit_s']:.3f} s: {e['speedup']:.0f}x (work ratio {e['work_ratio']:.0f}x)")
    result["wall_s"] = time.perf_counter() - began
    save(args.out, result)


def save(path: str, result: dict) -> None:
    """Write a result as JSON (after every row, so a run cut short keeps what it measured; bench.serve too)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
