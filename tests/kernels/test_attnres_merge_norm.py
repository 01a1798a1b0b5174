"""AttnRes merge + RMSNorm launch options (kernels/attnres/merge_norm_triton.py): `store_h=False` (h not
written, the normed row unchanged) in the interpreter against the reference; programmatic dependent launch
(`pdl`, `stats_ready`) as recorded for the H200, and on the GPU after a kernel that writes the partial sum.
The merge's math itself is tested in test_moe_attnres.py.
"""

from __future__ import annotations

import pytest
import torch

from k3core.ops.attnres import attnres_inter
from kernels import compile_check
from kernels.attnres import inter_triton, merge_norm_triton
from kernels.attnres import naive as attnres_naive


def _case(rows: int, dim: int, dtype: torch.dtype, device: str = "cpu"):
    gen = torch.Generator(device=device).manual_seed(rows + dim)
    blocks = torch.randn(3, rows, dim, generator=gen, device=device).to(dtype)
    queries = torch.randn(4, dim, generator=gen, device=device).to(dtype) * dim**-0.5
    key_w = (torch.rand(4, dim, generator=gen, device=device) + 0.5).to(dtype)
    stats = attnres_inter(queries, blocks, key_w).row(2)
    partial = torch.randn(rows, dim, generator=gen, device=device).to(dtype)
    out_w = (torch.rand(dim, generator=gen, device=device) + 0.5).to(dtype)
    return (stats.max, stats.denom, stats.acc.contiguous(), queries[2]), partial, out_w, key_w[2]


@pytest.mark.parametrize("with_partial", [True, False])
def test_without_h_the_normed_row_is_unchanged(interpreted, with_partial):
    stats, partial, out_w, key_w = _case(5, 48, torch.bfloat16)
    args = (*stats, partial if with_partial else None, out_w, key_w)
    h, normed = merge_norm_triton.attnres_merge_norm(*args, out_dtype=torch.bfloat16)
    none, alone = merge_norm_triton.attnres_merge_norm(*args, out_dtype=torch.bfloat16, store_h=False)
    assert none is None and torch.equal(alone, normed)
    ref_none, ref = attnres_naive.attnres_merge_norm(*args, out_dtype=torch.bfloat16, store_h=False)
    assert ref_none is None and ref.dtype == alone.dtype
    torch.testing.assert_close(alone, ref)  # one bf16 rounding step apart at most


@pytest.mark.parametrize(("stats_ready", "store_h"), [(False, True), (True, False)])
def test_pdl_launches_are_recorded_for_the_device(stats_ready, store_h):
    """On the device (recorded as for the H200: TRITON_INTERPRET reads 0) `pdl` launches with Triton's
    launch_pdl and compiles the wait in; without it neither is there. The apply kernel likewise."""
    stats, partial, out_w, key_w = _case(4, 64, torch.bfloat16)
    blocks = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
    with compile_check.record_launches() as rec:
        for pdl in (False, True):
            with rec.case(f"merge {pdl}"):
                merge_norm_triton.attnres_merge_norm(*stats, partial, out_w, key_w, pdl=pdl, stats_ready=stats_ready,
                                                     store_h=store_h)
            with rec.case(f"apply {pdl}"):
                inter_triton.attnres_inter(torch.zeros(3, 64), blocks, logits=torch.zeros(3, 2, 4), pdl=pdl)
    for spec in rec.unique():
        names = list(spec.signature)
        consts = {names[path[0]]: v for path, v in spec.constexprs.items()}
        pdl = spec.cases[0].endswith("True")
        assert spec.options["launch_pdl"] is pdl and consts["PDL"] is pdl, spec.describe()
        if spec.cases[0].startswith("merge"):
            assert consts["STATS_READY"] is stats_ready and consts["STORE_H"] is store_h
    assert len(rec.unique()) == 4


@pytest.mark.gpu
@pytest.mark.parametrize(("rows", "dim"), [(64, 7168), (3, 2048)])
def test_pdl_merge_waits_for_the_kernel_that_writes_the_partial_on_gpu(rows, dim):
    """The partial sum is written (over NaNs) by the kernel right before each merge; a merge that read it before
    its wait would see NaNs. Every launch form gives the bits of the plain launch."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    stats, source, out_w, key_w = _case(rows, dim, torch.bfloat16, "cuda")
    partial = torch.empty_like(source)
    want = merge_norm_triton.attnres_merge_norm(*stats, source, out_w, key_w)
    for stats_ready, store_h in ((False, True), (True, True), (True, False)):
        for _ in range(3):
            partial.fill_(float("nan"))
            torch.mul(source, 1, out=partial)
            h, normed = merge_norm_triton.attnres_merge_norm(*stats, partial, out_w, key_w, pdl=True,
                                                             stats_ready=stats_ready, store_h=store_h)
            assert torch.equal(normed, want[1]) and (h is None or torch.equal(h, want[0]))
