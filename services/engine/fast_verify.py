"""The speculative verify forward through the decode fast path (`verify_replay.Verifier` takes it when the
worker has a fast path), at any TP degree.

A verify forward is a decode forward whose rows are the windows' tokens (the pending token and the drafts
of each request, in batch order): every row-wise part of `FastDecoder` (embedding, norms, AttnRes, MoE,
MLP, LM head, the all-reduces at TP > 1) takes them as they are, and so does the paged MLA form, given
each row its own position: its latent row is written at that position and it attends over the rows up to
it (the window's earlier tokens included: causal). Only KDA is sequential within a window: for the
duration of a verify forward (eager: verify is never captured in a CUDA graph) every KDA form of the
decoder (`KdaDecode.step`) runs the window form below instead of the one-token step kernel, which regroups
the rows into [B, window, H, D], runs the fused recurrence over each window with n_commit=0 and returns
every token's output. No state is written, as on the reference verify path
(`VerifyBatchCache` drops the writes): the window's projected inputs are kept, per KDA layer, for
`verify_replay.replay_accepted`, which then advances the states over the accepted prefix only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from k3core.cache.request import CachedRequest
from k3core.layers.kda import KimiDeltaAttention
from kernels import dispatch
from services.engine.decode_fastpath import DecodeFastPath
from services.engine.fast_decoder import FastDecoder


@dataclass
class _Row:
    """One window token as the input builder sees a request: the request's pages, at this token's position."""

    rid: str
    blocks: list
    state_pages: list[int]
    num_computed: int


class _Windows:
    """The rows' window structure, and the KDA inputs captured per layer ({kda layer: [q, k, v, z, beta]})."""

    def __init__(self, sizes: list[int], device: torch.device, kda_layers: list[int]) -> None:
        self.batch, self.longest = len(sizes), max(sizes)
        starts = [sum(sizes[:b]) for b in range(len(sizes))]
        self.first = torch.tensor(starts, device=device)  # each window's first row
        self.place = torch.tensor([b * self.longest + j for b, n in enumerate(sizes) for j in range(n)],
                                  device=device)  # row -> its slot in the padded [B * longest] layout
        self.kda_layers = kda_layers  # in the order the forward runs them
        self.inputs: dict[int, list[torch.Tensor]] = {}

    def padded(self, rows: torch.Tensor) -> torch.Tensor:
        """[N, ...] rows -> [B, longest, ...], zeros past each window's end (never committed, never read)."""
        out = rows.new_zeros(self.batch * self.longest, *rows.shape[1:])
        out[self.place] = rows
        return out.view(self.batch, self.longest, *rows.shape[1:])

    def kda_step(self, q, k, v, z, beta, gate, conv_weight, a_log, dt_bias, norm_weight, state, conv, slots,
                 **options) -> torch.Tensor:
        """`dispatch.kda_decode_step`'s contract over window rows: [N, H, D] outputs, nothing committed."""
        rows = q.shape[0]
        self.inputs[self.kda_layers[len(self.inputs)]] = [
            t.reshape(rows, -1).clone() for t in (q, k, v, z, beta)]  # the replay's packed inputs
        y = dispatch.fused_kda_recurrent(*(self.padded(t) for t in (q, k, v, z, beta, gate)), conv_weight, a_log,
                                         dt_bias, norm_weight, state, conv, slots[self.first], n_commit=0, **options)
        return y.reshape(self.batch * self.longest, *y.shape[2:])[self.place]


@contextmanager
def _windowed_kda(decoder: FastDecoder, windows: _Windows) -> Iterator[None]:
    for op in decoder.kda_ops:
        op.step = windows.kda_step
    try:
        yield
    finally:
        for op in decoder.kda_ops:
            op.step = None


class FastVerify:
    def __init__(self, fastpath: DecodeFastPath, model: torch.nn.Module) -> None:
        self.fastpath = fastpath
        self.kda_layers = [m.kda_index for m in model.modules() if isinstance(m, KimiDeltaAttention)]

    def supports(self, requests: list[CachedRequest]) -> bool:
        return all(self.fastpath.builder.fits(r) for r in requests)

    @torch.no_grad()
    def forward(self, requests: list[CachedRequest], windows: list[list[int]]
                ) -> tuple[torch.Tensor, dict[int, list[torch.Tensor]]]:
        """(logits [N, V] float32 at every window token, the windows' projected KDA inputs per KDA layer)."""
        fast = self.fastpath
        rows = [_Row(r.rid, r.blocks, r.state_pages, r.num_computed + j)
                for r, window in zip(requests, windows, strict=True) for j in range(len(window))]
        tokens = [t for window in windows for t in window]
        host = torch.from_numpy(fast.builder.build(rows, tokens, len(rows)))  # type: ignore[arg-type]
        structure = _Windows([len(w) for w in windows], fast.device, self.kda_layers)
        with _windowed_kda(fast.decoder, structure):
            logits = fast.decoder.forward(fast.builder.view(host.to(fast.device), len(rows)))
        if len(structure.inputs) != len(self.kda_layers):  # a fast form that bypassed `KdaDecode.step`
            raise RuntimeError(f"the verify forward ran {len(structure.inputs)} of {len(self.kda_layers)} "
                               "KDA layers as windows: the others advanced their states row by row")
        return logits.float(), structure.inputs
