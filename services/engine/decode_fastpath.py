"""The decode fast path of one rank: decode-only batches run `FastDecoder` on the pool, in a CUDA graph per
batch-size bucket on CUDA, eagerly elsewhere (the CPU form runs the kernels' references through
`kernels.dispatch`: the CI oracle that the fast path computes what the reference layers compute).

It owns two scratch pages of the pool (taken once, never released) for the padding rows of a bucket. With
the decode look-ahead on (decode_lookahead.py; the default at TP 1) it also owns `drawn`, the last draw's
tokens on the device, which a look-ahead step's forward reads its tokens from (`DecodeInputs.resolve_on_device`,
in the graph).

Where the overlap draws (TP 1, no draft model) the step's forward ends by default with the greedy argmax of
its logits written into `drawn` (`kernels.dispatch.greedy_argmax`; K3_DECODE_DRAW_IN_GRAPH=0 turns it off;
docs/serving.md item 18: 10-14 us of a step's cycle at batch 64 on the H200): on CUDA two more nodes of
the captured graph, eagerly the same call on the CPU. A draw of the step's rows that are all greedy then takes those
tokens as they are (`drawn_argmax`): no argmax launches after the replay, and with the look-ahead no publish copy
(the graph wrote the buffer the next step reads). Sampled rows are drawn after the replay as before.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import numpy as np
import torch

from k3core.cache.manager import PrefixCacheManager
from k3core.cache.pool import PageKind
from k3core.cache.pool_views import PoolViews
from k3core.cache.request import CachedRequest
from k3core.model import K3Model
from kernels import dispatch
from services.engine.cuda_graphs import DecodeGraphs
from services.engine.decode_inputs import DecodeInputBuilder, DecodeInputs
from services.engine.fast_ffn import padding_rows
from services.engine.fast_tensor_parallel import graph_capturable, rank_decoder

ENV = "K3_DECODE_FASTPATH"  # "0": never; "1": also on CPU (eager); unset: on CUDA
LOOKAHEAD_ENV = "K3_DECODE_LOOKAHEAD"  # "0": no decode step launched before the previous one's tokens are in
OVERLAP_ENV = "K3_DECODE_OVERLAP"  # "0": every step waits for its tokens before the next is planned (decode_overlap)
GRAPHS_ENV = "K3_DECODE_CUDA_GRAPHS"  # "0": eager fast path on CUDA too; "1": graphs at TP > 1 (NCCL) too
DRAW_ENV = "K3_DECODE_DRAW_IN_GRAPH"  # "0": no greedy argmax into `drawn` at the forward's end (in the graph)


def overlap_wanted() -> bool:
    return os.environ.get(OVERLAP_ENV, "1") != "0"


def lookahead_wanted(sharded: bool, speculative: bool = False) -> bool:
    """On by default wherever the decode overlap can run it: with the overlap on, at TP 1 (a `sharded` model's
    ranks replay rank 0's plans, which the look-ahead does not make) and without a draft model (`speculative`:
    the overlap is off). Elsewhere every image would carry the `source`/`stops` parts and every forward the
    prologue, for nothing. K3_DECODE_LOOKAHEAD=0 turns it off."""
    return os.environ.get(LOOKAHEAD_ENV, "1") != "0" and overlap_wanted() and not sharded and not speculative


def draw_in_graph_wanted(sharded: bool, speculative: bool = False) -> bool:
    """On (K3_DECODE_DRAW_IN_GRAPH=0 turns it off) where the decode overlap draws (`DecodeOverlap.draw`: TP 1, no
    draft model): elsewhere nothing takes the forward's argmax and it would run for nothing."""
    return os.environ.get(DRAW_ENV, "1") != "0" and overlap_wanted() and not sharded and not speculative


def fastpath_wanted(device: torch.device, tp_size: int) -> bool:
    """On CUDA by default, at any TP degree (`tp_size` > 1: the sharded form of `fast_tensor_parallel` runs
    the reference TP forward's all-reduces); K3_DECODE_FASTPATH overrides (1: also on CPU, 0: never)."""
    setting = os.environ.get(ENV, "")
    if setting == "0":
        return False
    return setting == "1" or device.type == "cuda"


class DecodeFastPath:
    def __init__(self, model: K3Model, manager: PrefixCacheManager, *, max_model_len: int = 32768,
                 max_batch: int = 256, graphs: bool | None = None, lookahead: bool | None = None,
                 speculative: bool = False, draw_in_graph: bool | None = None) -> None:
        if manager.store is None:
            raise ValueError("the decode fast path needs a manager with a page store")
        layout = manager.layout
        self.device = manager.store.data.device
        self.decoder = rank_decoder(model, PoolViews(manager.store.data, layout))  # sharded at TP > 1
        scratch_kda = manager.pool.allocate(PageKind.KDA, 0)[0]
        scratch_mla = manager.pool.allocate(PageKind.MLA, 0)[0]
        self.sharded = not graph_capturable(model)  # (opted_in False: capturable exactly where no collective is)
        self.speculative = speculative
        self.lookahead = lookahead_wanted(self.sharded, speculative) if lookahead is None else lookahead
        self.builder = DecodeInputBuilder(layout, math.ceil(max_model_len / layout.tokens_per_block),
                                          scratch_kda, scratch_mla, lookahead=self.lookahead)
        self.drawn = torch.zeros(max_batch, dtype=torch.int64, device=self.device)  # the last draw, row order
        self.draw_in_graph = draw_in_graph_wanted(self.sharded, speculative) if draw_in_graph is None \
            else draw_in_graph
        self._launched: torch.Tensor | None = None  # the last launch's logits (`drawn_argmax`)
        self._forward = self._step_forward()
        setting = os.environ.get(GRAPHS_ENV, "")
        use_graphs = self.device.type == "cuda" and setting != "0" \
            and graph_capturable(model, opted_in=setting == "1") if graphs is None else graphs
        self.graphs = self._graphs(max_batch) if use_graphs else None
        self.max_batch = max_batch

    def _step_forward(self) -> Callable[[DecodeInputs], torch.Tensor]:
        """The forward a step runs (and a graph captures): with the look-ahead, its tokens resolved first; the
        rows on the scratch pages known as padding to the MoE layers (`fast_ffn.padding_rows`); with the draw in
        the graph, the greedy argmax of its logits into `drawn` last (after the prologue read it)."""
        lookahead, draw = self.lookahead, self.draw_in_graph
        kda, base = self.builder.scratch_kda, self.builder.scratch_base

        def forward(inp: DecodeInputs) -> torch.Tensor:
            inp = inp.resolve_on_device(self.drawn, kda, base) if lookahead else inp
            # padding rows (and stopped look-ahead rows) are those on the scratch pages: the routed experts skip them
            marker = (inp.kda_slots[0], kda) if inp.kda_slots.shape[0] else (inp.row_base[0], base)
            with padding_rows(self.decoder.ffn, *marker):
                logits = self.decoder.forward(inp)
            if draw:
                dispatch.greedy_argmax(logits, out=self.drawn[: logits.shape[0]])
            return logits
        return forward

    def rebuild(self) -> None:
        """Read K3_DECODE_LOOKAHEAD and K3_DECODE_DRAW_IN_GRAPH again and drop the captured graphs and their
        staging images (made again on first use, in the setting's image layout and forward): the benches'
        variants change the settings within one process."""
        # the image's look-ahead parts too
        self.lookahead = self.builder.lookahead = lookahead_wanted(self.sharded, self.speculative)
        self.draw_in_graph = draw_in_graph_wanted(self.sharded, self.speculative)
        self._forward = self._step_forward()
        if self.graphs is not None:
            self.graphs = self._graphs(self.max_batch)

    def _graphs(self, max_batch: int) -> DecodeGraphs:
        """Graphs of `_forward`, whose warm-ups leave `graph_outputs` as they were."""
        return DecodeGraphs(self._forward, self.builder, self.device, max_batch, preserve=self.graph_outputs())

    def graph_outputs(self) -> tuple[torch.Tensor, ...]:
        """What the step's forward writes besides its logits that a later launch reads: `drawn`, with the draw
        in the graph (a bucket first used between a draw and the look-ahead launch reading it warms up there)."""
        return (self.drawn,) if self.draw_in_graph else ()

    def reload_weights(self) -> None:
        """After the model's weights were loaded in place: recompute every tensor derived from them, into the
        same storage (captured CUDA graphs keep reading it). Views of the weights already see the new values."""
        self.decoder.derived.refresh()

    def supports(self, requests: list[CachedRequest]) -> bool:
        return 0 < len(requests) <= self.max_batch and all(self.builder.fits(r) for r in requests)

    def forward(self, requests: list[CachedRequest], tokens: list[int]) -> torch.Tensor:
        """Logits [B, V] of one new token per request (tokens[i] at position num_computed), in the model's
        dtype: sampling reads bf16 as it is (a float32 copy of [256, V] is ~170 MB of device traffic a step);
        with CUDA graphs a view of the graph's output, valid until the next replay."""
        image, size = self.prepare(requests, len(requests))
        self.builder.token_slots(image, len(requests))[:] = tokens
        return self.launch(image, len(requests))

    def prepare(self, requests: list[CachedRequest], batch: int) -> tuple[np.ndarray, int]:
        """The host image of a step of `batch` rows (the first len(requests) real) and its row count, all
        but the tokens (`DecodeInputBuilder.prepare`); with CUDA graphs the bucket's staging buffer, so it
        may be built while the previous step replays. Launch it with `launch`."""
        host, size = self.staging(batch)
        return self.builder.prepare(requests, size, out=host), size

    def staging(self, batch: int) -> tuple[np.ndarray, int]:
        """A host buffer for the image of a step of `batch` rows, and its row count (the bucket's)."""
        if self.graphs is not None:
            return self.graphs.staging(batch)
        return np.empty(self.builder.numel(batch), dtype=np.int64), batch

    def compact(self, image: np.ndarray, size: int, rows: list[int]) -> tuple[np.ndarray, int]:
        """A prepared image of `size` rows cut to `rows` (in order), in the staging buffer of their count, and
        its row count (`DecodeInputBuilder.compact`)."""
        buffer, compacted = self.staging(len(rows))
        return self.builder.compact(image, size, rows, buffer, compacted), compacted

    def launch(self, image: np.ndarray, batch: int) -> torch.Tensor:
        """Run the prepared (and completed) image of `batch` rows: logits [batch, V] as `forward` returns."""
        if self.graphs is not None:
            logits = self.graphs.launch(batch)  # `image` is the bucket's staging buffer
        else:
            logits = self._forward(self.builder.view(torch.from_numpy(image).to(self.device), batch))
        self._launched = logits
        return logits

    def drawn_argmax(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The greedy argmax of `logits` [B, V] computed by the forward itself (in `drawn[:B]`, valid until the
        next launch), or None: the draw is not in the graph, or `logits` is not the last launch's output. Off
        CUDA a copy: a CPU tensor's host copy is the tensor itself (`HostCopy`), which the next launch would
        overwrite before the tokens are read."""
        if not self.draw_in_graph or logits is not self._launched:
            return None
        drawn = self.drawn[: logits.shape[0]]
        return drawn if drawn.is_cuda else drawn.clone()

    def publish(self, tokens: torch.Tensor) -> None:
        """A draw's per-row tokens (device) into `drawn`, queued behind it: the next launch may read them."""
        if self.lookahead and len(tokens):
            self.drawn[: len(tokens)].copy_(tokens, non_blocking=True)
