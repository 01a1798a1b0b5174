"""The prefill fast path's AttnRes kernels compile a fixed set of variants that a worker's warm-up runs: a
plan per chunk length (rows per program, D chunks filling the SMs) made a 512- or 4096-token chunk after the
warm-up's 8192 + 7 compile new variants inside the request (~3.5 s on the H200, bench.serve_ttft session 6).
With the pinned launch arguments (`fast_prefill.LOGITS_LAUNCH`, `INTER_LAUNCH`) the variants differ only by
the row count's divisibility class, which `WARMUP_ROWS` with a full-budget chunk and an odd tail cover.
Triton's own binder, for sm_90 (kernels.compile_check.record_launches); the layers are stubbed out (they
are the reference layers', warmed as before), the real `FastDecoder._attn_res` drives the launchers. The same
recording shows each fast path's launch forms: merges without h at prefill, the block copy fused at decode."""

from __future__ import annotations

import copy

import pytest
import torch

from k3core.cache.layout import plan_layout, shape_from_config
from k3core.cache.manager import PrefixCacheManager
from kernels import dispatch
from services.engine import fast_prefill
from services.engine.model_runner import ModelRunner
from tests.workers.oracle import build_reference


def _attn_res_specs(decoder, rows: list[int]) -> list[dict]:
    """The specs recorded after each row count's AttnRes pass (by key), cumulative."""
    from kernels.compile_check import record_launches

    hidden = decoder.config.hidden_size
    stub = copy.copy(decoder)
    stub.attention = [lambda x, *a, residual=None: x.clone() for _ in decoder.attention]
    stub.ffn = [lambda x, *a, residual=None: x.clone() for _ in decoder.ffn]
    seen = []
    with record_launches() as recorder, pytest.MonkeyPatch.context() as patch:
        patch.setattr(dispatch, "use_triton", lambda *tensors: True)
        for m in rows:
            stub._attn_res(torch.zeros(m, hidden, dtype=torch.bfloat16), None)
            seen.append(dict(recorder.specs))
    return seen


@pytest.fixture(scope="module")
def decoders():
    """(the decode fast path's decoder, the prefill fast path's)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("K3_DECODE_FASTPATH", "1")
        model = build_reference("nano", {"hidden_size": 2048}, seed=0).to(torch.bfloat16)  # mini's D
        layout = plan_layout(shape_from_config(model.config, "nano"), 1, hash_block_tokens=16)
        runner = ModelRunner(model, "cpu", max_model_len=64, max_batch=2)
        fast = runner.decode_fastpath(PrefixCacheManager(layout, 16, device="cpu"), tp_size=1)
    assert fast is not None and runner.fast_prefill is not None
    return fast.decoder, runner.fast_prefill.decoder


@pytest.fixture(scope="module")
def decoder(decoders):
    return decoders[1]


def test_every_chunk_length_shares_the_warmed_variants(decoder):
    warm = [8192, 257, *fast_prefill.WARMUP_ROWS]  # mini's budget, a 512-token hash block's tail, the classes
    later = [3, 4, 5, 16, 24, 36, 100, 500, 512, 1500, 2048, 4096, 6000, 8000]
    seen = _attn_res_specs(decoder, warm + later)
    assert seen[-1] == seen[len(warm) - 1]


@pytest.mark.parametrize("left_out", fast_prefill.WARMUP_ROWS)
def test_each_warmup_row_count_is_needed(decoder, left_out):
    warm = [8192, 257, *(n for n in fast_prefill.WARMUP_ROWS if n != left_out)]
    later = [3, 4, 5, 16, 24, 36, 100, 500, 512, 1500, 2048, 4096, 6000, 8000, left_out]
    seen = _attn_res_specs(decoder, warm + later)
    assert seen[-1] != seen[len(warm) - 1]


def test_without_the_pinned_launches_new_lengths_compile_new_variants(decoder):
    """The control: the launchers' own plans (the decode fast path's) give a 512-token chunk variants of its
    own after the same warm-up."""
    planned = copy.copy(decoder)
    planned.logits_launch, planned.inter_launch = {}, {}
    warm = [8192, 257, *fast_prefill.WARMUP_ROWS]
    seen = _attn_res_specs(planned, [*warm, 512])
    assert seen[-1] != seen[-2]


def _constexprs(specs: dict, kernel: str) -> list[dict]:
    """The named constexprs of every recorded launch of `kernel` (a function name)."""
    launches = [spec for spec in specs.values() if spec.kernel.endswith(f":{kernel}")]
    return [{list(spec.signature)[path[0]]: v for path, v in spec.constexprs.items()} for spec in launches]


@pytest.mark.parametrize(("form", "rows", "store_h", "fused_copy"), [("decode", 64, False, True),
                                                                     ("prefill", 512, False, False)])
def test_launch_forms_of_each_fast_path(decoders, form, rows, store_h, fused_copy):
    """What 25d1248 pinned: a prefill forward's merges never write h (`fast_prefill.MERGE_LAUNCH`; nothing reads
    it) and its block logits leave the block copy to torch (unchunked launches); at decode no merge writes h
    either (timed as served in session 9: docs/kernels.md history 40) and every completed block is copied into
    the block buffer by its logits launch (`copy_to`, D-chunked at decode sizes)."""
    decoder = decoders[form == "prefill"]
    specs = _attn_res_specs(decoder, [rows])[-1]
    merges, logits = _constexprs(specs, "_merge_norm_kernel"), _constexprs(specs, "_block_logits_kernel")
    assert merges and all(c["STORE_H"] is store_h for c in merges)
    assert logits and all(c["COPY"] is fused_copy for c in logits)
