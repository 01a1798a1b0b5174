"""Block AttnRes at decode as a served step pays for it (GPU only; `bench.kernels --only attnres_decode`).

A decode step runs inside a CUDA graph, where each AttnRes kernel follows another kernel: a merge follows
the previous sublayer's last GEMM (or, at a block's first site, phase 1's apply), phase 1 follows the block
that completed. So besides the merge timed back to back (the harness: `inner` copies of one launch in a
graph), each merge is timed after a stand-in sublayer kernel that writes its partial sum (`torch.mul`, a
plain elementwise kernel), as the pair's time minus the stand-in's alone; and a whole forward's AttnRes
work (every block's copy, logits and apply, every site's merge, a stand-in between merges) minus its
stand-ins alone, for each `Form`.

Bytes (the least that must move; the same count for every form, so the fractions compare times): a merge
reads its statistics (float32 accumulator, max, denominator) and the partial sum where there is one and
writes RMSNorm(h); h itself is not counted (nothing reads it at serving time; the baseline writes it). A
phase 1 as `attnres_cases.phase1_bytes(..., copy=True)`.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch

from k3core.ops.attnres import attnres_inter
from k3core.presets import preset
from kernels.attnres import block_logits_triton, inter_triton, merge_norm_triton
from kernels.attnres.query_parts import query_parts
from kernels.perf.attnres_cases import forward_phases, launch_floor_rows, phase1_bytes
from kernels.perf.harness import Row, time_ms

BF16 = torch.bfloat16
MERGE_SHAPES = ((64, 7168), (64, 2048), (8192, 7168))  # K3 and mini at decode, K3 at prefill


@dataclass(frozen=True)
class Form:
    """How a decode forward launches its AttnRes kernels."""

    name: str
    fused_copy: bool = False  # the completed block copied into the block buffer by its logits kernel
    store_h: bool = True  # the merges write h as well as RMSNorm(h)
    branched: bool = False  # the merges fold in the newest block; phase 1 a block early, on a side branch


BASELINE = Form("baseline: session-7 form")  # copy launch, logits, apply; merges store h
SERVED_S8 = Form("fused copy (served in session 8)", True)
FORMS = (BASELINE, SERVED_S8, Form("fused copy, no h", True, False),
         Form("branched: newest block in the merges, phase 1 on a side branch", True, True, True),
         Form("branched, no h", True, False, True))
# Programmatic dependent launch of the merges and of the apply (session 8) measured slower: removed.
MERGE_FORMS = (("baseline: h stored", {}), ("no h", {"store_h": False}))


def merge_bytes(M: int, dim: int, with_partial: bool) -> int:
    """Least bytes of one merge as served: statistics and partial sum read, RMSNorm(h) written (see above)."""
    return M * dim * (4 + (2 if with_partial else 0) + 2) + M * 8


def merge_inputs(M: int, dim: int, device: str = "cuda") -> tuple:
    """One merge's bf16 inputs at M rows: (max, denominator, accumulator, query) of a site's phase-1 stats
    over 3 blocks, a partial sum, the norm weight, the key-norm weight."""
    gen = torch.Generator(device=device).manual_seed(M + dim)
    blocks = torch.randn(3, M, dim, device=device, dtype=BF16, generator=gen)
    queries = torch.randn(4, dim, device=device, dtype=BF16, generator=gen) * dim**-0.5
    key_w = (torch.rand(4, dim, device=device, generator=gen) + 0.5).to(BF16)
    stats = attnres_inter(queries, blocks, key_w).row(2)
    source = torch.randn(M, dim, device=device, dtype=BF16, generator=gen)
    out_w = (torch.rand(dim, device=device, generator=gen) + 0.5).to(BF16)
    return (stats.max, stats.denom, stats.acc.contiguous(), queries[2]), source, out_w, key_w[2]


def merge_rows(shapes: tuple[tuple[int, int], ...] = MERGE_SHAPES) -> list[Row]:
    """Each merge form back to back, and at decode after the stand-in sublayer (marginal time); at decode
    also with the newest block folded in (the branched form: its bytes count the block read, and its normed
    row is another sum than the others')."""
    rows: list[Row] = []
    for M, dim in shapes:
        stats, source, out_w, key_w = merge_inputs(M, dim)
        shape, nbytes = f"M={M},D={dim}", merge_bytes(M, dim, True)
        want = merge_norm_triton.attnres_merge_norm(*stats, source, out_w, key_w)[1]
        forms = MERGE_FORMS
        if M <= 64:
            newest = source.flip(0).contiguous()
            forms += tuple((f"{impl}, newest block folded in", {**kw, "newest": newest}) for impl, kw in MERGE_FORMS)
        for impl, kw in MERGE_FORMS:
            ms, how = time_ms(partial(merge_norm_triton.attnres_merge_norm, *stats, source, out_w, key_w, **kw))
            rows.append(Row("attnres_merge_forms", shape, f"{impl}, back to back", ms, nbytes, note=how))
        if M > 64:  # the decode pattern
            continue
        written = torch.empty_like(source)
        standin = partial(torch.mul, source, 1, out=written)
        alone, how = time_ms(standin)
        rows.append(Row("attnres_standin", shape, "torch.mul writing the partial sum", alone, 2 * M * dim * 2,
                        note=how))
        for impl, kw in forms:
            run = partial(merge_norm_triton.attnres_merge_norm, *stats, written, out_w, key_w, **kw)
            standin()
            equal = torch.equal(run()[1], want)
            pair, how = time_ms(lambda run=run, standin=standin: (standin(), run()))
            moved = nbytes + (M * dim * 2 if "newest" in kw else 0)
            rows.append(Row("attnres_merge_after_sublayer", shape, impl, pair - alone, moved, note=how,
                            extra={"pair_ms": pair, "standin_ms": alone, "normed_equal": equal}))
    return rows


def forward_bytes(name: str, batch: int) -> int:
    """Least bytes of a decode forward's AttnRes: every phase 1 as served (block copy included) and every
    site's merge (a block's first site and the final one have no partial sum)."""
    config = preset(name)
    layers, size, dim = config.num_hidden_layers, config.attn_res_block_size, config.hidden_size
    phases = sum(phase1_bytes(batch, dim, N, Q, S, copy=True) for N, Q, S in forward_phases(name))
    return phases + sum(merge_bytes(batch, dim, site % (2 * size) != 0 and site < 2 * layers)
                        for site in range(2 * layers + 1))


class ServedForward:
    """The AttnRes work of one decode forward of preset `name` at `batch` rows, in services/engine/fast_decoder's
    order, with a stand-in sublayer (`torch.mul` / `add_` of the normed input into the block's partial sum)."""

    def __init__(self, name: str, batch: int, device: str = "cuda") -> None:
        config = preset(name)
        self.layers, self.size, dim = config.num_hidden_layers, config.attn_res_block_size, config.hidden_size
        self.n_sites, self.n_blocks = 2 * self.layers + 1, -(-self.layers // self.size) + 1
        gen = torch.Generator(device=device).manual_seed(batch + dim)
        self.q = torch.randn(self.n_sites, dim, device=device, dtype=BF16, generator=gen) * dim**-0.5
        self.key_w = (torch.rand(self.n_sites, dim, device=device, generator=gen) + 0.5).to(BF16)
        self.out_w = (torch.rand(self.n_sites, dim, device=device, generator=gen) + 0.5).to(BF16)
        self.parts = query_parts(self.q, self.key_w)
        self.embed = torch.randn(batch, dim, device=device, dtype=BF16, generator=gen)
        self.cache = torch.zeros(self.n_sites, self.n_blocks, batch, device=device)
        self.stacked = torch.zeros(self.n_blocks, batch, dim, device=device, dtype=BF16)
        self.sums = torch.zeros(self.n_blocks, batch, dim, device=device, dtype=BF16)  # each block's partial sum
        self.bytes = forward_bytes(name, batch)
        self.side = torch.cuda.Stream(device) if device == "cuda" else None

    def _fork(self) -> torch.cuda.Stream | None:
        """services/engine/fast_decoder's AttnRes branch: a side stream while a graph is captured."""
        if self.side is None or not torch.cuda.is_current_stream_capturing():
            return None
        self.side.wait_stream(torch.cuda.current_stream())
        return self.side

    def _sublayer(self, normed: torch.Tensor, block: int, first: bool) -> torch.Tensor:
        return torch.mul(normed, 1, out=self.sums[block]) if first else self.sums[block].add_(normed)

    def standins(self) -> None:
        """The stand-in sublayers alone (what `run` spends outside AttnRes)."""
        normed = self.embed
        for i in range(self.layers):
            for j in range(2):
                self._sublayer(normed, i // self.size, i % self.size == 0 and j == 0)

    def run(self, form: Form) -> torch.Tensor:
        if form.branched:
            return self.run_branched(form)
        done, partial_sum, inter = 0, None, None

        def complete(block: torch.Tensor) -> None:
            nonlocal done
            first = min(2 * done * self.size, self.n_sites - 1)
            if not form.fused_copy:
                self.stacked[done].copy_(block)
            block_logits_triton.attnres_block_logits(
                self.q[first:], block, self.key_w[first:], out=self.cache[first:, done], parts=self.parts[:, first:],
                copy_to=self.stacked[done] if form.fused_copy else None)
            done += 1

        def phase1(sites: slice) -> object:
            stats = inter_triton.attnres_inter(self.q[sites], self.stacked[:done], self.key_w[sites],
                                               logits=self.cache[sites, :done])
            stats.acc = stats.acc.contiguous()
            return stats

        complete(self.embed)
        for i in range(self.layers):
            if i % self.size == 0:
                inter = phase1(slice(2 * i, 2 * min(i + self.size, self.layers)))
            for j in range(2):
                site, row = 2 * i + j, inter.row(2 * (i % self.size) + j)
                _, normed = merge_norm_triton.attnres_merge_norm(
                    row.max, row.denom, row.acc, self.q[site], partial_sum, self.out_w[site], self.key_w[site],
                    out_dtype=BF16, store_h=form.store_h)
                partial_sum = self._sublayer(normed, i // self.size, partial_sum is None)
            if (i + 1) % self.size == 0:
                complete(partial_sum)
                partial_sum = None
        if partial_sum is not None:
            complete(partial_sum)
        stats = phase1(slice(self.n_sites - 1, self.n_sites)).row(0)
        return merge_norm_triton.attnres_merge_norm(stats.max, stats.denom, stats.acc, self.q[-1], None, self.out_w[-1],
                                                    self.key_w[-1], out_dtype=BF16, store_h=form.store_h)[1]


    def run_branched(self, form: Form) -> torch.Tensor:
        """fast_decoder._attn_res_branched's order: at each layer block k, block k's logits (and copy) and the
        phase 1 of layer block k + 1 over blocks 0 .. k on the side branch, the merges folding in block k."""

        def ahead(k: int, block: torch.Tensor) -> object:
            first = min(2 * (k + 1) * self.size, self.n_sites - 1)
            block_logits_triton.attnres_block_logits(
                self.q[first:], block, self.key_w[first:], out=self.cache[first:, k], parts=self.parts[:, first:],
                copy_to=self.stacked[k])
            here = slice(first, 2 * min((k + 2) * self.size, self.layers) if first < self.n_sites - 1
                         else self.n_sites)
            stats = inter_triton.attnres_inter(self.q[here], self.stacked[: k + 1], self.key_w[here],
                                               logits=self.cache[here, : k + 1])
            stats.acc = stats.acc.contiguous()
            return stats

        newest, partial_sum, inter, side, pending = self.embed, None, None, None, None
        for i in range(self.layers):
            if i % self.size == 0:
                inter, side = pending, self._fork()
                with torch.cuda.stream(side) if side is not None else nullcontext():
                    pending = ahead(i // self.size, newest)
            for j in range(2):
                site = 2 * i + j
                row = inter.row(2 * (i % self.size) + j) if inter is not None else None
                _, normed = merge_norm_triton.attnres_merge_norm(
                    *((row.max, row.denom, row.acc) if row is not None else (None, None, None)), self.q[site],
                    partial_sum, self.out_w[site], self.key_w[site], out_dtype=BF16, store_h=form.store_h,
                    newest=newest)
                partial_sum = self._sublayer(normed, i // self.size, partial_sum is None)
            if (i + 1) % self.size == 0 or i == self.layers - 1:
                if side is not None:
                    torch.cuda.current_stream().wait_stream(side)
                side, newest, partial_sum = None, partial_sum, None
        stats = pending.row(0)
        return merge_norm_triton.attnres_merge_norm(stats.max, stats.denom, stats.acc, self.q[-1], None,
                                                    self.out_w[-1], self.key_w[-1], out_dtype=BF16,
                                                    store_h=form.store_h, newest=newest)[1]


def forward_rows(names: tuple[str, ...] = ("k3", "mini"), batch: int = 64, forms: tuple[Form, ...] = FORMS) -> list[Row]:
    """A whole decode forward's AttnRes per form, minus the stand-in sublayers timed alone."""
    rows: list[Row] = []
    for name in names:
        served = ServedForward(name, batch)
        shape = f"{name} forward, B={batch}"
        alone, how = time_ms(served.standins, inner=2, reps=10)
        rows.append(Row("attnres_standin", shape, "the stand-in sublayers alone", alone, note=how))
        want = served.run(BASELINE)
        for form in forms:
            got = served.run(form)
            equal, err = torch.equal(got, want), (got.float() - want.float()).abs().max().item()
            total, how = time_ms(partial(served.run, form), inner=2, reps=10)
            rows.append(Row("attnres_decode_forward", shape, form.name, total - alone, served.bytes, note=how,
                            extra={"total_ms": total, "standins_ms": alone, "normed_equal": equal,
                                   "max_abs_vs_baseline": err}))
    return rows


def decode_rows() -> list[Row]:
    return launch_floor_rows() + merge_rows() + forward_rows()
