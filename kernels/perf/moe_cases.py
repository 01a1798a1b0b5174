"""Latent-MoE routed-expert decode with MXFP4 weights on the H200 (GPU only).

    python -m kernels.perf.moe_cases [--variants sweep|default]   # prints the table and per-kernel times
    ncu ... python -m kernels.perf.moe_cases --variants default --once   # one untimed launch per batch
    K3_MOE_VARIANTS=sweep python -m bench.kernels --only moe   # the sweep's rows into kernels.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from functools import partial
from typing import NamedTuple

import torch

from k3core.quant.mxfp4 import BLOCK, dequantize, quantize
from kernels.moe import latent_moe_decode_triton, naive
from kernels.moe.prepared_experts import PreparedExperts, prepare_experts
from kernels.moe.tiles import Tile
from kernels.perf.harness import Row, copy_bandwidth, kernel_ms, rel_err, time_ms

E, L, F, TOP_K = 256, 2048, 1024, 16


class Variant(NamedTuple):
    """One timed configuration: the two kernels' tiles (None: the launcher's default_tiles for the batch) and
    the batches it is timed at (empty: all)."""

    gate_up: Tile | None
    down: Tile | None
    batches: tuple[int, ...] = ()
    gluon_stages: int | None = None  # the gate/up step's Gluon stages (None: the launcher's; 0: Triton kernel)
    gluon_down_stages: int | None = None  # the same for the down step
    gluon_wgmma: bool | None = None  # gate/up on warpgroup MMAs (None: the launcher's choice by T k)
    gluon_down_wgmma: bool = False  # down on warpgroup MMAs
    gluon_fp8: bool = False  # experts prepared with gate_up_fp8: gate/up on FP8 warpgroup MMAs (decode_fp8_gluon)
    down_fp8: bool = False  # with gluon_fp8, down_fp8 too: down on FP8 warpgroup MMAs (decode_fp8_down_gluon)
    gluon_fused: bool | None = None  # gate/up and down in one launch (None: the launcher's fused_by_default)

    def label(self) -> str:
        gate_up, down = (t.label() if t else "default" for t in (self.gate_up, self.down))
        gu_form, down_form = ({None: "", 0: ",triton"}.get(s, f",gluon s{s}")
                              for s in (self.gluon_stages, self.gluon_down_stages))
        wgmma = {None: "", True: ",wgmma", False: ",mma"}[self.gluon_wgmma]
        down_wgmma = ",wgmma" if self.gluon_down_wgmma else ""
        fp8, down_fp8 = (",fp8" if f else "" for f in self.layout())
        fused = {None: "", True: ",one launch", False: ",two launches"}[self.gluon_fused]
        return f"ours(gu={gate_up}{gu_form}{wgmma}{fp8},down={down}{down_form}{down_wgmma}{down_fp8}{fused})"

    def layout(self) -> tuple[bool, bool]:
        """prepare_experts' (gate_up_fp8, down_fp8) for this variant."""
        return self.gluon_fp8, self.gluon_fp8 and self.down_fp8

    def tuning(self) -> dict:
        """The launcher's keyword arguments for this variant."""
        return {"gate_up_tile": self.gate_up, "down_tile": self.down, "gluon_stages": self.gluon_stages,
                "gluon_down_stages": self.gluon_down_stages, "gluon_wgmma": self.gluon_wgmma,
                "gluon_down_wgmma": self.gluon_down_wgmma, "gluon_fused": self.gluon_fused}

    def runs_at(self, T: int) -> bool:
        return not self.batches or T in self.batches


# (gate/up tile, down tile) pairs: default_tiles' two choices and the session-5 default
# (three stages, the down reduction split in two at T = 1). Each row of the sweep times both kernels, so every
# gate/up tile and every down tile is measured on its own (kernels_ms). Slower and no longer swept: register
# caps with 4-warp tiles (history 19); 1-warp tiles, 64x64 gate/up, 4 and 8 warps (history 23); one stage,
# L2 prefetch, dependent launches (history 25); the gate/up reduction split between a program's warps
# (history 28).
# Last two pairs: history 27's candidates for T = 1 / 4, measured slower there and kept as measured points
# (twice the warps per SM of the default at ~22 SASS instructions per weight word instead of 19, each weight
# decoded once: 4 warps on the default's rows, or 2 warps on half the rows and twice the programs).
SWEEP = ((Tile(64, 128, 2, 2), Tile(128, 128, 2, 2)), (Tile(64, 128, 2, 3, 168), Tile(128, 128, 2, 3, 168)),
         (Tile(64, 128, 2), Tile(128, 128, 2, splits=2)), (Tile(64, 128, 4, 2), Tile(128, 128, 4, 2)),
         (Tile(32, 128, 2, 2), Tile(64, 128, 2, 2)))
VARIANTS = (Variant(None, None),)
# The launcher's defaults, the Triton kernels at the default tiles (the Gluon ones' control, history 32)
# and the sweep's pairs (whole-row storage, history 25's control, left the product).
SWEEP_VARIANTS = (*VARIANTS, Variant(None, None, gluon_stages=0, gluon_down_stages=0),
                  *(Variant(*pair) for pair in SWEEP))
MAX_REL_ERR = 1e-2  # a variant further than this from the float32 oracle is wrong, whatever its time


def variants() -> tuple:
    """K3_MOE_VARIANTS=sweep times every SWEEP_VARIANTS entry (bench.kernels --only moe records them all)."""
    return SWEEP_VARIANTS if os.environ.get("K3_MOE_VARIANTS") == "sweep" else VARIANTS


def _experts(dev: str = "cuda"):
    # Quantise in chunks of experts: the float32 copy of all of them at once would be large.
    packs = []
    for rows, cols in ((2 * F, L), (L, F)):
        parts = [quantize(torch.randn(16, rows, cols, device=dev) * cols**-0.5) for _ in range(E // 16)]
        packs += [torch.cat([p for p, _ in parts]), torch.cat([s for _, s in parts])]
    return packs


def expert_bytes(ids: torch.Tensor) -> float:
    """Packed weights + scales of every distinct expert, each read once per step."""
    per_expert = 2 * F * L // 2 + 2 * F * L // BLOCK + L * F // 2 + L * F // BLOCK
    return float(ids.unique().numel() * per_expert)


def routings(T: int, gen: torch.Generator | None = None) -> list[torch.Tensor]:
    """L2-fair routings for batch T: E // (T k) sets (at most 16, at least 1) that timed calls cycle through,
    each sharing no expert with the set before it (nor the last with the first), so no call finds its
    experts' bytes in the L2 from the call before (real decode reads every other layer in between). T = 1:
    the sets split one permutation of the experts (16 x 16 = all 256; 53.5 MB a call, more than the H200's
    50 MB L2). T > 1: each token chooses k experts at random among those the neighbouring sets do not use
    (~57 distinct a call at T = 4, as uniform routing over all 256 gives; >= 80 MB a call); tokens 0 and 1
    always share one. One set at T = 16 (~165 experts, 0.5 GB a call). [T, k] int32 ids per set (CPU)."""
    sets = max(1, min(16, E // (T * TOP_K)))
    if T == 1:
        return [part.reshape(1, TOP_K).int() for part in torch.randperm(E, generator=gen)[:sets * TOP_K].chunk(sets)]
    out: list[torch.Tensor] = []
    for s in range(sets):
        banned = torch.zeros(E, dtype=torch.bool)
        for neighbour in ([out[-1]] if out else []) + ([out[0]] if s == sets - 1 and s > 1 else []):
            banned[neighbour.flatten().long()] = True
        pool = (~banned).nonzero().flatten()
        ids = torch.stack([pool[torch.randperm(pool.numel(), generator=gen)[:TOP_K]] for _ in range(T)]).int()
        if not (ids[1] == ids[0, 0]).any():
            ids[1, 0] = ids[0, 0]
        out.append(ids)
    return out


def _torch_peer(x, ids, weights, packs):
    """Plain torch: dequantise every selected expert to bf16, then batched matvecs."""
    gu_p, gu_s, d_p, d_s = packs
    flat = ids.reshape(-1).long()
    w_gu = dequantize(gu_p[flat], gu_s[flat])  # [T*k, 2F, l] bf16
    xs = x.repeat_interleave(ids.shape[1], dim=0).unsqueeze(-1)
    gate_up = torch.bmm(w_gu, xs).squeeze(-1).float()
    h = naive.situ_glu_fused(gate_up).to(x.dtype)
    y = torch.bmm(dequantize(d_p[flat], d_s[flat]), h.unsqueeze(-1)).squeeze(-1).float()
    return (y.reshape(*ids.shape, L) * weights.unsqueeze(-1)).sum(1).to(x.dtype)


def prepare_layouts(packs, tiles: tuple[Variant, ...]) -> dict[tuple[bool, bool], PreparedExperts]:
    """The experts in each layout the variants read (`Variant.layout`), each prepared once, as at weight load (a
    product stores one layout; the bench each)."""
    return {layout: prepare_experts(*packs, *layout) for layout in {v.layout() for v in tiles}}


def precompile(batches: tuple[int, ...], tiles: tuple[Variant, ...],
               prepared: dict[tuple[bool, bool], PreparedExperts], device: str = "cuda") -> None:
    """Build every (batch, variant) specialization in parallel processes before timing: one process
    compiling them one by one would spend most of a short device session in ptxas. Each variant is recorded
    on the experts of its own layout (`prepared`, from `prepare_layouts`), so the FP8 variants build their
    own kernels. The kernels land in Triton's on-disk cache, where the timed launches find them."""
    from kernels.compile_check import FP_FUSION_ENV, compile_specs, record_launches

    os.environ.update(FP_FUSION_ENV)  # the workers build with it and Triton's cache key includes it

    with record_launches() as recorder:
        for T in batches:
            x = torch.empty(T, L, device=device, dtype=torch.bfloat16)
            ids = torch.zeros(T, TOP_K, device=device, dtype=torch.int32)
            for v in tiles:
                if v.runs_at(T):
                    latent_moe_decode_triton.latent_moe_decode_prepared(x, ids, ids.float(), prepared[v.layout()],
                                                                        **v.tuning())
    compile_specs(recorder.unique(), workers=max(1, (os.cpu_count() or 2) - 2))


def _cycling(calls: list):
    """One call that runs `calls` in turn, a different one each time (graph capture records them in turn)."""
    turn = itertools.cycle(calls)
    return lambda: next(turn)()


def moe_rows(batches: tuple[int, ...] = (1, 4, 16), tiles: tuple[Variant, ...] | None = None, peer: bool = True,
             on_row=lambda row: None) -> list[Row]:
    """Rows per batch and variant, timed L2-fair (`routings`: every timed call reads experts that are not in
    the L2; the bytes are each call's distinct experts, averaged over the sets); the error is the first
    set's against the float32 oracle."""
    rows: list[Row] = []
    tiles = tiles or variants()
    packs = _experts()
    prepared = prepare_layouts(packs, tiles)
    if len(tiles) > 1:
        try:
            precompile(batches, tiles, prepared)
        except Exception as e:  # noqa: BLE001 - only a head start: the timed launches compile what is missing
            print(f"precompile failed, compiling at first launch: {e!r}"[:500], flush=True)
    for T in batches:
        sets = [ids.cuda() for ids in routings(T)]
        xs = [torch.randn(T, L, device="cuda", dtype=torch.bfloat16) for _ in sets]
        ws = [torch.rand(T, TOP_K, device="cuda") for _ in sets]
        nbytes = sum(expert_bytes(ids) for ids in sets) / len(sets)
        inner = len(sets) * max(1, 16 // len(sets))  # whole turns through the sets per replay
        ref = naive.latent_moe_decode(xs[0].float(), sets[0], ws[0], *packs)  # float32 h and output: the oracle
        shape = f"T={T},E={E},k={TOP_K},l={L},F={F},mxfp4,sets={len(sets)}"
        for v in (v for v in tiles if v.runs_at(T)):
            chosen = prepared[v.layout()]
            calls = [partial(latent_moe_decode_triton.latent_moe_decode_prepared, x, ids, w, chosen, **v.tuning())
                     for x, ids, w in zip(xs, sets, ws, strict=True)]
            try:
                err = rel_err(calls[0](), ref)
                ms, how = time_ms(_cycling(calls), inner=inner)
                extra = {"rel_err_vs_reference": err, "kernels_ms": kernel_ms(_cycling(calls), calls=inner),
                         "l2_fair_sets": len(sets)}
                if not err <= MAX_REL_ERR:  # wrong results never count as the fastest variant
                    ms, how = float("nan"), f"WRONG: rel err {err:.1e}"
            except Exception as e:  # noqa: BLE001 - a variant that does not build must not hide the others
                ms, how, extra = float("nan"), f"failed: {e!r}"[-300:], {}
            rows.append(Row("latent_moe_decode", shape, v.label(), ms, nbytes, note=how, extra=extra))
            on_row(rows[-1])
        if peer:
            peers = [partial(_torch_peer, x, ids, w, packs) for x, ids, w in zip(xs, sets, ws, strict=True)]
            ms, how = time_ms(_cycling(peers), inner=len(sets), reps=10)
            rows.append(Row("latent_moe_decode", shape, "torch dequantize+bmm", ms, nbytes, note=how))
    return rows


def launch_once(batches: tuple[int, ...], tiles: tuple[Variant, ...]) -> None:
    """Each variant called once per batch on the first L2-fair routing set, untimed: the launches a profiler
    records (`ncu --kernel-name regex:"gate_up|down_kernel" ... python -m kernels.perf.moe_cases --once`;
    Triton compiles before the launch, so the profiled launch is the kernel alone)."""
    packs = _experts()
    experts = prepare_layouts(packs, tiles)
    for T in batches:
        ids = routings(T)[0].cuda()
        x, w = torch.randn(T, L, device="cuda", dtype=torch.bfloat16), torch.rand(T, TOP_K, device="cuda")
        for v in (v for v in tiles if v.runs_at(T)):
            latent_moe_decode_triton.latent_moe_decode_prepared(x, ids, w, experts[v.layout()], **v.tuning())
    torch.cuda.synchronize()


def parse_tiles(text: str) -> tuple[Variant, ...]:
    """"rows,cols,warps,stages[,regs[,splits]]/...[/T...][/G...];..." -> Variants (regs 0: no cap; "T1,4":
    timed at those batches only; "G3": the Gluon gate/up step with 3 stages, "G0": the Triton one; "D3", "D0": the
    same for the down step)."""
    def tile(spec: str) -> Tile:
        return Tile(*(int(v) for v in spec.split(",")))

    def variant(spec: str) -> Variant:
        parts = spec.split("/")
        batches = next((tuple(int(t) for t in p[1:].split(",")) for p in parts[2:] if p.startswith("T")), ())
        stages = next((int(p[1:]) for p in parts[2:] if p.startswith("G")), None)
        down_stages = next((int(p[1:]) for p in parts[2:] if p.startswith("D")), None)
        return Variant(tile(parts[0]), tile(parts[1]), batches=batches, gluon_stages=stages,
                       gluon_down_stages=down_stages)
    return tuple(variant(spec) for spec in text.split(";"))


def main() -> None:
    parser = argparse.ArgumentParser(description="MoE decode variant sweep")
    parser.add_argument("--variants", choices=("default", "sweep"), default="sweep")
    parser.add_argument("--tiles", help="tile pairs instead of --variants (see parse_tiles)")
    parser.add_argument("--batches", default="1,4,16", help="decode batch sizes T, comma-separated")
    parser.add_argument("--json", help="JSON file rewritten after each measured row (with the copy ceiling)")
    parser.add_argument("--once", action="store_true", help="launch each variant once per batch, untimed (for ncu)")
    args = parser.parse_args()
    tiles = parse_tiles(args.tiles) if args.tiles else SWEEP_VARIANTS if args.variants == "sweep" else VARIANTS
    batches = tuple(int(t) for t in args.batches.split(","))
    if args.once:
        launch_once(batches, tiles)
        return
    copy_bps = copy_bandwidth()
    print(f"copy {copy_bps / 1e12:.2f} TB/s; {torch.cuda.get_device_name()}", flush=True)
    done: list[dict] = []

    def show(r: Row) -> None:
        frac = r.bytes / (r.ms * 1e-3) / copy_bps
        err = r.extra.get("rel_err_vs_reference", float("nan"))
        print(f"{r.shape:<36} {r.impl:<60} {r.ms * 1e3:8.1f} us {100 * frac:5.1f} % err {err:.1e} "
              f"{r.extra.get('kernels_ms', r.note)}", flush=True)
        if args.json:
            done.append({**r.as_dict(), "copy_bytes_per_s": copy_bps})
            with open(args.json, "w") as f:
                json.dump(done, f, indent=1)

    moe_rows(batches, tiles=tiles, peer=False, on_row=show)


if __name__ == "__main__":
    main()
