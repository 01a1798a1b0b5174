"""Prefill forwards (any batch with a prefill chunk) through the decode fast path's fused forms.

A prefill forward of the reference model is host-bound below a few thousand new tokens: a warm 512-token
hit on a 32K prefix of `mini` launched ~1,800 kernels for 19 ms of device work and took 76 ms on the H200
(bench/serve_ttft_profile.py, session 6), most of them the float32 element-wise steps of the reference
RMSNorms (7 launches each) and AttnRes sites (~20 each). This forward keeps the reference attention
layers (KDA's fused Triton prefill block, MLA's expanded-key SDPA, both through the BatchCache) and runs
everything else as the decode fast path does (`FastDecoder`): each AttnRes site fused with the sublayer's
input RMSNorm (`dispatch.attnres_merge_norm`), a block's logits once (`attnres_block_logits`), the MLPs and
latent MoE in their fused forms with the residual added in the last GEMM's epilogue. The forms are the fast
decoder's own (a shallow copy with prefill attention forms in place of the decode ones): same weights, same
derived tensors, refreshed together on a weight reload. Measured: docs/serving.md, TTFT, Session 6.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from k3core.cache.interface import BatchCache
from k3core.layers.batch import BatchLayout
from services.engine.fast_decoder import FastDecoder
from services.engine.fast_ffn import MoeDecode

ENV = "K3_PREFILL_FASTPATH"  # "0": prefill forwards run the reference layers (with the grouped MoE forms)
LOGITS_LAUNCH = {"rows": 64, "chunks": 1}  # attnres_block_logits: one program per 64 rows and sites tile
INTER_LAUNCH = {"chunks": (1, 1)}  # attnres_inter: all of D per program
MERGE_LAUNCH = {"store_h": False}  # attnres_merge_norm: h is never read (a fifth fewer bytes, docs/kernels.md)
# Row counts a worker's warm-up prefills besides its full-budget chunk and odd tail (services/engine/warmup.py),
# so that no later chunk length compiles a variant: 12 for the counts that are multiples of 4 but not of 16
# (float32 row offsets 16-byte aligned, the count itself not divisible by 16), 2 for a variant of its own that
# Triton's binder shows at two rows (test_fast_prefill_specializations: each is needed, together they suffice).
WARMUP_ROWS = (2, 12)


class PrefillInputs(NamedTuple):
    """What a prefill attention form reads besides its input rows (the decode forms take a DecodeInputs)."""

    layout: BatchLayout
    cache: BatchCache


def attention_form(attn: nn.Module) -> Callable[..., torch.Tensor]:
    """The reference attention layer as a fast-decoder sublayer: (x normed, inputs, residual) -> the output
    added into `residual` in place (the forward's own running sum), or the output itself."""

    def run(x: torch.Tensor, inp: PrefillInputs, residual: torch.Tensor | None = None) -> torch.Tensor:
        out = attn(x, inp.layout, inp.cache)
        return out if residual is None else residual.add_(out)

    return run


def prefill_fastpath_enabled() -> bool:
    return os.environ.get(ENV, "") != "0"


class FastPrefill:
    def __init__(self, decoder: FastDecoder) -> None:
        self.decoder = copy.copy(decoder)  # shares the forms and derived weights; only `attention` differs
        self.decoder.attention = [attention_form(layer.self_attn) for layer in decoder.model.model.layers]
        # One AttnRes phase-1 variant per row-count class instead of a plan per chunk length: each launcher's
        # own plan (rows per program, D chunks to fill the SMs) made new prompt lengths compile new variants
        # inside the request (~3.5 s on the H200 for a 512- or 4096-token chunk after the warm-up's 8192 + 7).
        self.decoder.logits_launch = dict(LOGITS_LAUNCH)
        self.decoder.inter_launch = dict(INTER_LAUNCH)
        self.decoder.merge_launch = dict(MERGE_LAUNCH)
        self.decoder.branch_rows = 0  # phase 1 on the main chain at every chunk length: the warmed variants

    @staticmethod
    def applies(decoder: FastDecoder) -> bool:
        """Every MoE form grouped (the dense form computes every expert on every token: for a few tokens only)."""
        return all(op.grouped for op in decoder.ffn if isinstance(op, MoeDecode))

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, cache: BatchCache) -> torch.Tensor:
        """tokens [sum(new_token_counts)] packed in batch order -> logits [B, V] (model dtype) at the last new
        token of each sequence; the cache is written as the reference forward writes it."""
        model = self.decoder.model
        layout = BatchLayout.of(cache.context_lens, cache.new_token_counts)
        model._check_tokens(tokens, layout.num_tokens)
        normed = self.decoder.hidden(tokens, PrefillInputs(layout, cache))
        return model.lm_head(normed[layout.last_token_indices()])
