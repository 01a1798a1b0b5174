"""L2 prefetches of the decode GEMMs' weights (services/engine/weight_prefetch.py, K3_DECODE_PREFETCH).

A prefetch is a hint: it must change no value. Oracles: the launch plan tiles a weight's bytes exactly (the
kernel's per-lane ranges, restated here); on the CPU and outside a capture nothing is launched; on a GPU the
MoE layer captured with its prefetches gives the residual it gives without, bit for bit (and the prefetches
were captured: counted).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kernels import dispatch
from kernels.fused import l2_prefetch_triton
from services.engine import weight_prefetch

pytestmark = pytest.mark.skipif(l2_prefetch_triton.triton is None, reason="needs triton (the launch plan)")


def _lane_ranges(nbytes: int, programs: int) -> list[tuple[int, int]]:
    """The (offset, size) `_prefetch` issues per lane: lane l of program p starts at (p * LANES + l) * CHUNK
    and takes min(CHUNK, what is left); a lane with nothing left issues nothing."""
    chunk, lanes = l2_prefetch_triton.CHUNK, l2_prefetch_triton.LANES
    starts = (lane * chunk for lane in range(programs * lanes))
    return [(s, min(chunk, nbytes - s)) for s in starts if nbytes - s > 0]


@given(st.integers(1, 1 << 18))
def test_the_plan_covers_every_byte_once(words):
    t = torch.empty(words * 8, dtype=torch.bfloat16)  # 16-byte multiples
    nbytes, programs = l2_prefetch_triton.plan(t)
    assert nbytes == t.numel() * 2
    ranges = _lane_ranges(nbytes, programs)
    assert ranges[0][0] == 0 and sum(size for _, size in ranges) == nbytes
    assert all(a + n == b for (a, n), (b, _) in zip(ranges, ranges[1:], strict=False))
    assert len(ranges) > (programs - 1) * l2_prefetch_triton.LANES  # no program without work


def test_the_plan_refuses_what_the_instruction_cannot_take():
    w = torch.empty(64, 64, dtype=torch.bfloat16)
    assert l2_prefetch_triton.plan(w) is not None
    assert l2_prefetch_triton.plan(w.t()) is None  # no single byte range
    assert l2_prefetch_triton.plan(w.view(-1)[1:57]) is None  # 2 bytes past an aligned start
    assert l2_prefetch_triton.plan(w[:, :4].contiguous()[:1, :3]) is None  # 6 bytes
    assert l2_prefetch_triton.plan(w[:0]) is None


def test_groups_are_read_from_the_environment_and_a_typo_raises(monkeypatch):
    monkeypatch.delenv(weight_prefetch.ENV, raising=False)
    assert not any(weight_prefetch.wanted(g) for g in weight_prefetch.GROUPS)
    monkeypatch.setenv(weight_prefetch.ENV, "moe-out+kda-out")
    assert weight_prefetch.wanted("moe-out") and weight_prefetch.wanted("kda-out")
    assert not weight_prefetch.wanted("moe-x")
    monkeypatch.setenv(weight_prefetch.ENV, "moe-out,moe_x")
    with pytest.raises(ValueError, match="moe_x"):
        weight_prefetch.wanted("moe-out")


def test_nothing_is_launched_outside_a_capture(monkeypatch):
    launched: list[int] = []
    monkeypatch.setattr(dispatch, "l2_prefetch", lambda t: launched.append(t.numel()))
    monkeypatch.setenv(weight_prefetch.ENV, ",".join(weight_prefetch.GROUPS))
    weight_prefetch.prefetch(torch.ones(16), "moe-out")  # a CPU tensor, no capture
    weight_prefetch.join(torch.ones(1))
    assert launched == []


@pytest.mark.gpu
def test_the_moe_layer_with_its_prefetches_is_the_layer_without_in_a_graph(monkeypatch):
    """One mini MoE decode layer at 64 rows (bf16, the dense experts) captured with its two prefetches (its
    output GEMM's weight, and the next input GEMM's) and without: the same residual, bit for bit; the
    prefetches were captured, and their branch joined (else the capture fails)."""
    from k3core.layers.moe import SparseMoE
    from k3core.presets import preset
    from services.engine.fast_ffn import MoeDecode

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    dev, config = torch.device("cuda"), preset("mini")
    gen = torch.Generator(device=dev).manual_seed(3)
    with torch.device(dev):
        moe = SparseMoE(config)
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0.0, param.shape[-1] ** -0.5, generator=gen)
    fast = MoeDecode(moe.to(torch.bfloat16).eval(), config, grouped=True)
    fast.prefetch_next = torch.randn(8336, config.hidden_size, device=dev, generator=gen).to(torch.bfloat16)
    x = torch.randn(64, config.hidden_size, device=dev, generator=gen).to(torch.bfloat16)
    launched: list[int] = []
    real = dispatch.l2_prefetch
    monkeypatch.setattr(dispatch, "l2_prefetch", lambda t: (launched.append(t.numel()), real(t))[0])
    outs = []
    for groups in ("", "moe-out+attn-in"):
        monkeypatch.setenv(weight_prefetch.ENV, groups)
        residual = torch.zeros_like(x)
        with torch.no_grad():
            fast(x, torch.zeros_like(x))  # warm-up outside the capture (compiles; the first prefetch runs eagerly)
            torch.cuda.synchronize()
            launched.clear()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fast(x, residual)
                weight_prefetch.join(residual)
            for _ in range(3):
                residual.zero_()
                graph.replay()
        torch.cuda.synchronize()
        outs.append(residual.clone())
        assert len(launched) == (2 if groups else 0)
    assert outs[0].abs().max() > 0 and torch.equal(outs[0], outs[1])
