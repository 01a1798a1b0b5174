"""The skinny-M projection GEMM (kernels/fused/skinny_gemm_triton), interpreted on tiny shapes, against a
float64 product of the same (float16-representable) inputs: with and without the residual add, K split or
not, N not a multiple of the block, rows not a power of two, row-strided x; and the routing rules."""

from __future__ import annotations

import pytest
import torch

from k3core.presets import preset
from kernels import dispatch
from kernels.fused import naive, skinny_gemm_triton
from kernels.fused.skinny_gemm_triton import Tiling
from services.engine.fast_decoder import distinct_projections

F16 = torch.float16  # the venv's interpreter computes bf16 tl.dot wrongly; float16 is exact in it


def _case(rows: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row-strided x [rows, k], weight [n, k], residual [rows, n], all float16."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k + 8, generator=gen).to(F16)[:, 4 : 4 + k]
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(F16)
    return x, weight, torch.randn(rows, n, generator=gen).to(F16)


@pytest.mark.parametrize(("rows", "n", "k", "tiling"), [
    (5, 64, 128, Tiling(32, 32, 2, num_stages=2)),  # split K, N a multiple of the block
    (16, 48, 96, Tiling(32, 16, 3, num_stages=2)),  # N past the last full tile, three splits
    (3, 40, 64, Tiling(16, 32, 1, num_stages=2)),  # no split, ragged N
    (33, 32, 64, Tiling(16, 16, 4, num_stages=2)),  # 33 rows: a 64-row tile with most rows masked
])
@pytest.mark.parametrize("with_residual", [False, True])
def test_kernel_matches_float64(interpreted, rows, n, k, tiling, with_residual):
    x, weight, residual = _case(rows, n, k, seed=rows + n)
    expected = x.double() @ weight.double().t() + (residual.double() if with_residual else 0.0)
    target = residual.clone() if with_residual else None
    got = skinny_gemm_triton.skinny_gemm(x, weight, target, tiling)
    if with_residual:
        assert got.data_ptr() == target.data_ptr()  # in place
    # one float16 rounding of the float32 accumulator
    torch.testing.assert_close(got.double(), expected, rtol=2e-3, atol=2e-3)
    # deterministic: a second launch (counters reset by the first) gives the same bits
    again = skinny_gemm_triton.skinny_gemm(x, weight, residual.clone() if with_residual else None, tiling)
    assert torch.equal(again, got)


def test_reference_is_the_plain_projection():
    x, weight, residual = _case(4, 24, 16, seed=1)
    x, weight, residual = x.float(), weight.float(), residual.float()
    torch.testing.assert_close(naive.skinny_linear(x, weight), x @ weight.t())
    expected = residual + x @ weight.t()
    out = naive.skinny_linear(x, weight, residual)
    assert out.data_ptr() == residual.data_ptr()
    torch.testing.assert_close(out, expected)


def test_bad_shapes_are_refused():
    x, weight, residual = _case(4, 32, 64, seed=2)
    with pytest.raises(ValueError, match="multiple of splits x block_k"):
        skinny_gemm_triton.skinny_gemm(x, weight, None, Tiling(32, 64, 2))
    with pytest.raises(ValueError, match="at most 64"):
        skinny_gemm_triton.skinny_gemm(torch.zeros(65, 64, dtype=F16), weight)
    with pytest.raises(ValueError, match="residual must be"):
        skinny_gemm_triton.skinny_gemm(x, weight, residual[:, :16], Tiling(32, 32, 1))


def test_only_routed_shapes_and_rows_reach_the_kernel(monkeypatch):
    """A shape missing from ROUTES, a row count in a tile's lower half or past 64 rows stays on torch."""
    calls = []
    monkeypatch.setattr(skinny_gemm_triton, "skinny_gemm", lambda *a: calls.append(a))
    routes = {(32, 64, 16): Tiling(32, 64, 1), (32, 64, 64): Tiling(32, 64, 1)}
    monkeypatch.setattr(skinny_gemm_triton, "ROUTES", routes)
    x, weight, _ = _case(12, 32, 64, seed=3)
    other = torch.zeros(16, 64, dtype=F16)
    torch.testing.assert_close(skinny_gemm_triton.skinny_linear(x, other), x @ other.t())
    for rows in (1, 8, 17, 32, 65):  # lower halves of the 16- and 64-row tiles (and 32: no route), past 64
        assert skinny_gemm_triton.skinny_linear(torch.zeros(rows, 64, dtype=F16), weight).shape == (rows, 32)
    assert calls == []
    for rows in (9, 16, 33, 64):
        skinny_gemm_triton.skinny_linear(torch.zeros(rows, 64, dtype=F16), weight)
    assert [a[0].shape[0] for a in calls] == [9, 16, 33, 64]
    assert all(a[3] == Tiling(32, 64, 1) for a in calls)


def test_routes_are_valid_tilings_of_mini():
    """Every route is a mini projection shape its tiling divides (a typo would silently never match)."""
    shapes = {(n, k) for n, k, _ in distinct_projections(preset("mini")).values()}
    for (n, k, block_m), t in skinny_gemm_triton.ROUTES.items():
        assert (n, k) in shapes and block_m in (16, 32, 64)
        assert k % (t.splits * t.block_k) == 0


def test_default_tiling_divides_k_and_fills_the_device():
    """The most K splits (up to 4) whose programs fit one per SM: no larger split that divides K would fit;
    a split only while the N tiles alone leave SMs idle."""
    for n, k in [(2048, 2048), (2048, 2560), (8336, 2048), (3072, 768), (2048, 128), (11264, 2048)]:
        t = skinny_gemm_triton.default_tiling(n, k)
        assert k % (t.splits * t.block_k) == 0
        tiles, steps = -(-n // t.block_n), k // t.block_k
        assert t.splits == 1 or tiles * t.splits <= 132
        assert all(tiles * s > 132 for s in range(t.splits + 1, 5) if steps % s == 0), (n, k, t)


def test_dispatch_keeps_cpu_tensors_on_torch():
    x, weight, residual = _case(4, 24, 16, seed=4)
    expected = residual.float() + x.float() @ weight.float().t()
    torch.testing.assert_close(dispatch.skinny_linear(x.float(), weight.float(), residual.float()), expected)
