"""`FastDecoder.projections` (the skinny GEMM's shapes for bench.serve_glue and the sm_90 compile check) is what
one decode step of the fast path routes through `dispatch.skinny_linear`, call by call: a step is run with
every such call recorded, so the list and the fast path cannot drift apart again (they had: four listed
shapes ran as F.linear and one that did run was missing)."""

from __future__ import annotations

import copy

import pytest

from kernels import dispatch
from services.engine.fast_decoder import FastDecoder, distinct_projections
from tests.workers.oracle import build_reference
from tests.workers.test_fastpath import PROMPTS, Driver


@pytest.mark.parametrize("model", ["nano", "nano-kl"])  # AttnRes + latent MoE; plain residual + plain MoE
def test_one_decode_step_calls_exactly_the_listed_projections(model, monkeypatch):
    monkeypatch.setenv("K3_DECODE_FASTPATH", "1")  # the executor builds the fast path itself (CPU: eager)
    driver = Driver(copy.deepcopy(build_reference(model, seed=3)), fastpath=False)  # False: no override
    fast = driver.executor.fastpath
    assert fast is not None
    driver.generate([p[:8] for p in PROMPTS], 1, finish=False)  # prefill: the rows sit at decode positions
    rids, cached = driver.reserve_step()
    calls = []
    linear = dispatch.skinny_linear

    def recorded(x, weight, residual=None):
        calls.append((weight.shape[0], x.shape[1], residual is not None))
        assert weight.shape[1] == x.shape[1]
        return linear(x, weight, residual)

    monkeypatch.setattr(dispatch, "skinny_linear", recorded)
    fast.forward(cached, [5] * len(rids))
    config = driver.executor.runner.model.config
    assert calls == [(p.n, p.k, p.residual) for p in FastDecoder.projections(config)]
    assert set(distinct_projections(config).values()) == set(calls)


def test_mini_lists_the_routed_shapes_and_block_starts_without_a_residual():
    """Hand-derived from the `mini` preset: the three shapes the skinny kernel is routed for, and the GEMMs of
    the AttnRes blocks' first layers (0 and 8: KDA; 16: the final MLA) that start a partial sum."""
    from k3core.presets import preset

    mini = preset("mini")
    shapes = distinct_projections(mini)
    assert {(8336, 2048, False), (2048, 128, False), (2048, 5632, True)} <= set(shapes.values())
    assert shapes["kda out | mla out"] == (2048, 2048, False)
    starts = [p for p in FastDecoder.projections(mini) if p.name.endswith("out") and not p.residual]
    assert [p.name for p in starts] == ["kda out", "kda out", "mla out"]
    assert len(FastDecoder.projections(mini)) == 3 * len(mini.kda_layers) + len(mini.mla_layers) + 17


def test_read_floor_group_copies_each_residual_shape_once():
    """bench.serve_glue --groups floor: one copy case per distinct residual-add shape of `nano` (shapes without
    a residual are no output GEMM), counting read + write, and each call copies the next cold weight."""
    import torch

    from bench.serve_glue_projections import read_floor_cases
    from k3core.presets import preset

    nano = preset("nano")
    residual = {(n, k) for n, k, res in distinct_projections(nano).values() if res}
    found = read_floor_cases(nano, torch.Generator().manual_seed(0))
    assert set(found) == {f"floor copy {n}x{k}" for n, k in residual}
    for name, (fused, peer, moved) in found.items():
        n, k = map(int, name.split()[-1].split("x"))
        assert peer is None and moved == 2 * n * k * 2
        first = fused().clone()  # Tensor.copy_ returns its target: the weight just copied
        second = fused()
        assert first.shape == (n, k) and first.abs().sum() > 0
        assert not torch.equal(first, second)  # the next call copies the next weight of the cycle
