"""The whole decode forward of a K3Model on the paged pool, every layer through its fast form.

Same wiring as `K3Model.forward` (embedding, Block AttnRes or a plain residual, final norm, LM head), but:
attention through `fast_attention`, feed-forward through `fast_ffn`, AttnRes phase 1 per block through
`dispatch.attnres_inter`, and each AttnRes site's phase 2 fused with the sublayer's input RMSNorm
(`dispatch.attnres_merge_norm`); the final site is the same pair of kernels, merged with the final norm.
At decode sizes (`BRANCH_ROWS`) each merge also folds in the newest completed block,
so a block's phase 1 covers only the blocks before it and runs on a side branch beside the previous block's
sublayers.
Inputs are a `DecodeInputs` whose shapes depend on the batch size only, so one forward can be captured in a
CUDA graph.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from k3core.cache.pool_views import PoolViews
from k3core.config import K3Config
from k3core.layers.kda import KimiDeltaAttention
from k3core.model import K3Model
from kernels import dispatch
from kernels.attnres.query_parts import query_parts
from services.engine.decode_inputs import DecodeInputs
from services.engine.derived_weights import DerivedWeights
from services.engine.fast_attention import KdaDecode, MlaDecode, Projection, fork, join, on, rms
from services.engine.fast_ffn import MlpDecode, MoeDecode, grouped_mm_available

# AttnRes phase 1 on a side branch, the newest block folded in by the merges, below this many rows. H200, B=64,
# the merge's row sums in one reduction (docs/kernels.md history 40-41): the decode forward's AttnRes, main
# chain -> branched, mini (D 2048) 111.9 -> 85.6 us, K3 (D 7168) 1098 -> 917 us.
BRANCH_ROWS = 1024
ATTN_RES_BRANCH_ENV = "K3_ATTNRES_BRANCH"  # "0": phase 1 over every completed block on the main chain
# AttnRes's side branch spans a whole layer block, across the sublayers' own branches: a stream of its own.
_ATTN_RES_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
MLA_INT32_ENV = "K3_MLA_INT32"  # "0": the MLA decode kernel reads the step image's int64 page table and lengths


def mla_index_int32(inp: DecodeInputs) -> DecodeInputs:
    """`inp` with the MLA decode kernel's page table and lengths as int32, converted once a forward (one launch:
    the two parts are adjacent in the step's int64 image, `DecodeInputs.shapes`). Triton specialises the split
    kernel on its index pointers' type: with int64 its tile loop does 64-bit index arithmetic (the page of
    each tile a 64-bit division). H200, mini, 64 x 4096: the split kernel 89-90 -> 79-81 us a layer in the
    captured step, the step 2.95 -> 2.90 ms (docs/serving.md item 23)."""
    if os.environ.get(MLA_INT32_ENV, "1") == "0":
        return inp
    table, lengths = inp.page_table, inp.lengths
    if (lengths.untyped_storage().data_ptr() == table.untyped_storage().data_ptr() and table.is_contiguous()
            and lengths.is_contiguous() and lengths.storage_offset() == table.storage_offset() + table.numel()):
        both = table.as_strided((table.numel() + lengths.numel(),), (1,)).to(torch.int32)
        return replace(inp, page_table=both[: table.numel()].view(table.shape), lengths=both[table.numel() :])
    return replace(inp, page_table=table.to(torch.int32), lengths=lengths.to(torch.int32))


class FastDecoder:
    def __init__(self, model: K3Model, views: PoolViews) -> None:
        self.model = model
        self.config = config = model.config
        layout = views.layout
        weight = model.model.embed_tokens.weight
        grouped = grouped_mm_available(weight.device, weight.dtype)
        self.derived = derived = DerivedWeights()  # what `reload_weights` refreshes
        self.attention: list = []
        self.ffn: list = []
        self.kda_ops: list[KdaDecode] = []  # in forward order
        for layer in model.model.layers:
            attn = layer.self_attn
            if isinstance(attn, KimiDeltaAttention):
                op = KdaDecode(attn, views, derived)
                self.kda_ops.append(op)
                group = layout.kda_slot(attn.kda_index)[0]
                self.attention.append(lambda x, inp, residual=None, op=op, g=group:
                                      op(x, inp.kda_slots[g], residual))
            else:
                op = MlaDecode(attn, views, derived)
                group = layout.mla_slot(attn.mla_index)[0]
                self.attention.append(lambda x, inp, residual=None, op=op, g=group:
                                      op(x, inp.page_table[g], inp.lengths, inp.row_base[g], residual))
            self.ffn.append(MoeDecode(layer.block_sparse_moe, config, grouped, derived) if layer.is_moe
                            else MlpDecode(layer.mlp, config))
        # Extra launch arguments of the AttnRes phase-1 kernels. Empty here: each launcher plans for the batch
        # size (the decode buckets' warm-up compiles those); the prefill fast path pins them, since a plan per
        # chunk length made new prompt lengths compile new variants (services/engine/fast_prefill.py).
        self.logits_launch: dict = {}
        self.inter_launch: dict = {}
        self.branch_rows = BRANCH_ROWS  # `_attn_res_branched` below this many rows (the prefill fast path: never)
        # of every site's merge + norm: h is never read (decode, H200 B=64: 3.4 vs 3.6 us a K3 merge after a
        # sublayer; the mini forward's AttnRes 110.9 vs 113.7 us; docs/kernels.md history 40)
        self.merge_launch: dict = {"store_h": False}
        if config.uses_attn_res:
            layers = model.model.layers
            # Every site in forward order (layer i's attention and MLP sites are 2i and 2i + 1), the final last:
            # a block's logits against the sites after it are computed once (block_logits) into a cache.
            sites = [s for lay in layers for s in (lay.attn_res["attn"], lay.attn_res["mlp"])]
            sites.append(model.model.attn_res_final)
            self.site_queries = derived.derive(lambda: torch.stack([s.query for s in sites]))
            self.site_key_norms = derived.derive(lambda: torch.stack([s.norm.weight for s in sites]))
            # q_eff's bf16 parts for the logits' MMAs, cut once (refreshed after the two above)
            self.site_query_parts = derived.derive(lambda: query_parts(self.site_queries, self.site_key_norms))

    @staticmethod
    def projections(c: K3Config) -> list[Projection]:
        """Every GEMM one decode step of an unsharded rank routes through `dispatch.skinny_linear`, in call
        order (tests/workers/test_decode_projections.py runs a step to hold this to it). With Block AttnRes
        a block's first sublayer starts the partial sum, so its GEMM has no residual (`_attn_res`)."""
        found: list[Projection] = []
        for layer in range(c.num_hidden_layers):
            starts_block = c.uses_attn_res and layer % c.attn_res_block_size == 0
            attention = KdaDecode if c.layer_kind(layer) == "kda" else MlaDecode
            ffn = MoeDecode if c.is_moe_layer(layer) else MlpDecode
            found += attention.projections(c, not starts_block) + ffn.projections(c, True)
        return found

    @torch.no_grad()
    def forward(self, inp: DecodeInputs) -> torch.Tensor:
        """Logits [B, V] (model dtype) of the one new token of every row."""
        return self.model.lm_head(self.hidden(inp.tokens, mla_index_int32(inp)))

    def hidden(self, tokens: torch.Tensor, inp: DecodeInputs) -> torch.Tensor:
        """The final RMSNorm's output [N, D] of the rows `tokens`; `inp` is what the attention forms read (a
        `fast_prefill.PrefillInputs` for the prefill fast path's forms)."""
        backbone = self.model.model
        h = backbone.embed_tokens(tokens)
        return self._attn_res(h, inp) if self.config.uses_attn_res else rms(backbone.norm, self._residual(h, inp))

    def _sublayer(self, kind: int, i: int, x: torch.Tensor, residual: torch.Tensor | None,
                  *args: DecodeInputs) -> torch.Tensor:
        """Sublayer i of `kind` (0 attention, 1 feed-forward) on x, added into `residual` when given (the
        forward's own running sum: the forms built here add in their last GEMM's epilogue, in place; a
        tensor-parallel wrapper, `fast_tensor_parallel`, adds after its all-reduce)."""
        return (self.attention, self.ffn)[kind][i](x, *args, residual=residual)

    def _residual(self, h: torch.Tensor, inp: DecodeInputs) -> torch.Tensor:
        for i, layer in enumerate(self.model.model.layers):
            h = self._sublayer(0, i, rms(layer.input_layernorm, h), h, inp)
            h = self._sublayer(1, i, rms(layer.post_attention_layernorm, h), h)
        return h

    def _attn_res(self, h: torch.Tensor, inp: DecodeInputs) -> torch.Tensor:
        """Block AttnRes over the layers -> the final site's output after the final RMSNorm (normed [B, D])."""
        if h.shape[0] < self.branch_rows and os.environ.get(ATTN_RES_BRANCH_ENV, "1") != "0":
            return self._attn_res_branched(h, inp)
        config, layers = self.config, self.model.model.layers
        size, eps = config.attn_res_block_size, config.rms_norm_eps
        n_sites = len(self.site_queries)
        n_blocks = -(-len(layers) // size) + 1
        logits = h.new_empty(n_sites, n_blocks, h.shape[0], dtype=torch.float32)
        stacked = h.new_empty(n_blocks, *h.shape)  # each completed block copied in once, not stacked per phase
        done, partial = 0, None  # completed blocks

        def complete(block: torch.Tensor) -> None:  # its logits against the sites after it, once
            nonlocal done
            first = min(2 * done * size, n_sites - 1)
            # the same launch copies the block into the buffer (at decode sizes: no copy launch)
            dispatch.attnres_block_logits(self.site_queries[first:], block, self.site_key_norms[first:], eps,
                                          out=logits[first:, done], parts=self.site_query_parts[:, first:],
                                          copy_to=stacked[done], **self.logits_launch)
            done += 1

        complete(h)
        for i, layer in enumerate(layers):
            if i % size == 0:
                here = slice(2 * i, 2 * min(i + size, len(layers)))
                inter = dispatch.attnres_inter(self.site_queries[here], stacked[:done], self.site_key_norms[here],
                                               eps, logits=logits[here, :done], **self.inter_launch)
                inter.acc = inter.acc.contiguous()  # the merge kernel reads each site's rows densely
            sublayers = ((layer.attn_res["attn"], layer.input_layernorm, (inp,)),
                         (layer.attn_res["mlp"], layer.post_attention_layernorm, ()))
            for j, (site, norm, args) in enumerate(sublayers):
                row = inter.row(2 * (i % size) + j)
                _, normed = dispatch.attnres_merge_norm(
                    row.max, row.denom, row.acc, site.query, partial, norm.weight,
                    key_norm_weight=site.norm.weight, key_eps=eps, out_eps=norm.eps, out_dtype=h.dtype,
                    **self.merge_launch)
                partial = self._sublayer(j, i, normed, partial, *args)
            if (i + 1) % size == 0:
                complete(partial)
                partial = None
        if partial is not None:
            complete(partial)
        # The final site: the same two kernels with no partial sum, its merge fused with the final norm.
        final, norm = self.model.model.attn_res_final, self.model.model.norm
        stats = dispatch.attnres_inter(self.site_queries[-1:], stacked[:done], self.site_key_norms[-1:], eps,
                                       logits=logits[-1:, :done], **self.inter_launch).row(0)
        _, normed = dispatch.attnres_merge_norm(stats.max, stats.denom, stats.acc, final.query, None, norm.weight,
                                                key_norm_weight=final.norm.weight, key_eps=eps, out_eps=norm.eps,
                                                out_dtype=h.dtype, **self.merge_launch)
        return normed


    def _attn_res_branched(self, h: torch.Tensor, inp: DecodeInputs) -> torch.Tensor:
        """`_attn_res` with each site's merge folding in the newest completed block (`newest=`): the phase 1 of
        layer block k covers blocks 0 .. k-1 only, so it (and block k-1's logits, with its copy into the block
        buffer) can run as soon as block k-1 completes, on a side branch beside layer block k-1's sublayers;
        the main chain waits for it at layer block k's first merge. Layer block 0 has no phase 1."""
        config, layers = self.config, self.model.model.layers
        size, eps, n_layers = config.attn_res_block_size, config.rms_norm_eps, len(layers)
        n_sites, n_blocks = len(self.site_queries), -(-n_layers // size)
        logits = h.new_empty(n_sites, n_blocks, h.shape[0], dtype=torch.float32)  # block k's for sites past its
        stacked = h.new_empty(n_blocks, *h.shape)  # layer block's; the last block is only ever the newest

        def ahead(k: int, block: torch.Tensor):  # block k's logits, then the phase 1 of the sites after it
            first = min(2 * (k + 1) * size, n_sites - 1)  # layer block k + 1's first site, or the final one
            dispatch.attnres_block_logits(self.site_queries[first:], block, self.site_key_norms[first:], eps,
                                          out=logits[first:, k], parts=self.site_query_parts[:, first:],
                                          copy_to=stacked[k], **self.logits_launch)
            here = slice(first, 2 * min((k + 2) * size, n_layers) if first < n_sites - 1 else n_sites)
            inter = dispatch.attnres_inter(self.site_queries[here], stacked[: k + 1], self.site_key_norms[here],
                                           eps, logits=logits[here, : k + 1], **self.inter_launch)
            inter.acc = inter.acc.contiguous()  # the merge kernel reads each site's rows densely
            return inter

        newest, partial, inter, side, pending = h, None, None, None, None
        for i, layer in enumerate(layers):
            if i % size == 0:
                join(side)
                inter, side = pending, fork(newest, _ATTN_RES_STREAMS)  # it reads `newest` until the next join
                with on(side):
                    pending = ahead(i // size, newest)
            sublayers = ((layer.attn_res["attn"], layer.input_layernorm, (inp,)),
                         (layer.attn_res["mlp"], layer.post_attention_layernorm, ()))
            for j, (site, norm, args) in enumerate(sublayers):
                row = inter.row(2 * (i % size) + j) if inter is not None else None
                _, normed = dispatch.attnres_merge_norm(
                    *((row.max, row.denom, row.acc) if row is not None else (None, None, None)), site.query,
                    partial, norm.weight, key_norm_weight=site.norm.weight, key_eps=eps, out_eps=norm.eps,
                    out_dtype=h.dtype, newest=newest, **self.merge_launch)
                partial = self._sublayer(j, i, normed, partial, *args)
            if (i + 1) % size == 0 or i == n_layers - 1:
                join(side)  # the branch's reads of the old newest block end before it can be freed
                side, newest, partial = None, partial, None
        final, norm = self.model.model.attn_res_final, self.model.model.norm
        stats = pending.row(0)
        _, normed = dispatch.attnres_merge_norm(stats.max, stats.denom, stats.acc, final.query, None, norm.weight,
                                                key_norm_weight=final.norm.weight, key_eps=eps, out_eps=norm.eps,
                                                out_dtype=h.dtype, newest=newest, **self.merge_launch)
        return normed


def distinct_projections(c: K3Config) -> dict[str, tuple[int, int, bool]]:
    """The distinct (N, K, residual) of `FastDecoder.projections`, each named by the projections that share it
    ("kda out | mla out + residual"): the shapes the skinny GEMM's benches and compile cases take."""
    names: dict[tuple[int, int, bool], list[str]] = {}
    for p in FastDecoder.projections(c):
        shared = names.setdefault((p.n, p.k, p.residual), [])
        if p.name not in shared:
            shared.append(p.name)
    return {" | ".join(found) + (" + residual" if key[2] else ""): key for key, found in names.items()}
