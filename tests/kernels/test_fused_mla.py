"""Fused Gated-MLA glue (kernels/fused): the latent row write, the q_a slice's RMSNorm and the output gate,
references against float64 math, Triton launchers (interpreted) against the references, on row-strided inputs."""

from __future__ import annotations

import pytest
import torch

from kernels.fused import gated_heads_triton, mla_latent_write_triton, rms_norm_rows_triton
from kernels.fused import naive as fused_naive

B, R, P, N = 3, 24, 8, 10  # sequences, latent and rope widths, pool rows


def _latent_case(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(B, R + P + 5, generator=gen).to(dtype)[:, 2 : 2 + R + P]  # a column slice of a GEMM
    rows = torch.randn(N, R + P, generator=gen).to(dtype)
    return kv, 1 + torch.rand(R, generator=gen), rows, torch.tensor([7, 0, 4])


def test_latent_write_reference_matches_float64():
    kv, weight, rows, where = _latent_case(torch.float32)
    before = rows.clone()
    fused_naive.mla_latent_write(kv, weight, 1e-6, rows, where)
    for b, row in enumerate(where.tolist()):
        x = kv[b, :R].double()
        want = torch.cat([x / torch.sqrt(x.square().mean() + 1e-6) * weight.double(), kv[b, R:].double()])
        torch.testing.assert_close(rows[row].double(), want, rtol=1e-6, atol=1e-6)
    untouched = [r for r in range(N) if r not in where.tolist()]
    assert torch.equal(rows[untouched], before[untouched])


def test_latent_write_reference_adds_the_row_offset():
    kv, weight, rows, where = _latent_case(torch.float32)
    want, got = rows.clone(), rows.clone()
    fused_naive.mla_latent_write(kv, weight, 1e-6, want, where + 2)
    fused_naive.mla_latent_write(kv, weight, 1e-6, got, where, row_offset=2)
    assert torch.equal(got, want) and not torch.equal(got, rows)


@pytest.mark.parametrize("dtype,offset", [(torch.float32, 0), (torch.bfloat16, 0), (torch.float32, 1)])
def test_triton_latent_write_matches_reference(interpreted, dtype, offset):
    kv, weight, rows, where = _latent_case(dtype)
    want = rows.clone()
    fused_naive.mla_latent_write(kv, weight, 1e-6, want, where, offset)
    mla_latent_write_triton.mla_latent_write(kv, weight, 1e-6, rows, where, offset)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(rows.float(), want.float(), rtol=tol, atol=tol)


H, D = 3, 12


def _gate_case(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(1)
    o = torch.randn(B, H, D, generator=gen).to(dtype).transpose(0, 1)  # [H, B, D] head-major, strided
    gate = torch.randn(B, H * D + 4, generator=gen).to(dtype)[:, 4:]
    return o, gate


def test_gated_heads_reference_matches_float64():
    o, gate = _gate_case(torch.float32)
    got = fused_naive.gated_heads(o, gate)
    for b in range(B):
        for h in range(H):
            want = o[h, b].double() * torch.sigmoid(gate[b, h * D : (h + 1) * D].double())
            torch.testing.assert_close(got[b, h * D : (h + 1) * D].double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_gated_heads_matches_reference(interpreted, dtype):
    o, gate = _gate_case(dtype)
    got = gated_heads_triton.gated_heads(o, gate)
    want = fused_naive.gated_heads(o, gate)
    assert got.dtype == want.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-6 if dtype == torch.float32 else 1e-2,
                               atol=1e-6 if dtype == torch.float32 else 1e-2)


def test_gated_heads_refuses_a_mismatched_gate():
    o, gate = _gate_case(torch.float32)
    with pytest.raises(ValueError, match="gate"):
        gated_heads_triton.gated_heads(o, gate[:, 1:])


def test_rms_norm_rows_reference_matches_float64():
    gen = torch.Generator().manual_seed(3)
    fused = torch.randn(4, 40, generator=gen)
    x, weight = fused[:, 8:32], 0.5 + torch.rand(24, generator=gen)  # a column slice: row stride 40
    want = x.double() / torch.sqrt(x.double().square().mean(-1, keepdim=True) + 1e-6) * weight.double()
    got = fused_naive.rms_norm_rows(x, weight, 1e-6)
    assert got.is_contiguous()
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_rms_norm_rows_matches_reference(interpreted, dtype):
    gen = torch.Generator().manual_seed(4)
    fused = torch.randn(5, 1000, generator=gen).to(dtype)
    x, weight = fused[:, 100:868], (0.5 + torch.rand(768, generator=gen)).to(dtype)  # mini's q_a slice
    want = fused_naive.rms_norm_rows(x, weight, 1e-6)
    got = rms_norm_rows_triton.rms_norm_rows(x, weight, 1e-6)
    assert got.stride() == (768, 1)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # at most one bf16 rounding step apart
        torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=8e-3)


def test_rms_norm_rows_of_no_rows(interpreted):
    """An empty batch: an empty [0, D] result from both (the launcher launches nothing: a 0-program grid)."""
    x, weight = torch.randn(0, 40)[:, 8:32], torch.ones(24)
    for norm in (fused_naive.rms_norm_rows, rms_norm_rows_triton.rms_norm_rows):
        got = norm(x, weight, 1e-6)
        assert got.shape == (0, 24) and got.dtype == x.dtype
