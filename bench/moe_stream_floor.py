"""Pure-read floor of the latent-MoE decode's expert bytes (GPU; `--cpu`: a dry run of the plumbing).

    python -m bench.moe_stream_floor [--batches 1,4,16] [--product 1,4] [--out bench/results/moe_stream_floor_s11.json]
    TRITON_INTERPRET=1 python -m bench.moe_stream_floor --cpu     # tiny experts, interpreted, no timing

The MoE bar (issue 9) is >= 70 % of copy bandwidth on the expert bytes a decode call reads. These kernels read
exactly those bytes (the routed experts' prepared gate/up and down words and multipliers, blocked storage from
kernels.moe.mxfp4_tile_triton.prepare, the L2-fair routings of kernels.perf.moe_cases) and XOR-fold them into
one int32 per program, with no decode and no MMA: the best a read of this size achieves in the forms the
product could take (two dependent launches, one launch, a persistent grid, TMA bulk copies). Each row is
timed with the harness against the same run's copy bandwidth, with the share of the 70 % bar's time budget
(bytes / (0.7 x copy)) the read alone already uses.

A work item is one contiguous range of ITEM words of one matrix of one expert (a 32-row stored block is 8192
gate/up or 4096 down words) and the multipliers of the same rows and columns (ITEM / 16 int32: one byte per
4 words, stored in the same blocked order, so chunk c of the words and chunk c of the multipliers match).
"""

from __future__ import annotations

import argparse
import json
from typing import NamedTuple

import torch

from k3core.cache.hashing import xor_fold
from kernels._triton import tl, triton
from kernels.moe.mxfp4_tile_triton import BLOCK_ROWS
from kernels.moe.prepared_experts import PreparedExperts, prepare_experts
from kernels.perf import harness, moe_cases

GATE_UP, DOWN = 0, 1  # an item's matrix: column 0 of the item table
BAR = 0.70  # issue 9's MoE bar: this share of copy bandwidth on the expert bytes


def matrices(experts: PreparedExperts) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """(words int32 [E, R * row words], multipliers viewed as int32 [E, R * row words / 16]) per matrix."""
    return tuple((w.reshape(w.shape[0], -1), m.reshape(m.shape[0], -1).view(torch.int32))
                 for w, m in ((experts.gate_up_words, experts.gate_up_mults),
                              (experts.down_words, experts.down_mults)))


def work_items(ids: torch.Tensor, experts: PreparedExperts, item_words: int, kinds=(GATE_UP, DOWN)) -> torch.Tensor:
    """int32 [n, 2] (matrix, chunk): every chunk of `item_words` words (and its multipliers) of the distinct
    experts in `ids`, for the matrices `kinds`, matrix-major (gate/up first, as the product reads them)."""
    distinct = ids.flatten().long().unique().cpu()
    parts = []
    for kind in kinds:
        words = matrices(experts)[kind][0]
        per_expert = words.shape[1]
        if per_expert % item_words or item_words % 16:
            raise ValueError(f"item of {item_words} words must split {per_expert} and be a multiple of 16")
        chunks = per_expert // item_words
        chunk = (distinct[:, None] * chunks + torch.arange(chunks)).flatten()
        parts.append(torch.stack([torch.full_like(chunk, kind), chunk], 1))
    return torch.cat(parts).int()


def item_bytes(items: torch.Tensor, item_words: int) -> float:
    """Bytes the items read: 4-byte words plus one multiplier byte per 4 words."""
    return float(items.shape[0] * item_words * 17 // 4)


@triton.jit
def stream_items_kernel(items, n_items, gu_words, gu_mults, down_words, down_mults, out,
                        ITEM: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """Program p reads items p, p + P, ... (P programs: one per item, or a persistent grid): ITEM words in
    ITEM / BLOCK unrolled plain loads and ITEM / 16 multiplier words; out[p] = their XOR fold."""
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    acc_m = tl.zeros([ITEM // 16], dtype=tl.int32)
    for i in tl.range(tl.program_id(0), n_items, tl.num_programs(0), num_stages=STAGES):
        gate_up = tl.load(items + 2 * i) == 0
        chunk = tl.load(items + 2 * i + 1).to(tl.int64)
        w = tl.where(gate_up, gu_words, down_words) + chunk * ITEM
        m = tl.where(gate_up, gu_mults, down_mults) + chunk * (ITEM // 16)
        for s in tl.static_range(ITEM // BLOCK):
            acc ^= tl.load(w + s * BLOCK + tl.arange(0, BLOCK))
        acc_m ^= tl.load(m + tl.arange(0, ITEM // 16))
    tl.store(out + tl.program_id(0), tl.xor_sum(acc, 0) ^ tl.xor_sum(acc_m, 0))


class Launch(NamedTuple):
    """One kernel launch over the items of the matrices `kinds`."""

    kinds: tuple[int, ...]
    item: int  # words a work item
    programs: int = 0  # 0: one program per item; else a persistent grid of this many programs
    warps: int = 4
    block: int = 1024  # words a load
    stages: int = 1  # software-pipelined items (tl.range stages; persistent grids only)
    tma: bool = False  # the Gluon TMA ring (bench.moe_stream_floor_tma) instead of plain loads


class Form(NamedTuple):
    name: str
    launches: tuple[Launch, ...]


GU_BLOCK, DOWN_BLOCK = 32 * 256, 32 * 128  # words of one 32-row stored block of each matrix (l 2048, F 1024)
FORMS = (
    Form("two launches, 32-row items, 4 warps", (Launch((GATE_UP,), GU_BLOCK), Launch((DOWN,), DOWN_BLOCK))),
    Form("two launches, 32-row items, 8 warps",
         (Launch((GATE_UP,), GU_BLOCK, warps=8, block=2048), Launch((DOWN,), DOWN_BLOCK, warps=8, block=2048))),
    Form("two launches, 4096-word items, 4 warps", (Launch((GATE_UP,), 4096), Launch((DOWN,), 4096))),
    Form("one launch, 4096-word items, 4 warps", (Launch((GATE_UP, DOWN), 4096),)),
    Form("one launch, 4096-word items, 8 warps", (Launch((GATE_UP, DOWN), 4096, warps=8, block=2048),)),
    Form("persistent 132 x 8 warps", (Launch((GATE_UP, DOWN), 4096, programs=132, warps=8, block=2048),)),
    Form("persistent 264 x 4 warps", (Launch((GATE_UP, DOWN), 4096, programs=264),)),
    Form("persistent 264 x 4 warps, 2 stages", (Launch((GATE_UP, DOWN), 4096, programs=264, stages=2),)),
    Form("TMA ring, persistent 132, 8 stages", (Launch((GATE_UP, DOWN), 4096, programs=132, stages=8, tma=True),)),
    Form("TMA ring, persistent 264, 4 stages", (Launch((GATE_UP, DOWN), 4096, programs=264, stages=4, tma=True),)),
)


def launcher(launch: Launch, ids: torch.Tensor, experts: PreparedExperts):
    """A call that runs `launch` over the items of experts `ids`, returning its int32 folds."""
    (gu_w, gu_m), (d_w, d_m) = matrices(experts)
    items = work_items(ids, experts, launch.item, launch.kinds).to(gu_w.device)
    n = items.shape[0]
    grid = min(launch.programs, n) if launch.programs else n
    out = torch.empty(grid, dtype=torch.int32, device=gu_w.device)
    if launch.tma:
        from bench.moe_stream_floor_tma import tma_launcher

        return tma_launcher(items, (gu_w, gu_m, d_w, d_m), out, launch.item, launch.stages, launch.warps)

    def call() -> torch.Tensor:
        stream_items_kernel[(grid,)](items, n, gu_w, gu_m, d_w, d_m, out, ITEM=launch.item, BLOCK=launch.block,
                                     STAGES=launch.stages, num_warps=launch.warps)
        return out
    return call


def form_call(form: Form, ids: torch.Tensor, experts: PreparedExperts):
    """The form's launches in order (the down launch after gate/up's, as the product's dependency)."""
    calls = [launcher(launch, ids, experts) for launch in form.launches]
    return lambda: [call() for call in calls]


def xor_all(t: torch.Tensor) -> int:
    """XOR of every element of an int32 tensor, as an unsigned 32-bit int (k3core.cache.hashing.xor_fold on the
    sign-extended values: their low 32 bits are the int32 XOR)."""
    return int(xor_fold(t.flatten().long()[None])[0]) & 0xFFFFFFFF if t.numel() else 0


def fold(outs: list[torch.Tensor]) -> int:
    """XOR of every program's fold: items that read each byte once XOR to the experts' whole fold."""
    return xor_all(torch.cat([o.flatten() for o in outs]))


def expected_fold(ids: torch.Tensor, experts: PreparedExperts) -> int:
    """The oracle: XOR of every word and multiplier word of the distinct experts in `ids`, in torch."""
    distinct = ids.flatten().long().unique().to(experts.gate_up_words.device)
    return xor_all(torch.cat([t[distinct].flatten() for pair in matrices(experts) for t in pair]))


class Recorder:
    """Completes each row with its share of copy and of the 70 % bar's time budget, prints it and rewrites the
    JSON file (a run cut short keeps what it measured)."""

    def __init__(self, copy_bps: float, path: str) -> None:
        self.copy_bps, self.path, self.rows = copy_bps, path, []

    def __call__(self, row: dict) -> None:
        nbytes, us = row["bytes"], row["us"]
        row.update(copy_bytes_per_s=self.copy_bps, pct_of_copy=100 * nbytes / (us * 1e-6) / self.copy_bps,
                   bar_budget_us=nbytes / (BAR * self.copy_bps) * 1e6)
        row["share_of_bar_budget"] = us / row["bar_budget_us"]
        self.rows.append(row)
        kernels = [round(v * 1e3, 1) for v in row.get("kernels_ms", {}).values() if isinstance(v, float)]
        print(f"{row['form']:<44} T={row['T']:<3} {us:7.1f} us {row['pct_of_copy']:5.1f} % of copy "
              f"{100 * row['share_of_bar_budget']:5.1f} % of the 70 % budget ({row['bar_budget_us']:.1f} us) "
              f"kernels {kernels}{'' if row.get('ok') else '  WRONG/FAILED ' + row.get('error', '')}", flush=True)
        with open(self.path, "w") as f:
            json.dump(self.rows, f, indent=1)


def floor_rows(T: int, forms: tuple[Form, ...], experts: PreparedExperts, record: Recorder) -> None:
    """Each form at batch T over moe_cases' L2-fair routing sets (a different set each call); a row's `ok`:
    its fold of the first set equals the torch oracle's."""
    sets = [ids.cuda() for ids in moe_cases.routings(T)]
    nbytes = sum(moe_cases.expert_bytes(ids) for ids in sets) / len(sets)
    inner = len(sets) * max(1, 16 // len(sets))  # whole turns through the sets per replay, as moe_rows
    want = expected_fold(sets[0], experts)
    for form in forms:
        calls = [form_call(form, ids, experts) for ids in sets]
        row = {"form": form.name, "T": T, "bytes": nbytes, "sets": len(sets)}
        try:
            ok = fold(calls[0]()) == want
            ms, how = harness.time_ms(moe_cases._cycling(calls), inner=inner)
            row.update(us=ms * 1e3, method=how, ok=ok,
                       kernels_ms=harness.kernel_ms(moe_cases._cycling(calls), calls=inner))
        except Exception as e:  # noqa: BLE001 - a form that does not build must not hide the others
            row.update(us=float("nan"), error=repr(e)[-300:])
        record(row)


def product_rows(batches: tuple[int, ...], record: Recorder) -> None:
    """The product's default call (decode + MMAs) timed alike in the same run: the floors' reference."""
    def on_row(r) -> None:
        record({"form": "product default (decode + MMA)", "T": int(r.shape.split(",")[0][2:]), "bytes": r.bytes,
                "us": r.ms * 1e3, "method": r.note, "ok": r.ms == r.ms, "kernels_ms": r.extra.get("kernels_ms", {}),
                "rel_err": r.extra.get("rel_err_vs_reference")})
    moe_cases.moe_rows(batches, tiles=moe_cases.VARIANTS, peer=False, on_row=on_row)


def dry_run(forms: tuple[Form, ...]) -> None:
    """CPU: tiny experts through every Triton form (interpreted): each fold must equal the torch oracle."""
    from k3core.quant.mxfp4 import quantize

    gen = torch.Generator().manual_seed(0)
    E, L, F = 6, 256, 64
    experts = prepare_experts(*quantize(torch.randn(E, 2 * F, L, generator=gen)),
                              *quantize(torch.randn(E, L, F, generator=gen)))
    ids = torch.tensor([[4, 1, 4]], dtype=torch.int32)
    small = {GU_BLOCK: 2 * F * L // 8 // 4, DOWN_BLOCK: BLOCK_ROWS * F // 8, 4096: 256}  # words, scaled down
    for form in forms:
        launches = tuple(la._replace(item=small[la.item], block=64, programs=min(la.programs, 3))
                         for la in form.launches if not la.tma)
        if launches:
            got = fold(form_call(form._replace(launches=launches), ids, experts)())
            assert got == expected_fold(ids, experts), form.name
            print(f"{form.name:<44} fold ok (interpreted, {len(launches)} launch(es))")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--forms", help="substrings of the form names to run, comma-separated (default: all)")
    parser.add_argument("--out", default="bench/results/moe_stream_floor_s11.json")
    parser.add_argument("--product", default="", help="batches to time the product's default call at too")
    parser.add_argument("--cpu", action="store_true", help="dry run on tiny experts (TRITON_INTERPRET=1)")
    args = parser.parse_args()
    forms = tuple(f for f in FORMS if not args.forms or any(s in f.name for s in args.forms.split(",")))
    if args.cpu:
        dry_run(forms)
        return
    copy_bps = harness.copy_bandwidth()
    print(f"copy {copy_bps / 1e12:.3f} TB/s; {torch.cuda.get_device_name()}", flush=True)
    record = Recorder(copy_bps, args.out)
    experts = prepare_experts(*moe_cases._experts())
    product = tuple(int(t) for t in args.product.split(",") if t)
    batches = [int(t) for t in args.batches.split(",")]
    for T in batches:
        floor_rows(T, forms, experts, record)
        if product and T == max(product):  # after the floors it is compared with, before larger T
            product_rows(product, record)
    if product and max(product) not in batches:
        product_rows(product, record)


if __name__ == "__main__":
    main()
