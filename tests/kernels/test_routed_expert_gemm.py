"""The routed experts' GEMMs (kernels/fused/routed_expert_gemm_triton.py), interpreted, against the references:
each expert multiplied with its routed rows only (moe_align's expert-sorted layout, which the kernels find from
the routing themselves). Routings with an expert no token picked (its programs read nothing), one picked by
more tokens than a token tile (a second pass), sizes that are no multiples of the blocks; both weight load
forms. float16 stands in for bf16 (the interpreter's bf16
tl.dot is broken); the references are checked against float64 by hand."""

from __future__ import annotations

import pytest
import torch

from kernels.fused import naive
from kernels.fused import routed_expert_gemm_triton as routed

E, F, L, K = 4, 24, 40, 2  # F not a multiple of the 16-row weight block, L not of the 32-deep K block


def _routing(tokens: int, seed: int) -> torch.Tensor:
    """indices [T, K]: expert 3 never picked, expert 0 by every token (> one 16-row token tile at 20 tokens),
    in either slot."""
    gen = torch.Generator().manual_seed(seed)
    other = 1 + torch.randint(0, 2, (tokens,), generator=gen)
    pairs = torch.stack([torch.zeros(tokens, dtype=torch.int64), other], dim=1)
    swap = torch.rand(tokens, generator=gen) < 0.5
    return torch.where(swap[:, None], pairs.flip(1), pairs)


def _inputs(tokens: int, seed: int = 0, dtype: torch.dtype = torch.float16):
    """Row-strided z [T, L] (a column slice, as the fast path's x GEMM output), w13 [E, 2F, L], w2 [E, L, F],
    the routing [T, K]."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(tokens, L + 8, generator=gen).to(dtype)[:, 8:]
    w13 = (torch.randn(E, 2 * F, L, generator=gen) / L ** 0.5).to(dtype)
    w2 = (torch.randn(E, L, F, generator=gen) / F ** 0.5).to(dtype)
    return z, w13, w2, _routing(tokens, seed)


def test_references_match_float64_per_expert():
    """Hand loop in float64 over the pairs: pair (t, j) of expert e is row position[t, j], the rows sorted by
    expert then token (moe_align's position); the routing has an empty expert."""
    z, w13, w2, indices = _inputs(7, dtype=torch.float32)
    act, position = naive.routed_expert_gate_up_glu(z, w13, indices, "swiglu")
    down = naive.routed_expert_down(act, w2, indices)
    assert act.shape == (7 * K, F) and down.shape == (7 * K, L)
    assert torch.equal(position, naive.moe_align(indices, E)[2])
    order = sorted((int(indices[t, j]), t) for t in range(7) for j in range(K))
    for t in range(7):
        for j in range(K):
            e, row = int(indices[t, j]), int(position[t, j])
            assert order[row] == (e, t)
            gate_up = w13[e].double() @ z[t].double()
            want = torch.nn.functional.silu(gate_up[:F]) * gate_up[F:]
            torch.testing.assert_close(act[row].double(), want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(down[row].double(), w2[e].double() @ act[row].double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize(("tokens", "activation", "block_t"), [(5, "situ", 16), (20, "swiglu", 16),
                                                              (20, "situ", 32)])
def test_gate_up_glu_matches_reference(interpreted, tma, tokens, activation, block_t):
    """20 tokens with 16-row tiles: expert 0's 20 rows take two passes, the second mostly past its end."""
    z, w13, _, indices = _inputs(tokens)
    want, want_position = naive.routed_expert_gate_up_glu(z.float(), w13.float(), indices, activation, 4.0, 25.0)
    got, position = routed.routed_expert_gate_up_glu(z, w13, indices, activation, 4.0, 25.0, block_n=16,
                                                     block_t=block_t, block_k=32, tma=tma)
    assert got.shape == (tokens * K, F) and got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
    assert torch.equal(position, want_position)


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("tokens", [5, 20])
def test_down_matches_reference(interpreted, tma, tokens):
    """A token tile past an expert's rows reads the next expert's rows: the store mask keeps each row its own."""
    _, _, w2, indices = _inputs(tokens)
    act = torch.randn(tokens * K, F, generator=torch.Generator().manual_seed(2)).to(torch.float16)
    want = naive.routed_expert_down(act.float(), w2.float(), indices)
    got = routed.routed_expert_down(act, w2, indices, block_n=16, block_k=16, tma=tma)
    assert got.shape == (tokens * K, L) and got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)


def test_routed_rows_equal_the_dense_form_picked(interpreted):
    """The routed rows are the dense form's picked (expert, token) rows: what moe_combine reads from either."""
    from kernels.fused import expert_gemm_triton

    z, w13, w2, indices = _inputs(9)
    dense = expert_gemm_triton.expert_down(expert_gemm_triton.expert_gate_up_glu(z, w13, "situ", block_n=16,
                                                                                block_k=32), w2, block_n=16)
    act, position = routed.routed_expert_gate_up_glu(z, w13, indices, "situ", block_n=16, block_k=32)
    rows = routed.routed_expert_down(act, w2, indices, block_n=16)
    for t in range(9):
        for j in range(K):
            torch.testing.assert_close(rows[position[t, j]], dense[indices[t, j], t], rtol=2e-3, atol=2e-3)


def test_launchers_refuse_bad_inputs():
    z, w13, w2, indices = _inputs(4)
    with pytest.raises(ValueError, match="indices"):
        routed.routed_expert_gate_up_glu(z, w13, indices[:3])
    with pytest.raises(ValueError, match="indices"):
        routed.routed_expert_down(torch.zeros(4 * K, F, dtype=z.dtype), w2, indices.t())
    with pytest.raises(ValueError, match="w13"):
        routed.routed_expert_gate_up_glu(z[:, 1:], w13, indices)
    with pytest.raises(ValueError, match="w2"):
        routed.routed_expert_down(torch.zeros(8, F + 1, dtype=z.dtype), w2, indices)
    with pytest.raises(ValueError, match="share a dtype"):
        routed.routed_expert_gate_up_glu(z.float(), w13, indices)
