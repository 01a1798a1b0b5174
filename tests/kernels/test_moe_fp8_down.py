"""The FP8 down projection of the latent-MoE decode (kernels/moe/decode_fp8_down_gluon.py): on the CPU the
reuse of the gate/up's e4m3 layout for W_down, the fixed power-of-two scale of h and its hi / lo split, a
float64 simulation of the whole FP8 call against the float32 oracle, and the launcher's errors; on the GPU the
down kernel alone, whole calls, repeatability and a CUDA-graph replay."""

from __future__ import annotations

import pytest
import torch

from k3core.ops.moe import situ_glu
from k3core.quant.mxfp4 import dequantize, quantize
from kernels.moe import decode_fp8_down_gluon as fp8_down
from kernels.moe import (
    fp8_operands_triton,
    latent_moe_decode_triton,
    naive,
    prepared_experts,
)
from kernels.moe.tiles import Tile
from kernels.perf.moe_cases import MAX_REL_ERR
from tests.kernels.moe_fp8_helpers import weights_in_mma_k_order
from tests.kernels.moe_problems import expert_packs, moe_problem

F64 = torch.float64


def _from_k_order(parts: torch.Tensor, s: float) -> torch.Tensor:
    """uint8 [P, 2, F] hi (e4m3) / lo (e5m2) in the MMA's K order -> float64 s (hi + lo) [P, F] in column order."""
    hi, lo = parts[:, 0].view(torch.float8_e4m3fn).to(F64), parts[:, 1].view(torch.float8_e5m2).to(F64)
    back = torch.empty(parts.shape[0], parts.shape[2], dtype=F64)
    back[:, fp8_operands_triton.mma_k_columns(parts.shape[2])] = (hi + lo) * s
    return back


def _fp8_experts(packs) -> prepared_experts.PreparedExperts:
    return prepared_experts.prepare_experts(*packs, gate_up_fp8=True, down_fp8=True)


def test_down_weights_reuse_the_gate_up_layout_bit_exactly():
    """prepare_experts(down_fp8=True) lays W_down [E, l, F] out as the gate/up's e4m3 layout (l rows, F
    columns): the weights as the kernel's registers hold them meet h in the MMA's K order to give the
    dequantized product exactly; the experts record it, and down_fp8 alone is refused (it reads e4m3 h)."""
    gen = torch.Generator().manual_seed(0)
    E, L, F = 3, 128, 256
    packs = expert_packs(E, L, F, gen)
    experts = _fp8_experts(packs)
    assert experts.gate_up_fp8 and experts.down_fp8
    assert torch.equal(experts.down_words, fp8_operands_triton.prepare_weights(packs[2], packs[3], "W_down", "F")[0])
    with pytest.raises(ValueError, match="down_fp8 needs gate_up_fp8"):
        prepared_experts.prepare_experts(*packs, down_fp8=True)
    assert experts.down_words.shape == (E, L, F // 8) and experts.down_mults.shape == (E, L, F // 32)
    h = torch.randn(F, generator=gen, dtype=F64)
    got = weights_in_mma_k_order(experts.down_words, experts.down_mults) @ h[fp8_operands_triton.mma_k_columns(F)]
    torch.testing.assert_close(got, dequantize(packs[2], packs[3], F64) @ h, rtol=1e-12, atol=1e-12)


def test_fp8_preparation_errors_name_the_matrix_and_width_they_check():
    """F = 64 (not a multiple of 128) with down_fp8: the error names W_down and F (not gate/up and l); W_gate;W_up
    with l = 64 names l; W_down of 48 rows (l) names its rows."""
    gen = torch.Generator().manual_seed(5)
    with pytest.raises(ValueError, match=r"fp8 W_down needs F % 128 == 0, got F = 64"):
        _fp8_experts(expert_packs(1, 128, 64, gen))
    with pytest.raises(ValueError, match=r"fp8 W_gate;W_up needs l % 128 == 0, got l = 64"):
        _fp8_experts(expert_packs(1, 64, 128, gen))
    packed, scales = quantize(torch.randn(1, 48, 128, generator=gen))
    with pytest.raises(ValueError, match=r"fp8 W_down needs a multiple of 32 rows, got 48"):
        fp8_operands_triton.prepare_weights(packed, scales, "W_down", "F")


def test_h_scale_is_the_smallest_power_of_two_that_fits_and_refuses_others():
    assert fp8_down.h_scale(4.0, 25.0) == 2.0**-2  # |h| < 100: |h| / s < 400 <= 448
    assert fp8_down.h_scale(1.0, 1.0) == 2.0**-8  # 256 <= 448 < 512
    assert fp8_down.h_scale(4.0, 28.0) == 2.0**-2  # exactly 448
    with pytest.raises(ValueError, match="beta1 \\* beta2 = 120"):
        fp8_down.h_scale(4.0, 30.0)
    with pytest.raises(ValueError, match="finite non-zero betas"):
        fp8_down.h_scale(0.0, 25.0)
    with pytest.raises(ValueError, match="finite non-zero betas"):
        fp8_down.h_scale(float("inf"), 25.0)


def test_split_h_is_two_e4m3_parts_within_their_rounding_bound():
    """h / s = hi (e4m3) + lo (e5m2) to within half an ulp of lo's grid: 2^-7 |h / s| (lo normal) plus 2^-13
    (hi below e4m3's normals, its residual up to 2^-10, lo's 2 bits of it); the bound's largest |h|
    (beta1 beta2) does not saturate; zero stays zero."""
    gen = torch.Generator().manual_seed(1)
    s = fp8_down.h_scale(4.0, 25.0)
    h = torch.randn(6, 256, generator=gen, dtype=F64) * torch.tensor([1e-4, 1e-2, 0.3, 3.0, 30.0, 1.0])[:, None]
    h[5, :4] = torch.tensor([100.0, -100.0, 0.0, 99.9])
    parts = fp8_down.split_h_reference(h.float(), s)
    assert parts.dtype == torch.uint8 and parts.shape == (6, 2, 256)
    y = h.float().double() / s
    err = (_from_k_order(parts, s) / s - y).abs()
    assert (err <= 2.0**-7 * y.abs() + 2.0**-13).all(), (err - 2.0**-7 * y.abs()).max()
    assert torch.isfinite(_from_k_order(parts, s)).all() and _from_k_order(parts, s)[5, 2] == 0


def _simulated(x, ids, w, packs, h_format: str, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    """The whole call in float64 as the FP8 kernels round it: x through the gate/up's hi / lo split, exact
    weights, h as e4m3 hi / lo at the fixed scale ("fp8") or as bf16 ("bf16": today's down input)."""
    parts, sx = fp8_operands_triton.split_activations_reference(x)
    xs = torch.empty(x.shape, dtype=F64)
    xs[:, fp8_operands_triton.mma_k_columns(x.shape[1])] = parts.to(F64).sum(1) * sx[:, None].to(F64)
    F = packs[0].shape[1] // 2
    flat = ids.flatten().long()
    gate_up = torch.einsum("pfl,pl->pf", dequantize(packs[0][flat], packs[1][flat], F64),
                           xs.repeat_interleave(ids.shape[1], 0))
    h = situ_glu(gate_up[:, :F], gate_up[:, F:], beta1, beta2).float()  # the kernel's float32 h
    s = fp8_down.h_scale(beta1, beta2)
    h = _from_k_order(fp8_down.split_h_reference(h, s), s) if h_format == "fp8" else h.to(torch.bfloat16).to(F64)
    rows = torch.einsum("plf,pf->pl", dequantize(packs[2][flat], packs[3][flat], F64), h)
    return (rows.reshape(*ids.shape, -1) * w[..., None].to(F64)).sum(1)


@pytest.mark.parametrize("x_scale", [1.0, 0.1])
def test_fp8_h_keeps_the_whole_call_within_the_bench_bar(x_scale):
    """A float64 simulation of the FP8 gate/up + FP8 down against the float32 oracle, beside the same with bf16
    h (the FP8 gate/up + bf16 down of today): both far below moe_cases' 1e-2, also with x 10x smaller (h ~100x:
    an e4m3 lo lost 3e-2 there, below its normals; e5m2's reach keeps it as close as bf16)."""
    gen = torch.Generator().manual_seed(2)
    E, K, L, F, T = 8, 4, 256, 256, 3
    packs = expert_packs(E, L, F, gen)
    x = (torch.randn(T, L, generator=gen) * x_scale).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).int()
    w = torch.rand(T, K, generator=gen)
    ref = naive.latent_moe_decode(x.float(), ids, w, *packs).double()
    err = {f: ((_simulated(x, ids, w, packs, f) - ref).norm() / ref.norm()).item() for f in ("fp8", "bf16")}
    assert err["fp8"] < MAX_REL_ERR / 2 and err["bf16"] < MAX_REL_ERR / 2, err
    assert err["fp8"] < 2 * err["bf16"] + 1e-3, err  # about as close as bf16 h (fp8: ~8 bits where normal)


def test_fp8_down_calls_refuse_what_they_cannot_serve():
    """Clear errors: a CPU call or one of 17 tokens on FP8-prepared experts (named by their load-time choice),
    FP8 down experts recorded without the FP8 gate/up, and (test above) betas whose product needs a larger
    scale than checked."""
    gen = torch.Generator().manual_seed(3)
    experts = _fp8_experts(expert_packs(2, 256, 256, gen))
    ids, w = torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, 2)
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    call = latent_moe_decode_triton.latent_moe_decode_prepared
    with pytest.raises(ValueError, match="gate_up_fp8 serve CUDA bf16 calls of <= 16 tokens"):
        call(x, ids, w, experts)
    with pytest.raises(ValueError, match="gate_up_fp8 serve CUDA bf16 calls of <= 16 tokens"):
        call(torch.zeros(17, 256, dtype=torch.bfloat16), ids.expand(17, 2), w.expand(17, 2), experts)
    with pytest.raises(ValueError, match="down_fp8 need gate_up_fp8"):
        call(x, ids, w, experts._replace(gate_up_fp8=False))


def _gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def _problem(tokens: int):
    return moe_problem(tokens, experts=12, top_k=4, latent=256, width=512, device="cuda", seed=tokens)


@pytest.mark.gpu
@pytest.mark.parametrize(("tokens", "stages", "splits"), [(1, 3, 1), (9, 4, 2)])
def test_fp8_down_kernel_on_the_reference_h(tokens, stages, splits):
    """The down kernel alone (N = 8 and 16, 1 and 2 splits) on the CPU reference's fp8 h: every pair's row
    against the float64 product of the same s (hi + lo) with the dequantized weights, times its router weight."""
    _gpu()
    packs, _x, ids, w = _problem(tokens)
    experts = _fp8_experts(packs)
    K, (L, F) = ids.shape[1], packs[2].shape[1:]
    F *= 2
    s = fp8_down.h_scale(4.0, 25.0)
    h = (torch.randn(tokens * K, F, generator=torch.Generator().manual_seed(tokens)) * 8).clamp(-99, 99)
    hq = fp8_down.split_h_reference(h, s)
    partial = torch.full((splits, tokens * K, L), float("nan"), device="cuda")
    fp8_down.down(hq.cuda(), ids, w, experts.down_words, experts.down_mults, partial, s, stages)
    flat = ids.cpu().flatten().long()
    wd = dequantize(packs[2].cpu()[flat], packs[3].cpu()[flat], F64)
    want = torch.einsum("plf,pf->pl", wd, _from_k_order(hq, s)) * w.cpu().flatten()[:, None].to(F64)
    got = partial.sum(0).cpu().to(F64)  # randperm: every pair names a distinct expert of its token, so has a row
    # Hopper's FP8 MMAs keep fewer bits than float32 in their accumulators (1.4e-4 measured on the H200, both
    # cases): far from a layout or scale error (O(1)), and the whole call's error is bf16 h's (test below)
    assert ((got - want).norm() / want.norm()).item() < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize(("tokens", "stages", "down_stages", "splits"), [(1, 3, 3, 1), (3, 3, 4, 1), (8, 4, 3, 2),
                                                                          (9, 3, 4, 1), (16, 4, 4, 2)])
def test_fp8_call_matches_the_oracle_and_its_simulation(tokens, stages, down_stages, splits):
    """Whole FP8 calls (gate/up writing e4m3 h, the FP8 down, the launcher's pair sum) within the bench's bar
    of the float32 oracle and close to the float64 simulation of the same rounding; token 1 shares token 0's
    first expert; the down split in 2 or not; bit-equal across repeats."""
    _gpu()
    packs, x, ids, w = _problem(tokens)
    experts = _fp8_experts(packs)
    call = latent_moe_decode_triton.latent_moe_decode_prepared
    tuning = {"gluon_stages": stages, "gluon_down_stages": down_stages, "down_tile": Tile(splits=splits)}
    got = call(x, ids, w, experts, **tuning)
    ref = naive.latent_moe_decode(x.float(), ids, w, *packs)
    err = ((got.float() - ref).norm() / ref.norm()).item()
    assert err < MAX_REL_ERR, err
    sim = _simulated(x.cpu(), ids.cpu(), w.cpu(), [p.cpu() for p in packs], "fp8")
    assert ((got.cpu().double() - sim).norm() / sim.norm()).item() < 5e-3
    again = call(x, ids, w, experts, **tuning)
    assert torch.equal(got, again)


@pytest.mark.gpu
def test_fp8_call_replays_in_a_cuda_graph():
    """Captured once, replayed on new activations: the same bits as an eager call on them."""
    _gpu()
    packs, x, ids, w = _problem(5)
    experts = _fp8_experts(packs)
    call = latent_moe_decode_triton.latent_moe_decode_prepared
    static_x = x.clone()
    call(static_x, ids, w, experts)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call(static_x, ids, w, experts)
    new_x = torch.randn_like(x, dtype=torch.float32).to(torch.bfloat16)
    static_x.copy_(new_x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, call(new_x, ids, w, experts))
