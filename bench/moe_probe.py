"""Memory probe of the latent-MoE decode (GPU only): the gate/up kernel's loads without its decode and MMA.

    python -m bench.moe_probe [--out bench/results/moe_probe.json]

Streams exactly the bytes the gate/up kernel (kernels.moe.latent_moe_decode_triton) reads for the routed
experts: the same grid (distinct expert x row block), the same addresses (`block_offsets` of the blocked
storage; and of whole rows, history 25's control, which only the probe builds), words and multipliers of
the gate and up rows a 128-column step at a time through `tl.range` stages, XOR-folded into one value per
program; and the same words read as flat ranges with plain loads. Against the same run's copy bandwidth:
what the memory path can give this kernel's loads, so the decode kernel's own time separates into memory
and compute (docs/kernels.md, history 25). Note: the same experts are re-read by every graph replay, so at
T=1 their bytes can come from the L2.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import NamedTuple

import torch

from k3core.quant.mxfp4_device import decode_multipliers, device_words
from kernels._triton import tl, triton
from kernels.moe.mxfp4_tile_triton import SHIFT, block_offsets, block_words, prepare
from kernels.perf import harness, moe_cases


@triton.jit
def tile_stream_kernel(ids, words, mults, out, F, L: tl.constexpr, BR: tl.constexpr, G: tl.constexpr,
                       CW: tl.constexpr, STAGES: tl.constexpr):
    """Program (i, j): expert ids[i], gate rows j BR .. + BR and the up rows F below, all L columns, G groups
    a step; out[i, j] = sum of the XOR fold of the words plus that of the multipliers."""
    e = tl.load(ids + tl.program_id(0)).to(tl.int64)
    rows = tl.program_id(1) * BR + tl.arange(0, BR)
    w, m = words + e * (2 * F) * (L // 8), mults + e * (2 * F) * (L // 32)
    acc = tl.zeros([BR, 4 * G], dtype=tl.int32)
    acc_m = tl.zeros([BR, G], dtype=tl.int32)
    for g0 in tl.range(0, L // 32, G, num_stages=STAGES):
        cols = g0 * 4 + tl.arange(0, 4 * G)
        groups = g0 + tl.arange(0, G)
        acc ^= tl.load(w + block_offsets(rows, cols, L // 8, CW)) ^ tl.load(w + block_offsets(rows + F, cols, L // 8, CW))
        acc_m ^= (tl.load(m + block_offsets(rows, groups, L // 32, CW // 4)).to(tl.int32)
                  ^ tl.load(m + block_offsets(rows + F, groups, L // 32, CW // 4)).to(tl.int32))
    tl.store(out + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tl.sum(acc) + tl.sum(acc_m))


@triton.jit
def flat_stream_kernel(ids, words, out, EXPERT_WORDS: tl.constexpr, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    """Program (i, j): words j BLOCK STEPS .. of expert ids[i] as one flat range (plain loads, unrolled)."""
    e = tl.load(ids + tl.program_id(0)).to(tl.int64)
    base = words + e * EXPERT_WORDS + tl.program_id(1) * (BLOCK * STEPS)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for s in tl.static_range(STEPS):
        acc ^= tl.load(base + s * BLOCK + tl.arange(0, BLOCK))
    tl.store(out + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tl.sum(acc))


class GateUp(NamedTuple):
    """Gate/up words [E, 2F, l / 8] and multiplier fields [E, 2F, l / 32] stored in blocks of `block_words`
    words a row (`prepare`'s layout) or row by row (block_words = l / 8)."""

    words: torch.Tensor
    mults: torch.Tensor
    block_words: int


def storages(packed: torch.Tensor, scales: torch.Tensor) -> dict[str, GateUp]:
    """The decoder's blocked storage (`prepare`) and the whole-row control of the same gate/up pack."""
    words = packed.shape[-1] // 4
    return {"blocked": GateUp(*prepare(packed, scales), block_words(words)),
            "rows": GateUp(device_words(packed), decode_multipliers(scales, SHIFT), words)}


def tile_stream(ids: torch.Tensor, gate_up: GateUp, rows: int, warps: int, stages: int) -> torch.Tensor:
    """[len(ids), F / rows] int32 folds of tile_stream_kernel over the gate/up words of experts `ids`."""
    E, two_f, words = gate_up.words.shape
    F, L = two_f // 2, words * 8
    out = torch.empty(ids.numel(), F // rows, dtype=torch.int32, device=ids.device)
    tile_stream_kernel[(ids.numel(), F // rows)](ids, gate_up.words, gate_up.mults, out, F, L=L, BR=rows, G=4,
                                                 CW=gate_up.block_words, STAGES=stages, num_warps=warps)
    return out


def flat_stream(ids: torch.Tensor, words: torch.Tensor, block: int, steps: int, warps: int) -> torch.Tensor:
    expert_words = words[0].numel()
    out = torch.empty(ids.numel(), expert_words // (block * steps), dtype=torch.int32, device=ids.device)
    flat_stream_kernel[out.shape](ids, words, out, EXPERT_WORDS=expert_words, BLOCK=block, STEPS=steps,
                                  num_warps=warps)
    return out


def probes(ids: torch.Tensor, gate_ups: dict[str, GateUp]) -> dict[str, tuple[Callable[[], object], float]]:
    """label -> (call, bytes it reads) for the distinct experts `ids` (`gate_ups`: `storages`)."""
    E, two_f, words = gate_ups["blocked"].words.shape
    n = ids.numel()
    tile_bytes = n * two_f * words * 17 // 4  # 4-byte words and their multipliers (one byte per 4 words)
    calls: dict[str, tuple[Callable[[], object], float]] = {}
    for storage, gate_up in gate_ups.items():
        for rows, warps in ((64, 2), (128, 4)):
            for stages in (1, 2, 3, 5) if storage == "blocked" and rows == 64 else (3,):
                calls[f"tile_stream {storage} {rows}x128 w{warps} s{stages}"] = (
                    lambda g=gate_up, r=rows, w=warps, s=stages: tile_stream(ids, g, r, w, s), tile_bytes)
    for block, steps, warps in ((1024, 8, 4), (2048, 8, 8), (4096, 4, 8)):
        calls[f"flat_stream words {block}x{steps} w{warps}"] = (
            lambda b=block, s=steps, w=warps: flat_stream(ids, gate_ups["blocked"].words, b, s, w),
            n * two_f * words * 4)
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/moe_probe.json")
    args = parser.parse_args()
    E, K = moe_cases.E, moe_cases.TOP_K
    copy_bps = harness.copy_bandwidth()
    gate_ups = storages(*moe_cases._experts()[:2])
    rows = []
    print(f"copy {copy_bps / 1e12:.3f} TB/s; {torch.cuda.get_device_name()}")
    for T in (1, 16):
        routed = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(T)])
        ids = routed.unique().int().contiguous()
        for label, (call, nbytes) in probes(ids, gate_ups).items():
            ms, how = harness.time_ms(call)
            frac = nbytes / (ms * 1e-3) / copy_bps
            print(f"T={T:<3} experts={ids.numel():<4} {label:<40} {ms * 1e3:7.1f} us {100 * frac:6.1f} % of copy")
            rows.append({"T": T, "experts": ids.numel(), "probe": label, "us": ms * 1e3, "bytes": nbytes,
                         "copy_bytes_per_s": copy_bps, "method": how})
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
