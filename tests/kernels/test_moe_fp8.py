"""The FP8 gate/up of the latent-MoE decode (kernels/moe/decode_fp8_gluon.py, k3core.quant.mxfp4_device's e4m3
layout): on the CPU the layout, the decoder's bit placement, the multipliers, the K order of weights and
activations (a float64 simulation of what the kernel's registers hold) and the error of the hi / lo activation
split against the float32 oracle; on the GPU the split kernel and whole calls against the oracle."""

from __future__ import annotations

import pytest
import torch

from k3core.quant import mxfp4_device
from k3core.quant.mxfp4 import E2M1_MAGNITUDES, dequantize, quantize, unpack_codes
from kernels.moe import (
    decode_fp8_gluon,
    fp8_operands_triton,
    latent_moe_decode_triton,
    naive,
    prepared_experts,
)
from kernels.moe.mxfp4_tile_triton import BLOCK_ROWS
from kernels.perf.moe_cases import MAX_REL_ERR
from tests.kernels.moe_fp8_helpers import e4m3_values, weights_in_mma_k_order
from tests.kernels.moe_problems import expert_packs, moe_problem

F64 = torch.float64


def _code_values(packed: torch.Tensor) -> torch.Tensor:
    codes = unpack_codes(packed)
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=F64)[codes & 7]
    return torch.where(codes >= 8, -mags, mags)


def test_e4m3_words_decode_to_each_code_times_2_pow_minus_6():
    """Every code (all 16, in every position of a word, and random packs) decodes bit-exactly to its e2m1
    value x 2^-6 (the subnormal 0.5 included), through the rotations and mask a GPU applies."""
    every = torch.arange(16, dtype=torch.uint8)
    packed = torch.stack([every[torch.roll(torch.arange(16), s)][0::2] | every[torch.roll(torch.arange(16), s)][1::2] << 4
                          for s in range(16)])
    gen = torch.Generator().manual_seed(0)
    packed = torch.cat([packed, torch.randint(0, 256, (16, 8), generator=gen, dtype=torch.uint8)])
    decoded = mxfp4_device.decode_e4m3(mxfp4_device.device_words_e4m3(packed))
    assert torch.equal(e4m3_values(decoded) * 2.0**-mxfp4_device.E4M3_EXPONENT, _code_values(packed))
    assert not (decoded.to(torch.int32) & ~mxfp4_device.E4M3_MASK & 0xFF).any()


def test_e4m3_multipliers_times_codes_are_the_dequantized_weights():
    """Decoded byte x 2^(field - 127) (the float32 whose exponent field is the prepared byte) is the weight,
    exactly, for every finite e8m0 scale; from 249 (2^(e - 121) past float32) and for the 0xFF NaN code the
    multiplier is +inf, so the block's outputs are not finite, as the reference's NaN."""
    gen = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (256, 16), generator=gen, dtype=torch.uint8)
    scales = torch.arange(256, dtype=torch.uint8)[:, None]
    fields = mxfp4_device.e4m3_multipliers(scales)
    mult = (fields.to(torch.int32) << 23).view(torch.float32).to(F64)
    weights = e4m3_values(mxfp4_device.decode_e4m3(mxfp4_device.device_words_e4m3(packed))) * mult
    finite = scales[:, 0] <= 248
    assert torch.equal(weights[finite], dequantize(packed, scales, torch.float64)[finite])
    assert torch.isinf(mult[~finite]).all()


@pytest.mark.parametrize("latent", [128, 512])
def test_prepared_weights_meet_their_activations_in_the_mma_k_order(latent):
    """The weights as the kernel's registers hold them (K order of `weights_in_mma_k_order`) against the
    activations permuted by `mma_k_columns` give the dequantized product exactly (float64): layout, group
    transposition, blocks, decode, multipliers and the activations' K order agree."""
    gen = torch.Generator().manual_seed(latent)
    rows = 2 * BLOCK_ROWS
    packed, scales = quantize(torch.randn(3, rows, latent, generator=gen))
    words, mults = fp8_operands_triton.prepare_weights(packed, scales, "W_gate;W_up", "l")
    assert words.shape == (3, rows, latent // 8) and words.dtype == torch.int32 and mults.shape == (3, rows, latent // 32)
    k = fp8_operands_triton.mma_k_columns(latent)
    assert torch.equal(k.sort().values, torch.arange(latent)) and torch.equal(k // 32, torch.arange(latent) // 32)
    x = torch.randn(latent, generator=gen, dtype=F64)
    got = weights_in_mma_k_order(words, mults) @ x[k]
    torch.testing.assert_close(got, dequantize(packed, scales, torch.float64) @ x, rtol=1e-12, atol=1e-12)


def test_input_checks_of_the_k_order_and_the_e4m3_decode():
    """mma_k_columns permutes each 32-column group within itself and refuses a partial group (which would map
    columns past the end: the reference split failed with a bare IndexError); decode_e4m3 takes int32 words
    only (a float tensor would be silently truncated to other words)."""
    k = fp8_operands_triton.mma_k_columns(96)
    assert torch.equal(k.reshape(3, 32).sort(1).values, torch.arange(96).reshape(3, 32))
    for width in (48, 100, -32):
        with pytest.raises(ValueError, match=f"multiple of 32, got {width}"):
            fp8_operands_triton.mma_k_columns(width)
    with pytest.raises(ValueError, match="multiple of 32, got 48"):
        fp8_operands_triton.split_activations_reference(torch.ones(1, 48, dtype=torch.bfloat16))
    words = mxfp4_device.device_words_e4m3(torch.randint(0, 256, (2, 8), dtype=torch.uint8))
    for dtype in (torch.float32, torch.int64, torch.uint8):
        with pytest.raises(TypeError, match=f"must be int32.*got {dtype}"):
            mxfp4_device.decode_e4m3(words.to(dtype))


def test_activation_split_is_two_e4m3_parts_of_a_power_of_two_scaled_row():
    """x = s (hi + lo) to ~8 significant bits (the residual of an e4m3 rounding, rounded again): per row the
    largest |x| / s is in [128, 256), s a power of two; a zero row gives zeros, a row with an infinity a NaN
    scale (the output is not finite, as the reference's)."""
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(4, 256, generator=gen) * torch.tensor([1e-3, 1.0, 30.0, 1e4])[:, None]).to(torch.bfloat16)
    parts, s = fp8_operands_triton.split_activations_reference(x)
    assert parts.dtype == torch.float8_e4m3fn and parts.shape == (4, 2, 256)
    assert torch.equal(torch.frexp(s)[0], torch.full_like(s, 0.5))
    back = torch.empty(4, 256, dtype=F64)
    back[:, fp8_operands_triton.mma_k_columns(256)] = parts.to(F64).sum(1) * s[:, None].to(F64)
    amax = x.double().abs().amax(1)
    assert ((amax / s) >= 128).all() and ((amax / s) < 256).all()
    err = (back - x.double()).abs() / amax[:, None]
    assert err.max() < 2.0**-10, err.max()  # hi: 4 bits, lo: 4 more of what is left (subnormal at the bottom)
    zero_parts, zero_s = fp8_operands_triton.split_activations_reference(torch.zeros(1, 128, dtype=torch.bfloat16))
    assert not zero_parts.to(F64).any() and torch.isfinite(zero_s).all()
    inf = torch.zeros(1, 128, dtype=torch.bfloat16)
    inf[0, 5] = float("inf")
    assert torch.isnan(fp8_operands_triton.split_activations_reference(inf)[1]).all()


def _fp8_decode_simulated(x, ids, w, packs):
    """The whole call as the FP8 gate/up computes it (activations through the hi / lo split, weights exact),
    down as the oracle (float32)."""
    parts, s = fp8_operands_triton.split_activations_reference(x)
    x_split = torch.empty(x.shape, dtype=torch.float32)
    x_split[:, fp8_operands_triton.mma_k_columns(x.shape[1])] = parts.float().sum(1) * s[:, None]
    return naive.latent_moe_decode(x_split, ids, w, *packs)


def test_split_activations_keep_the_call_within_the_bench_bar():
    """The hi / lo split's error on a whole call (float32 elsewhere) is far below moe_cases' 1e-2 bar: a bf16
    x has 8 significant bits, hi takes 4 and lo nearly always the rest, so x = s (hi + lo) but for residuals
    that need a fifth bit or fall below e4m3's normals (~1e-6 at the bench's shapes, T = 1 / 4)."""
    gen = torch.Generator().manual_seed(3)
    E, K, L, F, T = 8, 4, 256, 128, 3
    packs = expert_packs(E, L, F, gen)
    x = torch.randn(T, L, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).int()
    w = torch.rand(T, K, generator=gen)
    ref = naive.latent_moe_decode(x.float(), ids, w, *packs)
    got = _fp8_decode_simulated(x, ids, w, packs)
    err = ((got - ref).norm() / ref.norm()).item()
    assert err < 1e-4, err


def test_fp8_prepared_experts_record_their_layout_and_refuse_calls_they_cannot_serve():
    """The e4m3 layout has the bf16 layout's shapes and dtypes: the prepared experts say which they hold, and a
    call the FP8 gate/up does not serve (a CPU call here) is refused instead of reading one layout as the other."""
    packs = (*quantize(torch.randn(2, 128, 256)), *quantize(torch.randn(2, 256, 64)))
    plain, fp8 = (prepared_experts.prepare_experts(*packs, gate_up_fp8=f) for f in (False, True))
    assert not plain.gate_up_fp8 and fp8.gate_up_fp8
    assert plain.gate_up_words.shape == fp8.gate_up_words.shape and not torch.equal(plain.gate_up_words,
                                                                                   fp8.gate_up_words)
    x, ids = torch.zeros(1, 256, dtype=torch.bfloat16), torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="gate_up_fp8"):
        latent_moe_decode_triton.latent_moe_decode_prepared(x, ids, torch.ones(1, 2), fp8)


def _gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


@pytest.mark.gpu
def test_split_kernel_matches_the_reference_on_gpu():
    """The Triton split kernel equals the CPU reference bit for bit (hi, lo and the scales; a zero row too)."""
    _gpu()
    gen = torch.Generator(device="cuda").manual_seed(4)
    x = (torch.randn(5, 2048, generator=gen, device="cuda") * 3).to(torch.bfloat16)
    x[3] = 0
    parts, s = fp8_operands_triton.split_activations(x)
    ref_parts, ref_s = fp8_operands_triton.split_activations_reference(x.cpu())
    got, want = parts.cpu().view(torch.uint8), ref_parts.view(torch.uint8)
    bad = [(got[:, p] != want[:, p]).sum().item() for p in range(2)]
    assert bad == [0, 0], f"mismatching (hi, lo) bytes: {bad}; first lo: {got[0, 1, :8].tolist()} {want[0, 1, :8].tolist()}"
    assert torch.equal(s.cpu(), ref_s)


def _problem(tokens: int):
    return moe_problem(tokens, experts=12, top_k=4, latent=512, width=256, device="cuda", seed=tokens)


@pytest.mark.gpu
@pytest.mark.parametrize(("tokens", "stages"), [(1, 2), (9, 3)])
def test_fp8_gate_up_kernel_on_the_reference_split(tokens, stages, monkeypatch):
    """The gate/up kernel alone (N = 8 and 16 slots), fed the CPU reference's split: h against the float64
    product of the same activations (s (hi + lo)) with the dequantized weights, SiTU-GLU, within bf16's rounding."""
    _gpu()
    packs, x, ids, _w = _problem(tokens)
    parts, s = fp8_operands_triton.split_activations_reference(x.cpu())
    monkeypatch.setattr(decode_fp8_gluon, "split_activations", lambda _x: (parts.cuda(), s.cuda()))
    words, mults = fp8_operands_triton.prepare_weights(packs[0], packs[1], "W_gate;W_up", "l")
    K, F = ids.shape[1], packs[0].shape[1] // 2
    h = torch.zeros(1, tokens * K, F, dtype=torch.bfloat16, device="cuda")
    decode_fp8_gluon.gate_up(x, ids, words, mults, h, 4.0, 25.0, stages)
    x_split = torch.empty(x.shape, dtype=F64)
    x_split[:, fp8_operands_triton.mma_k_columns(x.shape[1])] = parts.to(F64).sum(1) * s[:, None].to(F64)
    w = dequantize(packs[0].cpu(), packs[1].cpu(), torch.float64)[ids.cpu().flatten().long()]  # [T k, 2F, l]
    gate_up = torch.einsum("pfl,pl->pf", w, x_split.repeat_interleave(K, 0))
    want = naive.situ_glu_fused(gate_up.float())
    got = h[0].float().cpu()  # every pair's row: a token names k distinct experts (randperm)
    err = ((got - want).norm() / want.norm()).item()
    assert err < 1e-2, err


@pytest.mark.gpu
@pytest.mark.parametrize(("tokens", "stages"), [(1, 2), (3, 3), (8, 2), (9, 3), (16, 4)])
def test_fp8_gate_up_matches_the_oracle_on_gpu(tokens, stages):
    """Whole calls with the FP8 gate/up (N = 8 token slots up to 8 tokens, 16 beyond; 2-4 stages, 4 steps a
    program) within the bench's bar of the float32 oracle and close to the CPU simulation of the same
    arithmetic; token 1 shares token 0's first expert."""
    _gpu()
    packs, x, ids, w = _problem(tokens)
    experts = prepared_experts.prepare_experts(*packs, gate_up_fp8=True)
    got = latent_moe_decode_triton.latent_moe_decode_prepared(x, ids, w, experts, gluon_stages=stages).float()
    ref = naive.latent_moe_decode(x.float(), ids, w, *packs)
    err = ((got - ref).norm() / ref.norm()).item()
    assert err < MAX_REL_ERR, err
    sim = _fp8_decode_simulated(x.cpu(), ids.cpu(), w.cpu(), [p.cpu() for p in packs])
    assert ((got.cpu() - sim).norm() / sim.norm()).item() < 5e-3
