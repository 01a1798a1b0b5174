"""The fused MoE of the decode fast path (kernels/fused through dispatch, CPU references): every variant
(dense / grouped experts, latent / plain MoE, with and without a residual, with and without the latent
norm and shared experts, SwiGLU) equals the reference SparseMoE plus the residual, and one MoE layer issues only the launches it
is meant to (a budget that fails when glue creeps back)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels import dispatch
from kernels.fused import naive
from services.engine.fast_ffn import (
    DENSE_FORM_ENV,
    DENSE_FORMS,
    FORM_MAX_TOKENS,
    ROUTED_FORM,
    MoeDecode,
    dense_form,
    grouped_mm_available,
    padding_rows,
)
from tests.workers.oracle import build_reference

VIEWS = {"view", "_unsafe_view", "t", "transpose", "slice", "select", "expand", "detach", "alias", "as_strided",
         "unsqueeze", "reshape", "split", "split_with_sizes", "permute"}  # metadata only: no kernel
FUSED = ("moe_route", "moe_align", "moe_combine", "situ_glu_fused", "expert_gate_up_glu")


def _moe(overrides: dict | None = None):
    model = build_reference("nano", overrides, seed=5)
    return model, next(layer.block_sparse_moe for layer in model.model.layers if layer.is_moe)


def test_grouped_form_only_where_a_cuda_graph_can_capture_it():
    """On CUDA only bf16 has torch's grouped GEMM kernel; fp32 there runs a fallback that copies to the host, which
    a decode-graph capture refuses (seen on the H200): the fast path must take the dense form instead. Decided
    before touching the device, so it holds on a machine without CUDA too."""
    assert not grouped_mm_available(torch.device("cuda"), torch.float32)
    assert not grouped_mm_available(torch.device("cuda"), torch.float16)


def test_dense_form_from_the_environment(monkeypatch):
    """K3_DENSE_EXPERTS picks the dense experts' kernels up to FORM_MAX_TOKENS rows (above, where the Triton down
    projection lost to cuBLAS, every form runs as 'pointer'); where the default ('routed') meets the dense form,
    'tma-down'; a name it does not know is an error naming the known ones, not a silent fallback."""
    monkeypatch.delenv(DENSE_FORM_ENV, raising=False)
    assert dense_form(FORM_MAX_TOKENS) == DENSE_FORMS["tma-down"] == ({"tma": True}, {"tma": True})
    assert dense_form(FORM_MAX_TOKENS + 1) == DENSE_FORMS["pointer"] == ({}, None)
    monkeypatch.setenv(DENSE_FORM_ENV, "tma")
    assert dense_form(1) == ({"tma": True}, None)
    monkeypatch.setenv(DENSE_FORM_ENV, "tma-ws")  # a form that was removed
    with pytest.raises(ValueError, match="tma-down"):
        dense_form(1)


@pytest.mark.parametrize(("overrides", "tokens", "with_residual"), [
    (None, 9, True), (None, 3, True), ({"routed_expert_hidden_size": None}, 9, True),
    ({"routed_expert_hidden_size": None, "hidden_act": "silu"}, 3, False),
    ({"latent_moe_use_norm": False, "num_shared_experts": 0}, 9, True)])
def test_moe_variants_equal_the_reference(overrides, tokens, with_residual):
    grouped = grouped_mm_available(torch.device("cpu"), torch.float32)
    if tokens == 3 and not grouped:
        pytest.skip("torch._grouped_mm is not available in this torch build")
    model, moe = _moe(overrides)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, model.config.hidden_size, generator=gen)
    residual = torch.randn(tokens, model.config.hidden_size, generator=gen)
    with torch.no_grad():
        want = moe(x) + (residual if with_residual else 0)
        fast = MoeDecode(moe, model.config, grouped)
        assert fast.dense(tokens) == (tokens == 9 or not grouped)
        got = fast(x, residual.clone() if with_residual else None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class LaunchLog(TorchDispatchMode):
    """The aten ops (kernel launches on a GPU, view ops aside) and fused dispatch calls of a region."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.muted = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.muted and name not in VIEWS:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))

    def opaque(self, name: str):
        """dispatch.<name> logged as one launch (its CPU reference's own ops are not counted)."""
        inner = getattr(dispatch, name)

        def run(*a, **k):
            self.ops.append(name)
            self.muted = True
            try:
                return inner(*a, **k)
            finally:
                self.muted = False
        return run


@pytest.mark.parametrize(("tokens", "budget"), [(9, 6), (3, 9)])
def test_one_moe_layer_launches_within_budget(monkeypatch, tokens, budget):
    """Dense (9 tokens): router (logits and selection), x GEMM, experts' gate|up GEMM with the activation,
    experts' down bmm, combine, output GEMM with the residual = 6; grouped (3 tokens): the same router and
    x GEMM, align, row gather, grouped GEMM, activation, grouped GEMM, combine, output GEMM = 9 (before:
    9 and 11 with the router's float32 cast, cuBLAS GEMM and separate selection, the dense gate|up GEMM and
    activation apart; the torch forms before the fused glue: ~30 launches on the GPU)."""
    if tokens == 3 and not grouped_mm_available(torch.device("cpu"), torch.float32):
        pytest.skip("torch._grouped_mm is not available in this torch build")
    monkeypatch.setenv(DENSE_FORM_ENV, "tma-down")  # the dense form (the routed one: its own test)
    model, moe = _moe()
    x = torch.randn(tokens, model.config.hidden_size)
    fast = MoeDecode(moe, model.config, grouped=True)
    log = LaunchLog()
    for name in FUSED:
        monkeypatch.setattr(dispatch, name, log.opaque(name))
    residual = torch.zeros(tokens, model.config.hidden_size)
    with torch.no_grad(), log:
        fast(x, residual)
    assert log.ops.count("moe_route") == 1 and log.ops.count("moe_combine") == 1
    if tokens == 9:
        assert log.ops.count("expert_gate_up_glu") == 1 and "situ_glu_fused" not in log.ops
    assert len(log.ops) <= budget, log.ops


@pytest.mark.parametrize(("overrides", "tokens"), [(None, 9), ({"routed_expert_hidden_size": None}, 9),
                                                   ({"hidden_act": "silu"}, 12)])
def test_routed_form_equals_the_reference(monkeypatch, overrides, tokens):
    """K3_DENSE_EXPERTS=routed in the dense range: each expert over its routed rows (dispatch.routed_expert_*,
    the CPU references), the same MoE output as SparseMoE; the form is what runs, it launches no dense expert
    GEMM and no more launches than the dense form."""
    monkeypatch.setenv(DENSE_FORM_ENV, ROUTED_FORM)
    model, moe = _moe(overrides)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(tokens, model.config.hidden_size, generator=gen)
    residual = torch.randn(tokens, model.config.hidden_size, generator=gen)
    log = LaunchLog()
    for name in (*FUSED, "routed_expert_gate_up_glu", "routed_expert_down"):
        monkeypatch.setattr(dispatch, name, log.opaque(name))
    with torch.no_grad():
        want = moe(x) + residual
        fast = MoeDecode(moe, model.config, grouped=True)
        assert fast.dense(tokens) and fast.routed(tokens)
        running = residual.clone()
        with log:
            got = fast(x, running)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert [op for op in log.ops if op in (*FUSED, "routed_expert_gate_up_glu", "routed_expert_down")] == [
        "moe_route", "routed_expert_gate_up_glu", "routed_expert_down", "moe_combine"]  # no alignment launch
    routed_ops = list(log.ops)
    monkeypatch.setenv(DENSE_FORM_ENV, "tma-down")
    log.ops.clear()
    monkeypatch.setattr(dispatch, "expert_down", log.opaque("expert_down"))
    running = residual.clone()
    with torch.no_grad(), log:
        fast(x, running)
    assert "expert_gate_up_glu" in log.ops and len(routed_ops) <= len(log.ops), (routed_ops, log.ops)


def test_routed_form_only_in_the_dense_range_and_unsharded(monkeypatch):
    """Outside the dense range the grouped form runs whatever the setting; a tensor-parallel rank (a routed
    wrapper: its sentinel expert takes the other ranks' pairs) keeps the dense form, as 'tma-down'."""
    model, moe = _moe()
    fast = MoeDecode(moe, model.config, grouped=True)
    monkeypatch.setenv(DENSE_FORM_ENV, "tma-down")
    assert not fast.routed(9)
    monkeypatch.delenv(DENSE_FORM_ENV, raising=False)  # the default
    assert fast.routed(9) and not fast.routed(3) and not fast.routed(200)
    dense_everywhere = MoeDecode(moe, model.config, grouped=False)  # no grouped GEMM: dense at any count
    assert dense_everywhere.routed(1) and dense_everywhere.routed(128) and not dense_everywhere.routed(129)
    assert dense_form(9) == DENSE_FORMS["tma-down"] and dense_form(FORM_MAX_TOKENS + 1) == DENSE_FORMS["pointer"]
    monkeypatch.setenv(DENSE_FORM_ENV, "routed-ws")
    with pytest.raises(ValueError, match="routed"):
        fast.routed(9)
    monkeypatch.setenv(DENSE_FORM_ENV, ROUTED_FORM)
    fast.routed_wrapper = lambda routed, z, weights, indices: routed(z, weights, indices)
    assert not fast.routed(9)


def test_routed_form_routes_padding_rows_to_no_expert(monkeypatch):
    """A batch padded up to its bucket (`padding_rows`: rows whose marker is the scratch value): the real rows'
    outputs are bit for bit those of the layer on the real rows alone, the routed GEMMs get no pair of a
    padding row (their pairs all read the zero row after the R rows: the routed sum 0, the output finite), and
    outside the block the layer knows no padding."""
    monkeypatch.setenv(DENSE_FORM_ENV, ROUTED_FORM)
    model, moe = _moe()
    gen = torch.Generator().manual_seed(4)
    real, size, scratch = 9, 12, 77
    x = torch.randn(size, model.config.hidden_size, generator=gen)
    x[real:] = x[0]  # alike padding rows pick alike experts
    residual = torch.randn(size, model.config.hidden_size, generator=gen)
    marker = torch.tensor([3] * real + [scratch] * (size - real))
    fast = MoeDecode(moe, model.config, grouped=True)
    assert fast.routed(size) and fast.routed(real)
    calls = []
    down = dispatch.routed_expert_down
    monkeypatch.setattr(dispatch, "routed_expert_down", lambda *a, **k: calls.append(out := down(*a, **k)) or out)
    with torch.no_grad():
        alone = fast(x[:real], residual[:real].clone())
        with padding_rows([fast], marker, scratch):
            padded = fast(x, residual.clone())
        assert fast.padding is None
    assert torch.equal(padded[:real], alone) and padded[real:].isfinite().all()
    rows = calls[-1]
    assert rows.shape[0] == size * moe.top_k + 1 and not rows[real * moe.top_k:].any()  # only real rows computed
    _, indices = fast._route(x)
    _, position = naive.routed_expert_gate_up_glu(torch.zeros(size, fast.w13.shape[2]), fast.w13, indices,
                                                  padding=(marker, scratch))
    assert (position[real:] == size * moe.top_k).all()
    assert sorted(position[:real].flatten().tolist()) == list(range(real * moe.top_k))


def test_decode_step_marks_the_rows_on_the_scratch_pages_as_padding(monkeypatch):
    """The fast path's step forward (eager here; a graph captures the same calls, the marker read at replay):
    every MoE layer's routed GEMMs get the rows' KDA state pages and the scratch page, which flags exactly the
    bucket's padding rows; the real rows' logits are those of the unpadded step."""
    from tests.workers.test_fastpath import _decoding_driver

    monkeypatch.setenv(DENSE_FORM_ENV, ROUTED_FORM)
    driver = _decoding_driver(build_reference("nano", seed=3))
    fast = driver.executor.fastpath
    _, cached = driver.reserve_step()
    seen = []
    gate_up = dispatch.routed_expert_gate_up_glu
    monkeypatch.setattr(dispatch, "routed_expert_gate_up_glu",
                        lambda *a, padding=None, **k: seen.append(padding) or gate_up(*a, padding=padding, **k))
    tokens, real, size = [5] * len(cached), len(cached), 8
    before = driver.manager.store.data.clone()
    plain = fast.decoder.forward(fast.builder.view(torch.from_numpy(fast.builder.build(cached, tokens, real)), real))
    driver.manager.store.data.copy_(before)
    seen.clear()
    padded = fast._forward(fast.builder.view(torch.from_numpy(fast.builder.build(cached, tokens, size)), size))
    moe_layers = sum(isinstance(op, MoeDecode) for op in fast.decoder.ffn)
    assert len(seen) == moe_layers > 0
    for marker, value in seen:
        assert value == fast.builder.scratch_kda
        assert (marker == value).tolist() == [False] * real + [True] * (size - real)
    torch.testing.assert_close(padded[:real], plain, rtol=1e-5, atol=1e-5)
