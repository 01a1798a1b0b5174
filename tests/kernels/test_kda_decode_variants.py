"""The KDA decode-step variants the benchmark times (kernels/perf/kda_decode_cases.DECODE_VARIANTS).

Each one on the serving pool's view (nano's layout, Triton interpreter) against the reference and the
per-head launches, with no byte outside the addressed slots written; and (`-m slow`) each one (and the default)
built for sm_90 at `mini`'s served shapes, as tests/kernels/test_sm90_compile.py builds the launchers' defaults.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch

from kernels.perf.kda_decode_cases import DECODE_VARIANTS, DecodeVariant, pool_view_case, pool_view_errors


@pytest.mark.parametrize("variant", DECODE_VARIANTS, ids=lambda v: v.label)
def test_variant_on_the_pool_view_matches_reference(interpreted, variant: DecodeVariant):
    torch.manual_seed(23)
    case = pool_view_case("nano", 2, "cpu", dtype=torch.float32)
    dim = case.layout.shape.kda_head_dim
    scaled = dataclasses.replace(variant, block_v=variant.block_v * dim // 128)  # the same split of nano's dim
    step = partial(scaled.launch, case.x, case.params, slots=case.slots)

    errors = pool_view_errors(case, 2, step)

    assert errors["y_max_abs"] < 1e-5 and errors["state_max_abs"] < 1e-5 and errors["conv_max_abs"] == 0
    assert errors["per_head_y_max_abs"] < 1e-5 and errors["per_head_state_max_abs"] < 1e-6
    assert errors["per_head_conv_max_abs"] == 0
    assert errors["outside_unchanged"] is True


@pytest.mark.slow
def test_variants_compile_for_sm90():
    from tests.kernels.sm90_launch_cases import DECODE_BATCHES, kda_params, kda_pool, kda_tokens
    from tests.kernels.test_sm90_compile import _check, _record

    cases = {f"kda decode {v.label} B={b}": partial(v.launch, kda_tokens(b), kda_params(), *kda_pool(b))
             for v in (DecodeVariant(), *DECODE_VARIANTS) for b in DECODE_BATCHES}
    specs = _record(cases).unique()
    assert len(specs) > len(DECODE_VARIANTS)  # the default build and every variant's
    assert {s.kernel for s in specs} == {"kernels.kda.decode_step_triton:_kda_decode_step_kernel"}
    _check(specs)
