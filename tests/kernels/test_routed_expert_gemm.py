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


SKIP = 99  # the padding marker's value (the fast path: the scratch KDA page)


def _padded(real: int, pad_at: list[int], seed: int = 3):
    """A batch of `real` tokens with padding tokens inserted at `pad_at` (sorted): the padding rows all pick
    experts 3 (which no real token picks) and 0, as a bucket's alike padding rows pick one top-k. -> (inputs
    padded, the marker [T], the real tokens' rows, inputs of the real tokens alone)."""
    z, w13, w2, indices = _inputs(real + len(pad_at), seed)
    keep = [t for t in range(len(z)) if t not in pad_at]
    indices[pad_at] = torch.tensor([3, 0])
    marker = torch.arange(len(z), dtype=torch.int64)
    marker[pad_at] = SKIP
    return (z, w13, w2, indices), marker, keep, (z[keep], indices[keep].contiguous())


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize(("real", "pad_at"), [(13, list(range(13, 20))), (9, [0, 4, 10])])
def test_padding_rows_route_to_no_expert(interpreted, tma, real, pad_at):
    """The real tokens' rows, positions and down rows are bit for bit those of the same kernels on the real
    tokens alone (same tiles: the padding pairs are not rows); every padding pair's position is R = T*k, the
    down projection's added row, zeros; the first R_real rows equal the reference's (padding's too)."""
    (z, w13, w2, indices), marker, keep, (z_real, ind_real) = _padded(real, pad_at)
    tiling = {"block_n": 16, "block_t": 16, "block_k": 32, "tma": tma}
    act, position = routed.routed_expert_gate_up_glu(z, w13, indices, "situ", padding=(marker, SKIP), **tiling)
    down = routed.routed_expert_down(act, w2, indices, padding=(marker, SKIP), **tiling)
    act_real, position_real = routed.routed_expert_gate_up_glu(z_real, w13, ind_real, "situ", **tiling)
    down_real = routed.routed_expert_down(act_real, w2, ind_real, **tiling)
    rows, pairs = real * K, indices.numel()
    assert torch.equal(position[keep], position_real)
    assert torch.equal(act[:rows], act_real) and torch.equal(down[:rows], down_real)
    assert down.shape == (pairs + 1, L) and torch.equal(down[pairs], torch.zeros(L, dtype=down.dtype))
    assert (position[pad_at] == pairs).all()
    want_act, want_position = naive.routed_expert_gate_up_glu(z.float(), w13.float(), indices, "situ",
                                                              padding=(marker, SKIP))
    assert torch.equal(position, want_position)
    torch.testing.assert_close(act[:rows].float(), want_act[:rows], rtol=1e-2, atol=1e-2)
    want_down = naive.routed_expert_down(want_act, w2.float(), indices, padding=(marker, SKIP))
    assert want_down.shape == down.shape and not want_down[rows:].any()
    torch.testing.assert_close(down[:rows].float(), want_down[:rows], rtol=1e-2, atol=1e-2)


def _expert_counts(indices: torch.Tensor, marker: torch.Tensor | None) -> list[tuple[int, int]]:
    """(first row, row count) of each expert as the kernels' programs work them out (`_expert_rows`)."""
    import triton
    import triton.language as tl

    @triton.jit
    def counts(indices, marker, out, T, PADDING: tl.constexpr, TOP_K: tl.constexpr, BLOCK_P: tl.constexpr):
        expert = tl.program_id(0)
        first, count, _, _, _ = routed._expert_rows(indices, marker, SKIP, expert, T, PADDING, TOP_K, BLOCK_P,
                                                    TOP_K)
        tl.store(out + 2 * expert, first)
        tl.store(out + 2 * expert + 1, count)

    out = torch.zeros(E, 2, dtype=torch.int32)
    counts[(E,)](indices, indices if marker is None else marker, out, indices.shape[0], PADDING=marker is not None,
                 TOP_K=K, BLOCK_P=max(16, triton.next_power_of_2(indices.shape[0])))
    return [tuple(row) for row in out.tolist()]


def test_padding_rows_add_no_expert_rows_nor_passes(interpreted):
    """Each program's rows (its weight-block passes: ceil(count / BLOCK_T), none when count is 0): with the
    padding marked, those of the real tokens alone: expert 3, which only padding rows pick, reads nothing and
    expert 0 keeps one 16-row pass; unmarked, the 7 padding rows add 7 rows to experts 0 and 3 (a second pass
    for expert 0, a first for 3: the finding this fixes)."""
    (_, _, _, indices), marker, keep, (_, ind_real) = _padded(13, list(range(13, 20)))
    alone = _expert_counts(ind_real, None)
    assert _expert_counts(indices, marker) == alone
    assert alone[3][1] == 0 and alone[0][1] == 13
    unmarked = _expert_counts(indices, None)
    assert unmarked[0][1] == 20 and unmarked[3][1] == 7  # 2 passes of 16 rows, and expert 3 read
