"""Benchmark of every kernel in kernels/ against its peer and the H200's measured ceilings (GPU only).

    python -m bench.kernels [--only kda_decode,kda_verify,mla,...] [--out bench/results/kernels.json]

Checks each kernel on fresh random inputs against its reference, measures copy bandwidth and bf16 matmul
throughput in the same process, times every kernel and its peer (CUDA-graph replay, CUDA events, median
after warm-up), prints one table and writes JSON. fla-core 0.6.0 must be importable for the fla peers.
An `--only` run merges into an existing JSON: the kernels it measured replace their old rows, the other
kernels' rows stay, each row keeping the copy ceiling of the run that measured it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from importlib import import_module

import torch

from kernels.perf.harness import Row, copy_bandwidth, matmul_flops

GROUPS: dict[str, tuple[str, str]] = {
    "kda_decode": ("kernels.perf.kda_decode_cases", "decode_rows"),
    "kda_verify": ("kernels.perf.kda_verify_cases", "verify_rows"),
    "kda_prefill": ("kernels.perf.kda_prefill_cases", "prefill_rows"),
    "mla": ("kernels.perf.mla_cases", "mla_rows"),
    "attnres": ("kernels.perf.attnres_cases", "attnres_rows"),
    "attnres_phase1": ("kernels.perf.attnres_cases", "phase1_rows"),
    "attnres_decode": ("kernels.perf.attnres_decode_cases", "decode_rows"),
    "moe": ("kernels.perf.moe_cases", "moe_rows"),
}
PEER_PREFIXES = ("fla", "torch", "baseline")


def _is_peer(row: Row) -> bool:
    return row.impl.startswith(PEER_PREFIXES)


def summarise(rows: list[Row], ceilings: list[float]) -> list[dict]:
    """Per (kernel, shape): our best variant, the peer, the ratio, and the fraction of copy bandwidth (the
    ceiling measured in the row's own run)."""
    out = []
    ceiling = {id(r): c for r, c in zip(rows, ceilings, strict=True)}
    keys = list(dict.fromkeys((r.kernel, r.shape) for r in rows))
    for kernel, shape in keys:
        group = [r for r in rows if (r.kernel, r.shape) == (kernel, shape) and not math.isnan(r.ms)]
        ours = [r for r in group if not _is_peer(r)]
        peers = [r for r in group if _is_peer(r)]
        if not ours:
            continue
        best = min(ours, key=lambda r: r.ms)
        entry = {"kernel": kernel, "shape": shape, "ours": best.impl, "ours_ms": best.ms}
        if best.bytes:
            entry["ours_copy_bw_frac"] = best.bytes / (best.ms * 1e-3) / ceiling[id(best)]
        for p in peers:
            entry.setdefault("peers", {})[p.impl] = {"ms": p.ms, "speedup": p.ms / best.ms}
        out.append(entry)
    return out


def print_table(rows: list[Row], copy_bps: float) -> None:
    print(f"{'kernel':<18} {'shape':<34} {'impl':<40} {'ms':>9} {'GB/s':>7} {'%copy':>6}  note")
    for r in rows:
        bw = r.bytes / (r.ms * 1e-3) if r.bytes and not math.isnan(r.ms) else float("nan")
        frac = 100 * bw / copy_bps
        print(f"{r.kernel:<18} {r.shape:<34} {r.impl:<40} {r.ms:>9.4f} {bw / 1e9:>7.0f} {frac:>6.1f}  {r.note}")


def merged_rows(rows: list[Row], copy_bps: float, previous: dict | None) -> tuple[list[Row], list[float]]:
    """This run's rows after the rows of `previous` (an earlier JSON) for kernels this run did not measure."""
    fresh = {r.kernel for r in rows}
    kept, ceilings = [], []
    if previous:
        fields = set(Row.__dataclass_fields__)
        for d in previous.get("rows", []):
            if d["kernel"] not in fresh:
                kept.append(Row(**{k: v for k, v in d.items() if k in fields}))
                ceilings.append(d.get("copy_bytes_per_s", previous["ceilings"]["copy_bytes_per_s"]))
    return kept + rows, ceilings + [copy_bps] * len(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(GROUPS), help="comma-separated groups: " + ",".join(GROUPS))
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "bench/results"), "kernels.json"))
    parser.add_argument("--merge-from", default="bench/results/kernels.json",
                        help="earlier results whose other kernels' rows an --only run keeps")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.kernels needs a CUDA device (run it on the lent H200)", file=sys.stderr)
        return 2
    torch.manual_seed(int(time.time()))  # fresh inputs every run
    copy_bps, mm_flops = copy_bandwidth(), matmul_flops()
    print(f"ceilings: copy {copy_bps / 1e12:.2f} TB/s (read+write), bf16 matmul {mm_flops / 1e12:.0f} TFLOP/s")
    rows: list[Row] = []
    errors = {}
    for name in args.only.split(","):
        module, func = GROUPS[name]
        started = time.time()
        try:
            fn: Callable[[], list[Row]] = getattr(import_module(module), func)
            rows += fn()
        except Exception as e:  # noqa: BLE001 - one broken group must not hide the others' numbers
            errors[name] = repr(e)[-1500:]
            print(f"group {name} failed: {e!r}", file=sys.stderr)
        print(f"[{name}: {time.time() - started:.0f} s]", file=sys.stderr, flush=True)
    print_table(rows, copy_bps)
    previous = None
    if args.only != ",".join(GROUPS) and os.path.exists(args.merge_from):
        with open(args.merge_from) as f:
            previous = json.load(f)
    all_rows, ceilings = merged_rows(rows, copy_bps, previous)
    result = {
        "card": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": import_module("triton").__version__, "python": platform.python_version(),
        "ceilings": {"copy_bytes_per_s": copy_bps, "bf16_matmul_flop_per_s": mm_flops},
        "rows": [{**r.as_dict(), "copy_bytes_per_s": c} for r, c in zip(all_rows, ceilings, strict=True)],
        "summary": summarise(all_rows, ceilings), "errors": errors,
    }
    try:
        result["fla"] = import_module("fla").__version__
    except Exception:  # noqa: BLE001 - kept rows keep the fla version of the run that measured them
        result["fla"] = (previous or {}).get("fla")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
