"""KDA prefill block: reference vs float64 token-by-token math, Triton (interpreted) vs reference."""

from __future__ import annotations

import pytest
import torch

from kernels import dispatch
from kernels._triton import tl, triton
from kernels.kda import naive, prefill_triton
from kernels.kda.prefill_chunk_triton import _akk_in_registers, _diagonal_block_inverses
from tests.kernels.kda_inputs import KdaCase
from tests.kernels.test_kda_decode import _float64_step

CASE = KdaCase(heads=2, dim=16)
TOL = {"rtol": 1e-4, "atol": 1e-4}


def _close(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    y, state, conv = got
    torch.testing.assert_close(y, want[0], **TOL)
    torch.testing.assert_close(state, want[1], **TOL)
    torch.testing.assert_close(conv, want[2], rtol=0, atol=0)  # raw inputs moved, never computed


def test_reference_prefill_matches_float64_token_by_token():
    """Packed varlen sequences with carried states, each continued token by token in float64 (eq.1-6)."""
    gen = torch.Generator().manual_seed(11)
    params = CASE.params(gen)
    states, convs = CASE.pools(gen)
    x = CASE.tokens(gen, 1, 9)
    cu = torch.tensor([0, 2, 9])
    y, final_state, final_conv = naive.kda_prefill_block(*x, *params, initial_state=states[:2], initial_conv=convs[:2],
                                                         cu_seqlens=cu)
    for n, (start, end) in enumerate([(0, 2), (2, 9)]):
        conv, state = convs[n].double(), states[n].double()
        for t in range(start, end):
            inputs = [a[0, t] for a in x]
            y_t, state = _float64_step(inputs, conv, state, params, -5.0)
            raw = torch.stack(inputs[:3]).double()  # [3, H, D]
            conv = torch.cat([conv[..., 1:], raw[..., None]], dim=-1)
            torch.testing.assert_close(y[0, t].double(), y_t, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final_state[n].double(), state, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(final_conv[n].double(), conv, rtol=0, atol=0)


@pytest.mark.parametrize(("block_v", "k_block", "tuning"), [
    (16, 16, {}),
    (None, 32, {"fuse_output": False}),
    (16, 32, {"ut_maxnreg": None, "stages": 2, "ut_stages": 2}),
    (None, 16, {"fuse_output": True}),
])
def test_triton_prefill_matches_reference(interpreted, block_v, k_block, tuning):
    """Two sequences of 70 tokens (a full chunk and a partial one) continuing carried states, D = 32: the
    UT transform in one or two key-column blocks; the prologue's conv taps before the chunk are negative
    32-bit row offsets; the output pass on its own or inside the recurrence; with two value blocks (block_v
    16) the recurrence's programs of a (sequence, head) adjacent."""
    case = KdaCase(heads=2, dim=32)
    gen = torch.Generator().manual_seed(12)
    params = case.params(gen)
    states, convs = case.pools(gen)
    x = case.tokens(gen, 2, 70)
    kwargs = {"initial_state": states[:2], "initial_conv": convs[:2]}
    got = prefill_triton.kda_prefill_block(*x, *params, **kwargs, block_v=block_v, k_block=k_block, **tuning)
    _close(got, naive.kda_prefill_block(*x, *params, **kwargs))


def test_fused_output_launches_no_output_pass(interpreted, monkeypatch):
    """Many sequences x heads (here >= the CPU's stand-in of 4 SMs) take the recurrence with the output pass
    inside: the separate output kernel must not run, and the block still matches the reference."""
    gen = torch.Generator().manual_seed(15)
    params = CASE.params(gen)
    x = CASE.tokens(gen, 2, 70)

    class _NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("the output pass ran although the recurrence fused it")

    monkeypatch.setattr(prefill_triton, "_kda_chunk_output_kernel", _NoLaunch())
    _close(prefill_triton.kda_prefill_block(*x, *params), naive.kda_prefill_block(*x, *params))


def test_output_fuses_only_for_many_balanced_sequences():
    """The CPU stands in for 4 SMs: sequences x heads must reach 4, and the longest sequence may hold at most
    1.25x the mean chunk count (its serial chain would set the fused pass's time)."""
    cpu = torch.device("cpu")
    assert prefill_triton.fuses_output([64, 64], 2, cpu)
    assert prefill_triton.fuses_output([70, 128, 100], 2, cpu)  # 2, 2, 2 chunks
    assert not prefill_triton.fuses_output([64], 2, cpu)  # too few programs
    assert not prefill_triton.fuses_output([300, 64, 64], 2, cpu)  # 5 chunks against a mean of 2.3
    assert not prefill_triton.fuses_output([], 8, cpu)


@pytest.mark.parametrize("fuse_output", [None, True])
def test_triton_prefill_varlen_with_an_empty_sequence(interpreted, fuse_output):
    """Packed sequences shorter than the conv window, spanning chunks, and empty (state passes through); the
    output pass apart (the default for such uneven lengths) and fused; the recurrence's programs launched
    longest sequence first (2, 3, 0, 1 here)."""
    gen = torch.Generator().manual_seed(13)
    params = CASE.params(gen)
    states, convs = CASE.pools(gen)
    x = CASE.tokens(gen, 1, 135)
    y, state, conv = prefill_triton.kda_prefill_block(*x, *params, initial_state=states[:4], initial_conv=convs[:4],
                                                      cu_seqlens=torch.tensor([0, 2, 2, 70, 135]),
                                                      fuse_output=fuse_output)
    keep = [0, 2, 3]  # the reference's conv cannot take an empty sequence: compare the others without it
    want = naive.kda_prefill_block(*x, *params, initial_state=states[keep], initial_conv=convs[keep],
                                   cu_seqlens=torch.tensor([0, 2, 70, 135]))
    _close((y, state[keep], conv[keep]), want)
    assert torch.equal(state[1], states[1]) and torch.equal(conv[1], convs[1])


def test_triton_prefill_at_the_gate_bound_without_carried_state(interpreted):
    """g = -5 on every channel: decay ratios span e^(+-80) inside a 16-token sub-block and must not
    overflow; no initial state or conv (zeros)."""
    gen = torch.Generator().manual_seed(14)
    conv_w, _, dt_bias, norm_w = CASE.params(gen)
    A_log = torch.full((CASE.heads,), 3.0)
    q, k, v, z, beta, gate = CASE.tokens(gen, 1, 64)
    z = z.abs() + 10.0  # sigmoid(e^3 * (z + b)) == 1 in float32
    got = prefill_triton.kda_prefill_block(q, k, v, z, beta, gate, conv_w, A_log, dt_bias.abs() + 1, norm_w,
                                           k_block=16)
    want = naive.kda_prefill_block(q, k, v, z, beta, gate, conv_w, A_log, dt_bias.abs() + 1, norm_w)
    assert torch.isfinite(got[0]).all()
    _close(got, want)


def test_triton_prefill_with_nearly_parallel_keys(interpreted):
    """One key direction for the whole chunk, beta ~ 1, no decay: I + beta Akk is close to I plus the
    all-ones lower triangle, whose inverse only exists by cancellation (the inverse's hardest case)."""
    gen = torch.Generator().manual_seed(18)
    params = CASE.params(gen)
    q, k, v, z, beta, gate = CASE.tokens(gen, 1, 64)
    k = k[:, :1] + 0.01 * k  # the conv of one repeated key is one direction after its first taps
    z, beta = torch.full_like(z, -30.0), beta.abs() + 8.0
    got = prefill_triton.kda_prefill_block(q, k, v, z, beta, gate, *params)
    _close(got, naive.kda_prefill_block(q, k, v, z, beta, gate, *params))


@triton.jit
def _inverses_kernel(m, out, C: tl.constexpr, BC: tl.constexpr):
    b3 = tl.arange(0, C // BC)[:, None, None]
    r3 = tl.arange(0, BC)[None, :, None]
    j3 = tl.arange(0, BC)[None, None, :]
    x = _diagonal_block_inverses(tl.load(m + (b3 * BC + r3) * C + b3 * BC + j3), C, BC, "ieee")
    tl.store(out + b3 * BC * BC + r3 * BC + j3, x)


def test_diagonal_block_inverses_match_float64(interpreted):
    """The UT pass's 16x16 diagonal-block inverses of I + M (M strictly lower) against torch in float64."""
    m = torch.randn(64, 64, generator=torch.Generator().manual_seed(19)).tril(-1)
    got = torch.empty(4, 16, 16)
    _inverses_kernel[(1,)](m, got, C=64, BC=16)
    for b in range(4):
        block = m[16 * b:16 * (b + 1), 16 * b:16 * (b + 1)].double()
        want = torch.linalg.inv(torch.eye(16, dtype=torch.float64) + block)
        torch.testing.assert_close(got[b].double(), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@triton.jit
def _akk_kernel(parts, bt, m_out, diag_out, C: tl.constexpr, BC: tl.constexpr):
    rows = tl.arange(0, C)
    tile = rows[:, None] * BC + tl.arange(0, BC)[None, :]
    m, diag = _akk_in_registers(tl.load(parts + tile), tl.load(parts + C * BC + tile),
                                tl.load(parts + 2 * C * BC + tile), tl.load(parts + 3 * C * BC + tile),
                                tl.load(bt + rows), rows, C, BC)
    tl.store(m_out + rows[:, None] * C + rows[None, :], m)
    flat = tl.arange(0, C // BC)[:, None, None] * BC * BC + tl.arange(0, BC)[None, :, None] * BC
    tl.store(diag_out + flat + tl.arange(0, BC)[None, None, :], diag)


def test_akk_assembled_in_registers_matches_torch(interpreted):
    """The UT pass's beta Akk [64, 64] (i < r) and its four diagonal 16x16 blocks, assembled from the four
    key sub-blocks' [64, 16] accumulators in registers, against torch's concatenation of the same parts."""
    gen = torch.Generator().manual_seed(20)
    parts, bt = torch.randn(4, 64, 16, generator=gen), torch.rand(64, generator=gen)
    m, diag = torch.empty(64, 64), torch.empty(4, 16, 16)
    _akk_kernel[(1,)](parts, bt, m, diag, C=64, BC=16)
    want = (torch.cat(list(parts), dim=1) * bt[:, None]).tril(-1)
    assert torch.equal(m, want)
    assert torch.equal(diag, torch.stack([want[16 * b:16 * (b + 1), 16 * b:16 * (b + 1)] for b in range(4)]))


def test_softplus_gate_runs_the_reference_and_dispatch_routes_cpu_to_it():
    gen = torch.Generator().manual_seed(15)
    params, x = CASE.params(gen), CASE.tokens(gen, 1, 5)
    want = naive.kda_prefill_block(*x, *params, lower_bound=None)
    for got in (prefill_triton.kda_prefill_block(*x, *params, lower_bound=None),
                dispatch.kda_prefill_block(*x, *params, lower_bound=None)):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize(
    ("index", "spoil", "field"),
    [(1, lambda t: t[..., :8], "k"), (4, lambda t: t[..., :1], "beta"), (7, lambda t: t[:1], "A_log"),
     (6, lambda t: t[:2], "conv_weight")],
)
def test_bad_input_names_the_field(index, spoil, field):
    gen = torch.Generator().manual_seed(16)
    args = [*CASE.tokens(gen, 1, 4), *CASE.params(gen)]
    args[index] = spoil(args[index])
    with pytest.raises(ValueError, match=field):
        prefill_triton.kda_prefill_block(*args)


def test_bad_cu_seqlens_and_state_shapes_are_named():
    gen = torch.Generator().manual_seed(17)
    args = [*CASE.tokens(gen, 1, 6), *CASE.params(gen)]
    with pytest.raises(ValueError, match="cu_seqlens"):
        prefill_triton.kda_prefill_block(*args, cu_seqlens=torch.tensor([0, 4, 3, 6]))
    with pytest.raises(ValueError, match="initial_state"):
        prefill_triton.kda_prefill_block(*args, initial_state=torch.zeros(2, CASE.heads, 16, 16),
                                         cu_seqlens=torch.tensor([0, 6]))


def test_tap_major_conv_weights_are_derived_once_and_follow_updates():
    """The launcher's tap-major conv weights [3, W, H*D] come from a cache kept on the weight tensor: the same
    tensor while the weight is unchanged, rebuilt after an in-place update, never cached for inference
    tensors (no version counter to follow)."""
    weight = torch.randn(3, 8, 4)
    taps = prefill_triton.tap_major(weight)
    assert torch.equal(taps, weight.transpose(1, 2)) and taps.is_contiguous()
    assert prefill_triton.tap_major(weight) is taps
    weight.mul_(-2.0)
    again = prefill_triton.tap_major(weight)
    assert again is not taps and torch.equal(again, weight.transpose(1, 2))
    with torch.inference_mode():
        frozen = torch.randn(3, 8, 4)
        first = prefill_triton.tap_major(frozen)
        frozen.mul_(3.0)
        assert torch.equal(prefill_triton.tap_major(frozen), frozen.transpose(1, 2)) and not torch.equal(first, frozen.transpose(1, 2))
