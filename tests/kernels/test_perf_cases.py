"""kernels/perf/kda_decode_cases.py's pool-view case on the CPU (Triton interpreter, nano's pool layout).

The GPU benchmark reports these same error fields beside its timings; here they are held to the reference
(kernels.kda.naive on dense copies) and to the per-head launches, on a tiny shape.
"""

from __future__ import annotations

import torch

from kernels.kda import decode_step_triton
from kernels.perf import kda_decode_cases
from kernels.perf.kda_decode_cases import pool_view_case, pool_view_errors, strided_step


def test_pool_view_case_matches_reference_and_per_head_launches(interpreted):
    torch.manual_seed(21)
    case = pool_view_case("nano", 3, "cpu", dtype=torch.float32)
    assert case.layer > 0 and case.layout.layers_per_group > 1  # a slot at a non-zero offset in the page
    assert case.x[0].stride(0) > case.x[0].shape[1] * case.x[0].shape[2]  # row-strided inputs, as served
    before = case.data.clone()

    errors = pool_view_errors(case, check_n=3)

    assert torch.equal(case.data, before)  # the check leaves the buffer as it found it
    assert errors["y_max_abs"] < 1e-5 and errors["state_max_abs"] < 1e-5 and errors["conv_max_abs"] == 0
    assert errors["per_head_y_max_abs"] < 1e-6 and errors["per_head_state_max_abs"] < 1e-6
    assert errors["per_head_conv_max_abs"] == 0
    assert errors["outside_unchanged"] is True
    state, conv = case.views()
    strided_step(case, state, conv)
    assert not torch.equal(case.data, before)  # the step writes the pool (the zero errors above mean something)


def test_pool_view_errors_see_a_write_outside_the_slots(interpreted, monkeypatch):
    """The outside check is live: a step that also writes an unaddressed page is reported."""
    torch.manual_seed(22)
    case = pool_view_case("nano", 2, "cpu", dtype=torch.float32)
    free = sorted(set(range(case.data.shape[0])) - set(case.slots.tolist()))[0]

    def also_free_page(step_case, state, conv):
        decode_step_triton.kda_decode_step(*(t[:1] for t in step_case.x), *step_case.params, state, conv,
                                           torch.tensor([free], dtype=torch.int32))
        return strided_step(step_case, state, conv)

    monkeypatch.setattr(kda_decode_cases, "strided_step", also_free_page)
    assert pool_view_errors(case, check_n=2)["outside_unchanged"] is False
