"""MXFP4 against hand-computed OCP MX cases, a brute-force float64 oracle and the torch e8m0 dtype."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3core.quant.mxfp4 import E2M1_MAGNITUDES, dequantize, fake_quant, quantize, unpack_codes

# One block whose amax (7.0) gives floor(log2 7) - 2 = 0, i.e. scale 2**0 (e8m0 byte 127).
# (input, expected e2m1 code) worked out by hand: exact grid points, then every tie (goes to the even
# code), then saturation above 6.
HAND_BLOCK = [
    (0.0, 0), (0.5, 1), (1.0, 2), (1.5, 3), (2.0, 4), (3.0, 5), (4.0, 6), (6.0, 7),
    (-0.5, 9), (-1.0, 10), (-1.5, 11), (-2.0, 12), (-3.0, 13), (-4.0, 14), (-6.0, 15),
    (0.25, 0),   # tie 0 | 0.5   -> 0   (code 0 even)
    (0.75, 2),   # tie 0.5 | 1   -> 1   (code 2 even)
    (1.25, 2),   # tie 1 | 1.5   -> 1
    (1.75, 4),   # tie 1.5 | 2   -> 2
    (2.5, 4),    # tie 2 | 3     -> 2
    (3.5, 6),    # tie 3 | 4     -> 4
    (5.0, 6),    # tie 4 | 6     -> 4
    (-5.0, 14),  # tie, negative -> -4
    (7.0, 7),    # saturates to 6
    (-6.9, 15),  # saturates to -6
    (0.3, 1), (0.7, 1), (2.2, 4), (2.6, 5), (4.9, 6), (5.1, 7), (-0.2, 8),  # plain nearest; -0.2 -> -0
]


def test_hand_block_codes_scale_and_packing():
    x = torch.tensor([v for v, _ in HAND_BLOCK])
    assert x.numel() == 32
    packed, scales = quantize(x[None])
    assert scales.tolist() == [[127]]
    codes = [c for _, c in HAND_BLOCK]
    # Element 2i in the low nibble, 2i+1 in the high nibble (compressed-tensors convention).
    assert packed[0].tolist() == [codes[i] | (codes[i + 1] << 4) for i in range(0, 32, 2)]
    assert unpack_codes(packed)[0].tolist() == codes


def test_hand_block_shifted_by_powers_of_two_only_moves_the_scale():
    x = torch.tensor([v for v, _ in HAND_BLOCK])[None]
    for shift in (-20, -3, 5, 30):
        packed, scales = quantize(x * 2.0**shift)
        assert scales.item() == 127 + shift
        assert torch.equal(packed, quantize(x)[0])


@pytest.mark.parametrize(("amax", "byte"), [(1.0, 125), (1.99, 125), (2.0, 126), (6.0, 127), (0.01, 118)])
def test_scale_is_floor_log2_amax_minus_two(amax, byte):
    x = torch.zeros(1, 32)
    x[0, 3] = -amax
    _, scales = quantize(x)
    assert scales.item() == byte == 127 + math.floor(math.log2(amax)) - 2
    # Independent decode of the byte through torch's own e8m0 dtype.
    assert scales.view(torch.float8_e8m0fnu).float().item() == 2.0 ** (byte - 127)


def test_zero_nan_and_inf_blocks():
    x = torch.zeros(3, 32)
    x[1, 5] = float("nan")
    x[2, 0] = float("inf")
    packed, scales = quantize(x)
    assert scales[:, 0].tolist() == [0, 0xFF, 0xFF]
    out = dequantize(packed, scales, torch.float32)
    assert torch.equal(out[0], torch.zeros(32))
    assert torch.isnan(out[1:]).all()


def test_subnormal_block_clamps_exponent():
    x = torch.full((1, 32), 1e-40)  # float32 subnormal: floor(log2) - 2 < -127
    packed, scales = quantize(x)
    assert scales.item() == 0
    out = dequantize(packed, scales, torch.float32)
    assert (out - x).abs().max() <= 2.0**-127 * 0.25


def _oracle_dequant(x: torch.Tensor) -> torch.Tensor:
    """Brute-force float64: nearest of all 15 signed e2m1 values, ties to the even code."""
    xd = x.double().reshape(-1, 32)
    amax = xd.abs().amax(dim=1)
    out = torch.empty_like(xd)
    for r in range(xd.shape[0]):
        exp = max(math.floor(math.log2(amax[r].item())) - 2, -127) if amax[r] > 0 else -127
        s = 2.0**exp
        for c in range(32):
            y = min(max(xd[r, c].item() / s, -6.0), 6.0)
            best = min(range(16), key=lambda code: (abs(y - _code_value(code)), code & 1))
            out[r, c] = _code_value(best) * s
    return out.reshape(x.shape)


def _code_value(code: int) -> float:
    mag = E2M1_MAGNITUDES[code & 7]
    return -mag if code & 8 else mag


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 3),
    blocks=st.integers(1, 2),
    log_scale=st.integers(-30, 30),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_matches_bruteforce_oracle_and_error_bound(rows, blocks, log_scale, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, blocks * 32, generator=g) * 2.0**log_scale
    packed, scales = quantize(x)
    out = dequantize(packed, scales, torch.float32)
    assert torch.equal(out.double(), _oracle_dequant(x))
    # Half a quantum: within ±6s the error is at most half the e2m1 spacing at that magnitude
    # (0.5s below 2s, 1s below 4s, 2s up to 6s); beyond 6s the value saturates to ±6s.
    s = (scales.double() - 127).exp2().repeat_interleave(32, dim=-1)
    y = x.double().abs() / s
    half_gap = torch.where(y <= 2, 0.25, torch.where(y <= 4, 0.5, 1.0)) * s
    err = (out.double() - x.double()).abs()
    inside = y <= 6
    assert (err[inside] <= half_gap[inside]).all()
    assert torch.allclose(err[~inside], (y[~inside] - 6) * s[~inside])


def test_bf16_and_expert_shaped_input_round_trips_its_own_grid():
    w = torch.randn(4, 8, 64, dtype=torch.bfloat16)  # [experts, out, in]
    packed, scales = quantize(w)
    assert packed.shape == (4, 8, 32) and scales.shape == (4, 8, 2)
    once = dequantize(packed, scales, torch.bfloat16)
    # A value already on the MXFP4 grid is a fixed point: quantise(dequantise(q)) == q bit for bit.
    packed2, scales2 = quantize(once)
    assert torch.equal(packed2, packed) and torch.equal(scales2, scales)


def test_bad_shapes_and_dtypes_are_rejected():
    with pytest.raises(ValueError, match="multiple of the MXFP4 block size"):
        quantize(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="blocks are 32"):
        quantize(torch.zeros(2, 64), group=16)
    with pytest.raises(TypeError, match="uint8"):
        dequantize(torch.zeros(2, 16, dtype=torch.int8), torch.zeros(2, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="shapes disagree"):
        dequantize(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))


def test_fake_quant_forward_is_dequant_quant_and_gradient_is_identity():
    w = torch.randn(6, 64, dtype=torch.float32, requires_grad=True)
    out = fake_quant(w)
    assert torch.equal(out, dequantize(*quantize(w.detach()), torch.float32))
    upstream = torch.randn(6, 64)
    out.backward(upstream)
    assert torch.equal(w.grad, upstream)


@settings(max_examples=25, deadline=None)
@given(
    picks=st.lists(st.sampled_from([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 3.0, 6.5]), min_size=31, max_size=31),
    signs=st.lists(st.booleans(), min_size=31, max_size=31),
    shift=st.integers(-100, 100),
)
def test_every_tie_at_any_scale_matches_the_oracle(picks, signs, shift):
    # 7.0 pins the block scale to 2**shift so every pick lands exactly on a tie (or saturates).
    values = [7.0] + [-p if neg else p for p, neg in zip(picks, signs, strict=True)]
    x = torch.tensor(values, dtype=torch.float64)[None] * 2.0**shift
    out = dequantize(*quantize(x.float()), torch.float64)
    assert torch.equal(out, _oracle_dequant(x.float()))
