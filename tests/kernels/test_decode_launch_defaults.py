"""The tunings session 9 made default after H200 runs, pinned where the serving path launches them: the
launchers are called as the fast path calls them (no tuning arguments) at `mini`'s served shapes, and their
launches recorded for sm_90 (kernels.compile_check.record_launches: Triton's binder, nothing run).

- MLA decode (docs/kernels.md MLA history 39): 32-row page tiles with 5 pipeline stages (Triton 3.6 gives the
  page-indirect tile loads two buffers from 5 stages), 4 splits at 64 rows; the old 64-row, 2-stage tile lost.
- KDA decode step (history 38): the state's loads issued after the inputs' (STATE_AFTER_INPUTS).
"""

from __future__ import annotations

import pytest

from kernels.compile_check import record_launches
from kernels.kda import decode_step_triton as kda_decode
from tests.kernels.sm90_launch_cases import kda_params, kda_pool, kda_tokens, mla_step


def _launches(call, kernel: str) -> list[tuple[dict, dict]]:
    """(named constexprs, options) of each recorded launch of `kernel` (a function name) by `call()`."""
    with record_launches() as recorder:
        call()
    found = []
    for spec in recorder.unique():
        if spec.kernel.endswith(f":{kernel}"):
            names = list(spec.signature)
            found.append(({names[path[0]]: v for path, v in spec.constexprs.items()}, spec.options))
    return found


@pytest.mark.parametrize("batch", [16, 64])
def test_mla_decode_runs_32_row_page_tiles_with_5_stages(batch):
    launches = _launches(lambda: mla_step(batch), "_mla_split_kernel")
    assert len(launches) == 1
    constexprs, options = launches[0]
    assert (constexprs["BN"], constexprs["PAGE_TILES"], options["num_stages"]) == (32, True, 5)
    assert constexprs["NUM_SPLITS"] == {16: 16, 64: 4}[batch]  # about two programs per SM


@pytest.mark.parametrize("batch", [16, 64])
def test_kda_decode_step_loads_the_state_after_the_inputs(batch):
    launches = _launches(lambda: kda_decode.kda_decode_step(*kda_tokens(batch), *kda_params(), *kda_pool(batch)),
                         "_kda_decode_step_kernel")
    assert [constexprs["STATE_AFTER_INPUTS"] for constexprs, _ in launches] == [True]
