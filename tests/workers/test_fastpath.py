"""The decode fast path on CPU (kernels' references through dispatch) against the reference layers.

Oracles: the reference path's tokens (greedy, same engine loop), the pool bytes and logits of one decode
step run both ways from the same pool contents, the reference SparseMoE for both MoE formulations, and
the unpadded forward for padded (CUDA-graph bucket) batches.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3.v1 import common_pb2
from k3core.cache.layout import plan_layout, shape_from_config
from k3core.cache.manager import PrefixCacheManager
from services.engine.config import WorkerConfig
from services.engine.decode_fastpath import DecodeFastPath
from services.engine.executor import Executor
from services.engine.fast_ffn import MoeDecode, grouped_mm_available
from services.engine.model_runner import ModelRunner
from services.engine.params import GenerationOptions
from services.engine.plan import RecordingManager
from services.engine.request import EngineRequest
from services.engine.scheduler import Scheduler
from tests.workers.oracle import build_reference

ROOT = Path(__file__).resolve().parents[2]
HASH_BLOCK = 16
PROMPTS = [[(7 * i + j) % 250 + 1 for j in range(n)] for i, n in enumerate((5, 23, 40, 1, 31))]


class Driver:
    """Scheduler + executor of one rank, greedy; the engine loop without threads or streaming."""

    def __init__(self, model, fastpath: bool, num_pages: int = 96):
        config = WorkerConfig.load("decode", ["--hash-block-tokens", str(HASH_BLOCK), "--num-pages", str(num_pages),
                                              "--step-token-budget", "64"], env={})
        self.manager = PrefixCacheManager(config.pool_layout(), config.num_pages, device="cpu")
        runner = ModelRunner(model, "cpu", max_model_len=256)
        self.executor = Executor(self.manager, runner, rank=0, tp_size=1, total_heads=model.config.kda_num_heads,
                                 instance=common_pb2.InstanceId())
        if fastpath:
            self.executor.fastpath = DecodeFastPath(model, self.manager, max_model_len=256, max_batch=8)
        self.fast_steps = 0
        self.recording = RecordingManager(self.manager)
        self.scheduler = Scheduler(self.recording, hash_block_tokens=HASH_BLOCK, max_running=8,
                                   step_token_budget=64, model_name="nano")
        self.options = GenerationOptions.from_proto(common_pb2.SamplingParams(max_tokens=999, ignore_eos=True),
                                                    vocab_size=model.config.vocab_size, max_tokens_limit=999)

    def generate(self, prompts: list[list[int]], new_tokens: int, finish: bool = True) -> list[list[int]]:
        reqs = [EngineRequest(f"r{i}", p, self.options, lambda out: None) for i, p in enumerate(prompts)]
        for req in reqs:
            self.scheduler.add(req)
        while any(len(r.output) < new_tokens for r in reqs):
            plan = self.scheduler.schedule()
            self.fast_steps += self.executor.fastpath is not None and all(len(f.token_ids) == 1 for f in plan.forward)
            logits = self.executor.execute(plan).logits
            for row, item in enumerate(f for f in plan.forward if f.sample):
                req = next(r for r in reqs if r.rid == item.rid)
                token = int(torch.argmax(logits[row]))
                req.output.append(token)
                if len(req.output) >= new_tokens and finish:
                    self.scheduler.remove(req, keep_turn=False)
                else:
                    self.recording.call("append_tokens", req.rid, [token])
        return [r.output[:new_tokens] for r in reqs]

    def reserve_step(self, limit: int | None = None) -> tuple[list[str], list]:
        """Pages for one more token of every request (of the first `limit`, by id): (rids, cached requests)."""
        rids = sorted(self.manager.requests)[:limit]
        for rid in rids:
            self.manager.reserve(rid, 1)
        return rids, [self.manager.requests[r] for r in rids]


@pytest.fixture(scope="module")
def nano():
    return build_reference("nano", seed=3)


def test_fast_path_generates_the_reference_tokens(nano):
    reference = Driver(copy.deepcopy(nano), fastpath=False).generate(PROMPTS, 20)
    fast = Driver(copy.deepcopy(nano), fastpath=True)
    assert fast.generate(PROMPTS, 20) == reference
    assert fast.fast_steps >= 10  # the comparison did exercise the fast path


def _decoding_driver(nano) -> Driver:
    """A pool whose requests sit at decode positions, some right before a block boundary (16 tokens)."""
    driver = Driver(copy.deepcopy(nano), fastpath=True)
    driver.generate([p + [3] * k for p, k in zip(PROMPTS, (10, 9, 8, 14, 0), strict=True)], 1, finish=False)
    return driver


def test_one_step_writes_the_same_pool_bytes_and_logits(nano):
    driver = _decoding_driver(nano)
    manager, fast = driver.manager, driver.executor.fastpath
    rids, cached = driver.reserve_step()
    tokens = [11 * i + 4 for i in range(len(rids))]
    before = manager.store.data.clone()
    fast_logits = fast.forward(cached, tokens)
    fast_bytes = manager.store.data.clone()
    manager.store.data.copy_(before)
    ref_logits = driver.executor.runner.forward([[t] for t in tokens], manager.batch_view(rids))
    torch.testing.assert_close(fast_logits, ref_logits, rtol=1e-4, atol=1e-4)
    layout = manager.layout
    pages = {p for r in cached for p in r.state_pages} | {p for r in cached for b in r.blocks for p in b.pages}
    for page in sorted(pages):
        got, want = fast_bytes[page].view(torch.float32), manager.store.data[page].view(torch.float32)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f"page {page}")
    others = [p for p in range(manager.pool.num_pages) if p not in pages
              and p not in (fast.builder.scratch_kda, fast.builder.scratch_mla)]
    assert torch.equal(fast_bytes[others], before[others])  # nothing else was written
    assert layout.num_kda_groups > 1 and layout.layers_per_group > 1  # slots and groups are exercised


def test_one_kda_decode_call_per_layer_over_all_heads(nano, monkeypatch):
    """The launch count the docs state: one kda_decode_step per KDA layer per step, with every head in it."""
    from kernels import dispatch

    driver = _decoding_driver(nano)
    fast = driver.executor.fastpath
    rids, cached = driver.reserve_step()
    calls = []
    step = dispatch.kda_decode_step
    monkeypatch.setattr(dispatch, "kda_decode_step",
                        lambda q, *args, **kw: calls.append(q.shape) or step(q, *args, **kw))
    fast.forward(cached, [3] * len(rids))
    config = nano.config
    assert calls == [(len(rids), config.kda_num_heads, config.kda_head_dim)] * len(config.kda_layers)


def test_padded_rows_leave_the_real_rows_alone(nano):
    driver = _decoding_driver(nano)
    manager, fast = driver.manager, driver.executor.fastpath
    rids, cached = driver.reserve_step()
    tokens = [5] * len(rids)
    before = manager.store.data.clone()
    plain = fast.decoder.forward(fast.builder.view(torch.from_numpy(fast.builder.build(cached, tokens, 5)), 5))
    plain_bytes = manager.store.data.clone()
    manager.store.data.copy_(before)
    padded = fast.decoder.forward(fast.builder.view(torch.from_numpy(fast.builder.build(cached, tokens, 8)), 8))
    torch.testing.assert_close(padded[:5], plain, rtol=1e-5, atol=1e-5)
    # A different batch size may round differently in the GEMMs, so the requests' pages are compared
    # closely; every page that is neither theirs nor scratch must not change at all.
    scratch = [fast.builder.scratch_kda, fast.builder.scratch_mla]
    theirs = sorted({p for r in cached for p in r.state_pages} | {p for r in cached for b in r.blocks for p in b.pages})
    torch.testing.assert_close(manager.store.data[theirs].view(torch.float32),
                               plain_bytes[theirs].view(torch.float32), rtol=1e-3, atol=1e-5)
    rest = [p for p in range(manager.pool.num_pages) if p not in scratch and p not in theirs]
    assert torch.equal(manager.store.data[rest], before[rest])


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (random bytes read as floats hold NaNs, which torch.equal never calls equal)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_kda_pool_views_address_each_heads_byte_range(nano):
    """One layer's [pages, H, D, D] / [pages, 3, H, D, W-1] views read exactly the bytes the layout gives
    head h of that layer slot: [head][layer slot][recurrent | conv] per page (k3core.cache.layout)."""
    from k3core.cache.pool_views import PoolViews

    layout = plan_layout(shape_from_config(nano.config, "nano"), 1, hash_block_tokens=HASH_BLOCK)
    data = torch.randint(0, 256, (5, layout.page_bytes), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(0))
    views = PoolViews(data, layout)
    d, w = layout.shape.kda_head_dim, layout.shape.conv_kernel
    for kda_layer in range(layout.shape.num_kda_layers):
        state, conv = views.kda_state(kda_layer), views.kda_conv(kda_layer)
        heads = layout.heads_per_rank
        assert state.shape == (5, heads, d, d) and conv.shape == (5, 3, heads, d, w - 1)
        slot = layout.kda_slot(kda_layer)[1]
        for page, head in ((0, 0), (3, layout.heads_per_rank - 1), (4, 1)):
            start = head * layout.kda_head_stride + slot * layout.kda_layer_stride
            recurrent = data[page, start : start + d * d * 4].view(torch.float32).view(d, d)
            conv_bytes = 3 * d * (w - 1) * layout.conv_dtype.itemsize
            window = data[page, start + layout.kda_recurrent_bytes :][:conv_bytes].view(layout.conv_dtype)
            assert _same_bytes(state[page, head], recurrent)
            assert _same_bytes(conv[page, :, head], window.view(3, d, w - 1))


@pytest.mark.parametrize(("grouped", "tokens", "dense"), [(True, 3, False), (True, 9, True), (True, 200, False),
                                                        (False, 3, True)])
def test_batched_moe_equals_the_reference_moe(nano, grouped, tokens, dense):
    if grouped and not grouped_mm_available(torch.device("cpu"), torch.float32):
        pytest.skip("torch._grouped_mm is not available in this torch build")
    model = copy.deepcopy(nano)
    moe = next(layer.block_sparse_moe for layer in model.model.layers if layer.is_moe)
    x = torch.randn(tokens, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = moe(x)
        fast = MoeDecode(moe, model.config, grouped)
        assert fast.dense(tokens) == dense  # the formulation under test is the one that runs
        got = fast(x)
        assert torch.equal(moe(x), want)  # the reference still runs on the stacked weights' views
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


INTERPRETED = """
import copy, torch
import kernels.dispatch as dispatch
from tests.workers.oracle import build_reference
from tests.workers.test_fastpath import _decoding_driver
driver = _decoding_driver(build_reference("nano", seed=3))
manager, fast = driver.manager, driver.executor.fastpath
rids, cached = driver.reserve_step(2)
tokens = [9 * i + 2 for i in range(len(rids))]
before = manager.store.data.clone()
dispatch.use_triton = lambda *tensors: True  # CPU tensors to the Triton launchers, run by the interpreter
triton_logits = fast.forward(cached, tokens)
manager.store.data.copy_(before)
ref_logits = driver.executor.runner.forward([[t] for t in tokens], manager.batch_view(rids))
torch.testing.assert_close(triton_logits, ref_logits, rtol=1e-3, atol=1e-3)
print("ok", float((triton_logits - ref_logits).abs().max()))
"""


def test_triton_kernels_on_the_pool_views_under_the_interpreter():
    """The Triton launchers themselves (interpreted) on the zero-copy pool views give the reference logits."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok")


def test_fused_prefill_attention_equals_the_naive_form(nano):
    """The GPU prefill form of Gated MLA (one SDPA call, lower-right causal) against the naive einsums."""
    from k3core.ops.mla import causal_mask, mla_attention_naive

    attn = next(layer.self_attn for layer in nano.model.layers if not hasattr(layer.self_attn, "kda_index"))
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(7, attn.heads, attn.nope + attn.rope, generator=gen)
    latent = torch.randn(19, attn.rank + attn.rope, generator=gen)
    want = mla_attention_naive(q[..., : attn.nope], q[..., attn.nope :], latent, attn.kv_b_proj.weight,
                               attn.v_dim, attn.scale, causal_mask(7, 19))
    with torch.no_grad():
        torch.testing.assert_close(attn._prefill_fused(q, latent), want, rtol=1e-5, atol=1e-5)


def _one_step(model, fastpath: bool, dtype: torch.dtype) -> torch.Tensor:
    """Prefill three prompts (reference layers) into a pool of `dtype`, then one decode step of token 7."""
    layout = plan_layout(shape_from_config(model.config, "nano"), 1, conv_dtype=dtype, mla_dtype=dtype,
                         hash_block_tokens=HASH_BLOCK)
    manager = PrefixCacheManager(layout, 64, device="cpu")
    runner = ModelRunner(model, "cpu")
    fast = DecodeFastPath(model, manager, max_model_len=256, max_batch=4) if fastpath else None
    rids = [f"b{i}" for i in range(3)]
    for rid, prompt in zip(rids, PROMPTS, strict=False):
        manager.add_request(rid, prompt + [7])
        manager.reserve(rid, len(prompt))
        manager.pre_forward()
        runner.forward([prompt], manager.batch_view([rid]))
        manager.forward_done(rid)
        manager.commit_step()
        manager.reserve(rid, 1)
    if fast is not None:
        return fast.forward([manager.requests[r] for r in rids], [7, 7, 7])
    return runner.forward([[7]] * 3, manager.batch_view(rids))


def test_bfloat16_step_is_as_close_to_float32_as_the_reference(nano):
    """The served dtype: a bf16 decode step of the fast path and of the reference layers, each against the
    float32 computation of the same (bf16-rounded) weights. Routing is made decisive (a large selection
    bias on four experts): a near tie in the top-k flips under bf16 rounding, and then any two bf16
    implementations differ by a whole expert, which says nothing about either."""
    model = copy.deepcopy(nano).to(torch.bfloat16)
    for layer in model.model.layers:
        if layer.is_moe:
            layer.block_sparse_moe.gate.e_score_correction_bias.data[:4] = 10.0
    oracle = _one_step(copy.deepcopy(model).float(), False, torch.float32)
    fast = _one_step(copy.deepcopy(model), True, torch.bfloat16)
    reference = _one_step(copy.deepcopy(model), False, torch.bfloat16)
    fast_err, ref_err = float((fast - oracle).abs().max()), float((reference - oracle).abs().max())
    print(f"max |logit - float32|: fast path {fast_err:.4f}, reference {ref_err:.4f}")
    assert fast_err <= 1.5 * ref_err + 1e-3
    assert torch.equal(fast.argmax(-1), oracle.argmax(-1))
