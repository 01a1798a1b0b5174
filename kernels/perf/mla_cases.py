"""Paged MLA decode on the H200: ours (split-KV Triton) vs torch SDPA over gathered pages (GPU only)."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from kernels.mla import decode_triton, naive
from kernels.perf.harness import Row, rel_err, time_ms

R, P, PAGE, HEADS = 512, 64, 64, 16
BF16 = torch.bfloat16


def _case(batch: int, ctx: int, dev: str = "cuda"):
    pages = ctx // PAGE
    cache = torch.randn(batch * pages, PAGE, R + P, device=dev, dtype=BF16)
    table = torch.randperm(batch * pages, device=dev).reshape(batch, pages).int()
    q = torch.randn(batch, HEADS, R + P, device=dev, dtype=BF16)
    return q, cache, table, torch.full((batch,), ctx, device=dev, dtype=torch.int32)


def _sdpa_gathered(q, cache, table, scale):
    """The plain-torch way: gather every page of every sequence, then one SDPA call (MQA via GQA)."""
    B = q.shape[0]
    kv = cache[table.long()].reshape(B, 1, -1, R + P)
    return F.scaled_dot_product_attention(q.unsqueeze(2), kv, kv[..., :R], scale=scale, enable_gqa=True)


def mla_bytes(batch: int, ctx: int) -> float:
    """Least bytes: every cached row once (bf16), the absorbed queries in and the latent outputs out (bf16);
    the split partials are not counted (a kernel that needs none moves only these)."""
    return batch * ctx * (R + P) * 2 + batch * HEADS * (R + P + R) * 2


# Tuning arguments of mla_decode_paged; unnamed ones take their defaults.
# The second is the previous default (sessions 4-8: 64-row tiles, 2 stages: one buffer under Triton 3.6).
VARIANTS: tuple[dict, ...] = ({}, {"block_n": 64, "num_stages": 2})


def _name(v: dict) -> str:
    return "ours(" + ",".join(f"{k}={val}" for k, val in v.items()) + ")" if v else "ours(defaults)"


def _variant_errors(case, variants: tuple[dict, ...], scale: float) -> dict[str, float | str]:
    """Each variant's error against the reference on ragged lengths (4096, 1, 1000, 2049) over `case`'s pages
    (`case(4, 4096)`); a variant that fails to build or run: its exception, cut short."""
    q, cache, table, _ = case(4, 4096)
    lengths = torch.tensor([4096, 1, 1000, 2049], device=q.device, dtype=torch.int32)
    ref = naive.mla_decode_paged(q, cache, table, lengths, scale)
    errs: dict[str, float | str] = {}
    for v in variants:
        try:
            errs[_name(v)] = rel_err(decode_triton.mla_decode_paged(q, cache, table, lengths, scale, **v), ref)
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory for a variant
            errs[_name(v)] = repr(e)[:100]
    return errs


def _variant_rows(kernel: str, shape: str, inputs: tuple, scale: float, nbytes: float, variants: tuple[dict, ...],
                  errs: dict[str, float | str]) -> list[Row]:
    """One timed row per variant on `inputs` (q, cache, table, lengths); a failure: a NaN row with its note."""
    rows: list[Row] = []
    for v in variants:
        try:
            ms, how = time_ms(partial(decode_triton.mla_decode_paged, *inputs, scale, **v))
            rows.append(Row(kernel, shape, _name(v), ms, nbytes, note=how, extra={"rel_err": errs.get(_name(v))}))
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory for a variant
            rows.append(Row(kernel, shape, _name(v), float("nan"), note=repr(e)[:200]))
    return rows


def mla_rows(shapes: tuple[tuple[int, int], ...] = ((64, 4096), (64, 16384), (64, 65536), (1, 65536), (16, 65536)),
             variants: tuple[dict, ...] = VARIANTS) -> list[Row]:
    rows: list[Row] = []
    scale = (128 + 64) ** -0.5
    errs = _variant_errors(_case, variants, scale)  # correctness on fresh inputs with ragged lengths
    for B, ctx in shapes:
        q, cache, table, lengths = _case(B, ctx)
        shape = f"B={B},ctx={ctx},H={HEADS},page={PAGE}"
        rows += _variant_rows("mla_decode_paged", shape, (q, cache, table, lengths), scale, mla_bytes(B, ctx),
                              variants, errs)
        try:
            ms, how = time_ms(partial(_sdpa_gathered, q, cache, table, scale), inner=3, reps=10)
            rows.append(Row("mla_decode_paged", shape, "torch SDPA over gathered pages", ms, mla_bytes(B, ctx),
                            note=how))
        except Exception as e:  # noqa: BLE001
            rows.append(Row("mla_decode_paged", shape, "torch SDPA over gathered pages", float("nan"),
                            note=repr(e)[:200]))
        del q, cache, table
        torch.cuda.empty_cache()
    return rows


def pool_cache(pages: int, dev: str = "cuda") -> torch.Tensor:
    """One MLA layer's rows as the serving pool of `mini` holds them (1,024-token pages, page- and row-strided)."""
    from k3core.cache.layout import plan_layout, shape_from_config
    from k3core.cache.pool_views import PoolViews
    from k3core.presets import preset

    layout = plan_layout(shape_from_config(preset("mini"), "mini"), 1, state_dtype=torch.float32,
                         conv_dtype=torch.bfloat16, mla_dtype=BF16, hash_block_tokens=512)
    return PoolViews(torch.empty(pages, layout.page_bytes, dtype=torch.uint8, device=dev), layout).mla_cache(0)


def pool_case(batch: int, ctx: int, max_pages: int = 64, dev: str = "cuda"):
    """q, cache, page table [batch, max_pages] (a fixed width, as an engine's: one specialisation for every
    context), lengths: each sequence's pages scattered over the pool."""
    page = 1024
    used = batch * -(-ctx // page)
    cache = pool_cache(used + 64, dev)
    table = torch.zeros(batch, max_pages, dtype=torch.int32, device=dev)
    table[:, : -(-ctx // page)] = torch.randperm(used + 64, device=dev)[:used].reshape(batch, -1).int()
    cache[table[:, : -(-ctx // page)].long().flatten()] = torch.randn(used, page, R + P, device=dev, dtype=BF16)
    q = torch.randn(batch, HEADS, R + P, device=dev, dtype=BF16)
    return q, cache, table, torch.full((batch,), ctx, device=dev, dtype=torch.int32)


def pool_rows(shapes: tuple[tuple[int, int], ...] = ((64, 1024), (64, 4096), (64, 16384), (16, 4096), (1, 65536)),
              variants: tuple[dict, ...] = VARIANTS) -> list[Row]:
    """Each variant on the serving pool's view, with its error against the reference on ragged lengths."""
    rows: list[Row] = []
    scale = (128 + 64) ** -0.5
    errs = _variant_errors(pool_case, variants, scale)
    for B, ctx in shapes:
        q, cache, table, lengths = pool_case(B, ctx)
        rows += _variant_rows("mla_decode_paged (pool view)", f"B={B},ctx={ctx},H={HEADS},page=1024",
                              (q, cache, table, lengths), scale, mla_bytes(B, ctx), variants, errs)
        del q, cache, table
        torch.cuda.empty_cache()
    return rows
