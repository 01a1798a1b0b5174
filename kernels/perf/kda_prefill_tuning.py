"""The KDA prefill block's tuning variants (kda_prefill_block arguments, each with the kernel it tunes), which of
them a run times, and the tuning a device run adopts from their rows: per kernel, the variant that beat the
default at every shape within the accuracy bar (kda_prefill_cases.py times them; kda_prefill_device_run.sh
runs the whole round)."""

from __future__ import annotations

import json
import os

# Tuning variants: (label, keyword arguments of prefill_triton.kda_prefill_block, the kernel they tune).
# History (B=1,T=32K,H=16, H200) in docs/kernels.md. Measured slower there and removed as options: the UT
# pass's row-by-row substitution (1.10 vs 0.98 ms), its key-block-outer loop order at 128 registers (1.08),
# .cs stores (UT 0.967 vs 0.976, recurrence 0.866 vs 0.869: noise), a fourth prep program for the gate
# (0.505 vs 0.490); and as tuning: prep at 16 warps 0.78, UT k_block 16 1.13 (1.15 capped at 128 registers),
# UT at 8 warps capped at 128 registers 1.19. Session 6 (history 26): channel-major conv weights in the prep
# (2.19 vs 2.12 ms for the block, tap-major now the only form), the prologue inside the UT pass (UT 1.91 vs
# prep + UT 1.40 ms) or recomputed in its loops (slowest, and wrong on the device). Session 7 (history 29): the
# UT pass's diagonal inverse in IEEE float32 (UT 0.94 vs 0.87 ms, at B=8 1.87 vs 1.73, the same errors: the
# dots' precision is the only form now) and the prep pass chunk-major (0.53 vs 0.44 ms, at B=8 1.05 vs 0.89).
# Session 7's third run (history 31) made three variants the only form, block ms at 32K / 128K / B=8 / varlen:
# the UT and output passes chunk-major (2.04 -> 2.00, 8.13 -> 7.99, 3.47 -> 3.42, 4.00 -> 3.91), the UT's
# row scaling in bf16 (-> 1.98, 7.86, 3.36, 3.85), the recurrence longest sequence first (-> 1.97, 7.82, 3.37,
# 3.55: varlen's recurrence 0.78 -> 0.48 ms). Session 8 (history 33): the UT pass's Akk assembled in
# registers, not through a float32 scratch tile in global memory, is the only form (1.96 -> 1.84, 7.78 ->
# 7.34, 3.34 -> 3.12, 3.53 -> 3.31).
VARIANTS = (
    ("default", {}, None),
    # None: its recurrence kernel time leaves out the output pass, which the fused one includes
    ("no fuse", {"fuse_output": False}, None),
    ("ut st2", {"ut_stages": 2}, "_kda_chunk_ut_kernel"),
    ("ut st2 cap128", {"ut_stages": 2, "ut_maxnreg": 128}, "_kda_chunk_ut_kernel"),
    ("fused w16", {"fused_warps": 16}, "_kda_chunk_recurrence_kernel"),
    ("stages 2", {"stages": 2}, "_kda_chunk_recurrence_kernel"),
    ("few bv=32", {"few_block_v": 32}, "_kda_chunk_recurrence_kernel"),
    ("kb=16", {"k_block": 16}, "_kda_chunk_ut_kernel"),
    ("ut no cap", {"ut_maxnreg": None}, "_kda_chunk_ut_kernel"),
    ("rec w8", {"recurrence_warps": 8}, "_kda_chunk_recurrence_kernel"),
    ("out w8", {"num_warps": 8}, "_kda_chunk_output_kernel"),
    ("ut f32 dots", {"f32_dots": True}, "_kda_chunk_ut_kernel"),
    ("prep w16", {"prep_warps": 16}, "_kda_prep_kernel"),
    # Last: 8-warp UT programs ran on Triton 3.6 / H200 this round, but an earlier 8-warp form faulted, and a
    # fault ends the process. 128 registers: 2 programs of 8 warps per SM.
    ("ut w8 cap128", {"ut_warps": 8, "ut_maxnreg": 128}, "_kda_chunk_ut_kernel"),
)
MAX_REL_ERR = 1e-2  # the accuracy bar vs the float64 block


def selected_variants(variants=VARIANTS) -> tuple[tuple[str, dict], ...]:
    """The variants to time: KDA_PREFILL_VARIANTS (comma-separated labels) picks some, KDA_PREFILL_TUNING
    (a JSON object of kda_prefill_block arguments) is added to every one, e.g. '{"block_v": 16}'."""
    base = json.loads(os.environ.get("KDA_PREFILL_TUNING") or "{}")
    names = os.environ.get("KDA_PREFILL_VARIANTS")
    picked = [v for v in variants if names is None or v[0] in names.split(",")]
    return tuple((name + (f" {base}" if base else ""), {**base, **tuning}) for name, tuning, _ in picked)


def pick_tuning(rows: list[dict], variants=VARIANTS, margin: float = 0.03) -> dict:
    """The tuning that combines, kernel by kernel, the variant whose kernel time summed over the shapes
    beats the default's by more than `margin` (rows of bench/kernels.py's JSON, variants timed without
    KDA_PREFILL_TUNING). A variant counts only if it ran at every shape the default ran, within MAX_REL_ERR.
    The kernels are separate launches, so their best forms combine; the combination still needs its own
    timing (the picked tuning is what the next run times against the peer). KDA_PREFILL_ROWS (a path) makes
    prefill_rows append each row there as a JSON line, which `python -m kernels.perf.kda_prefill_cases
    ROWS.jsonl...` reads to print the picked tuning."""
    by_label: dict[str, dict[str, dict]] = {}
    for r in rows:
        if r["kernel"] == "kda_prefill_block" and r["impl"].startswith("ours(") and r["ms"] == r["ms"]:
            by_label.setdefault(r["impl"][5:-1], {})[r["shape"]] = r["extra"]
    default = by_label.get("default", {})

    def stage_ms(label: str, kernel: str) -> float | None:
        runs = by_label.get(label, {})
        if not default or set(runs) != set(default):
            return None
        if any("error" in e or max(e["y_rel_err"], e["state_rel_err"]) > MAX_REL_ERR for e in runs.values()):
            return None
        return sum(e["kernels_ms"].get(kernel, float("inf")) for e in runs.values())

    tuning: dict = {}
    for kernel in dict.fromkeys(k for _, _, k in variants if k):
        best, best_ms = None, stage_ms("default", kernel)
        if best_ms is None:
            continue
        for label, kwargs, tuned in variants:
            ms = stage_ms(label, kernel) if tuned == kernel else None
            if ms is not None and ms < best_ms * (1 - margin):
                best, best_ms = kwargs, ms
        tuning.update(best or {})
    return tuning


def pick_from_files(paths: list[str]) -> dict:
    """pick_tuning over the rows of KDA_PREFILL_ROWS files (missing files: no rows)."""
    rows = []
    for path in paths:
        if os.path.exists(path):
            with open(path) as f:
                rows += [json.loads(line) for line in f if line.strip()]
    return pick_tuning(rows)
