"""Latent-MoE routed-expert decode with MXFP4 weights on the H200 (GPU only).

    python -m kernels.perf.moe_cases [--variants all]   # sweep: prints the table and per-kernel times
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from k3core.quant.mxfp4 import BLOCK, dequantize, quantize
from kernels.moe import latent_moe_decode_triton, naive
from kernels.perf.harness import Row, copy_bandwidth, kernel_ms, rel_err, time_ms

E, L, F, TOP_K = 256, 2048, 1024, 16
# gate/up rows, cols, warps, stages, h parts (None: x's precision), down rows, cols (None: as gate/up)
VARIANTS = ((128, 128, 4, 3, None, None, None), (64, 256, 4, 3, None, None, None),
            (128, 128, 4, 3, None, 32, 512), (32, 512, 4, 3, None, 32, 512))
SWEEP = VARIANTS + ((128, 128, 4, 3, 2, None, None), (64, 128, 4, 3, None, None, None),
                    (128, 128, 4, 3, None, 64, 256))
MAX_REL_ERR = 1e-2  # a variant further than this from the float32 oracle is wrong, whatever its time

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


def _label(br: int, bc: int, nw: int, ns: int, hp: int | None, dr: int | None, dc: int | None) -> str:
    down = f",down={dr}x{dc}" if dr or dc else ""
    return f"ours({br}x{bc},w={nw},st={ns},h_parts={hp or 'auto'}{down})"


def moe_rows(batches: tuple[int, ...] = (1, 4, 16), variants: tuple = VARIANTS, peer: bool = True,
             on_row=lambda row: None) -> list[Row]:
    rows: list[Row] = []
    packs = _experts()
    for T in batches:
        x = torch.randn(T, L, device="cuda", dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(E, device="cuda")[:TOP_K] for _ in range(T)]).int()
        weights = torch.rand(T, TOP_K, device="cuda")
        # Two tokens share an expert in every batch > 1, so the expert-centric sharing is always checked.
        if T > 1:
            ids[1, 0] = ids[0, 0]
        ref = naive.latent_moe_decode(x.float(), ids, weights, *packs)  # float32 h and output: the oracle
        shape = f"T={T},E={E},k={TOP_K},l={L},F={F},mxfp4"
        for br, bc, nw, ns, hp, dr, dc in variants:
            tuning = {"block_rows": br, "block_cols": bc, "num_warps": nw, "num_stages": ns, "h_parts": hp,
                      "down_block_rows": dr, "down_block_cols": dc}
            call = partial(latent_moe_decode_triton.latent_moe_decode, x, ids, weights, *packs, **tuning)
            try:
                err = rel_err(call(), ref)
                ms, how = time_ms(call)
                extra = {"rel_err_vs_reference": err, "kernels_ms": kernel_ms(call, calls=20)}
                if not err <= MAX_REL_ERR:  # wrong results never count as the fastest variant
                    ms, how = float("nan"), f"WRONG: rel err {err:.1e}"
            except Exception as e:  # noqa: BLE001 - a variant that does not build must not hide the others
                ms, how, extra = float("nan"), f"failed: {e!r}"[-300:], {}
            rows.append(Row("latent_moe_decode", shape, _label(br, bc, nw, ns, hp, dr, dc), ms,
                            expert_bytes(ids), note=how, extra=extra))
            on_row(rows[-1])
        if peer:
            ms, how = time_ms(partial(_torch_peer, x, ids, weights, packs), inner=5, reps=10)
            rows.append(Row("latent_moe_decode", shape, "torch dequantize+bmm", ms, expert_bytes(ids),
                            note=how))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description="MoE decode variant sweep")
    parser.add_argument("--variants", choices=("default", "all"), default="all")
    args = parser.parse_args()
    copy_bps = copy_bandwidth()
    print(f"copy {copy_bps / 1e12:.2f} TB/s; {torch.cuda.get_device_name()}")

    def show(r: Row) -> None:
        frac = r.bytes / (r.ms * 1e-3) / copy_bps
        err = r.extra.get("rel_err_vs_reference", float("nan"))
        print(f"{r.shape:<36} {r.impl:<44} {r.ms * 1e3:8.1f} us {100 * frac:5.1f} % err {err:.1e} "
              f"{r.extra.get('kernels_ms', r.note)}", flush=True)

    moe_rows(variants=SWEEP if args.variants == "all" else VARIANTS, peer=False, on_row=show)


if __name__ == "__main__":
    main()
