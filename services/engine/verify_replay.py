"""The target's verify step over the paged pool (K3 report §5.4.2): one forward over the pending token and
the drafts, then the cache is advanced over the accepted prefix only.

- KDA: the verify forward's state writes are dropped, so the request's state pages keep the state before the
  window. Each KDA layer's projected inputs of the window (pre-conv q, k, v, decay logits, beta logits: a
  few KB per token, against H*D*D floats of state) are captured on the way; once acceptance is known, the
  accepted prefix is replayed from them into the state pages with the verify kernel
  (`kernels.dispatch.kda_verify_replay`: Triton on CUDA, the plain-torch reference on CPU). No state is
  ever stored per draft.
- MLA: rows of every window token are written into the reserved pages; the request's computed length is
  rolled back to the accepted prefix (rows past it are scratch, overwritten later); a window ends at the
  latest on a hash-block boundary, so no page ever holds rejected rows only. Hash blocks and KDA
  checkpoints are registered for the accepted prefix only (`forward_done` over it), so the prefix cache
  sees what a non-speculative run registers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from k3core.cache.interface import BatchCache
from k3core.cache.manager import PrefixCacheManager
from k3core.cache.paged_view import PagedBatchCache
from k3core.layers.kda import KimiDeltaAttention
from kernels import dispatch
from services.engine.decode_fastpath import DecodeFastPath
from services.engine.fast_verify import FastVerify
from services.engine.plan import ForwardItem

# Projections a KDA layer's state depends on, in the kernel's argument order (q, k, v, z, beta).
KDA_INPUTS = ("q_proj", "k_proj", "v_proj", "f_b_proj", "b_proj")


class ProjectionCapture:
    """The projected inputs of every KDA layer in one forward, packed in batch order: {kda_index: [5 x [N, .]]}."""

    def __init__(self, model: torch.nn.Module):
        self.layers = [m for m in model.modules() if isinstance(m, KimiDeltaAttention)]
        self.inputs: dict[int, list[torch.Tensor]] = {}

    @contextmanager
    def capturing(self) -> Iterator[None]:
        self.inputs = {layer.kda_index: [torch.empty(0)] * len(KDA_INPUTS) for layer in self.layers}
        handles = []
        for layer in self.layers:
            for slot, name in enumerate(KDA_INPUTS):
                def keep(_module, _args, out, index=layer.kda_index, slot=slot):
                    self.inputs[index][slot] = out.detach()
                handles.append(getattr(layer, name).register_forward_hook(keep))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


class VerifyBatchCache:
    """The paged view of a verify forward with KDA state writes dropped (the replay writes the state)."""

    def __init__(self, inner: PagedBatchCache):
        self.inner = inner

    @property
    def num_sequences(self) -> int:
        return self.inner.num_sequences

    @property
    def context_lens(self) -> list[int]:
        return self.inner.context_lens

    @property
    def new_token_counts(self) -> list[int]:
        return self.inner.new_token_counts

    def kda_read(self, kda_layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.kda_read(kda_layer)

    def kda_write(self, kda_layer: int, conv_state: torch.Tensor, recurrent_state: torch.Tensor) -> None:
        del kda_layer, conv_state, recurrent_state  # the state after the whole window is not the one to keep

    def mla_append(self, mla_layer: int, latent: torch.Tensor) -> None:
        self.inner.mla_append(mla_layer, latent)

    def mla_read(self, mla_layer: int, seq: int) -> torch.Tensor:
        return self.inner.mla_read(mla_layer, seq)


def _padded(packed: torch.Tensor, windows: list[int], heads: int) -> torch.Tensor:
    """[N, heads * D] packed windows -> [B, max window, heads, D], zero padded."""
    rows = packed.reshape(packed.shape[0], heads, -1)
    out = rows.new_zeros(len(windows), max(windows), *rows.shape[1:])
    for b, part in enumerate(rows.split(windows)):
        out[b, : part.shape[0]] = part
    return out


@torch.no_grad()
def replay_accepted(layers: list[KimiDeltaAttention], inputs: dict[int, list[torch.Tensor]], view: BatchCache,
                    windows: list[int], counts: list[int]) -> None:
    """Advance every KDA layer's state in `view` over the first counts[b] (>= 1) tokens of each window, from
    the windows' projected inputs (`ProjectionCapture.inputs`, packed in batch order). The verify kernel
    replays the first counts[b] - 1 tokens and commits the state after the last kept one."""
    batch = len(windows)
    slots = torch.arange(batch)
    last = torch.tensor([c - 1 for c in counts])
    for layer in layers:
        heads = layer.heads
        q, k, v, z, beta = (_padded(t, windows, heads) for t in inputs[layer.kda_index])
        projected = (q, k, v, z, beta.squeeze(-1))
        slots, last = slots.to(q.device), last.to(q.device)
        window = tuple(t[slots, last].unsqueeze(1) for t in projected)
        conv, state = view.kda_read(layer.kda_index)  # the state before the window (its writes were dropped)
        dispatch.kda_verify_replay(*window, torch.zeros_like(window[0]), layer.stacked_conv_weight(),
                                   layer.A_log.reshape(heads), layer.dt_bias, layer.o_norm.weight, state, conv, slots,
                                   previous_drafts=projected, n_accepted=last, lower_bound=layer.lower_bound,
                                   scale=layer.scale)
        view.kda_write(layer.kda_index, conv, state)


def commit_accepted(manager: PrefixCacheManager, rid: str, count: int) -> None:
    """Roll the request back to its first `count` window tokens computed: the drafts after them leave its
    tokens and chain hashes, and `forward_done` registers the accepted prefix (hash blocks, a KDA checkpoint
    at a hash boundary) like a non-speculative step."""
    req = manager.requests[rid]
    if not 1 <= count <= req.scheduled:
        raise ValueError(f"request {rid!r}: {count} accepted tokens of a {req.scheduled}-token window")
    end = req.num_computed + count
    # A window never crosses a hash-block boundary (the speculator caps it), hence no physical block
    # boundary either: the rejected rows sit in the block the request grows into next, past its length
    # (scratch), and no page holds rejected rows only.
    assert len(req.blocks) == -(-end // manager.layout.tokens_per_block), "a verify window crossed a block"
    truncate_tokens(manager, rid, end)
    req.scheduled = count
    manager.forward_done(rid)


def truncate_tokens(manager: PrefixCacheManager, rid: str, num_tokens: int) -> None:
    """Forget a request's known tokens past `num_tokens` (drafts that were not accepted, or not verified)."""
    req = manager.requests[rid]
    assert req.tokens is not None and num_tokens >= req.num_computed
    del req.tokens[num_tokens:]
    del req.chain[num_tokens // req.hash_block :]  # in place: a checkpoint shares the list (reads its prefix)
    req.num_tokens = num_tokens


@dataclass
class Verification:
    """A verify forward whose cache effects wait for the acceptance decision (`Verifier.commit`)."""

    items: list[ForwardItem]
    logits: list[torch.Tensor]  # [window, V] per item
    view: VerifyBatchCache
    inputs: dict[int, list[torch.Tensor]]  # the windows' projected KDA inputs, per KDA layer


class Verifier:
    """The target side on one TP rank: every rank runs the verify forward (its collectives) and the commit
    of the kept tokens over its own KDA heads; rank 0 decides the counts and sends them to the others."""

    def __init__(self, target: torch.nn.Module, manager: PrefixCacheManager, device: str, tp_size: int,
                 fastpath: DecodeFastPath | None = None):
        self.target = target
        self.manager = manager
        self.device = torch.device(device)
        self.tp_size = tp_size
        self.capture = ProjectionCapture(target)
        self.fast = FastVerify(fastpath, target) if fastpath is not None else None  # the fast path's forms

    @torch.no_grad()
    def verify(self, items: list[ForwardItem]) -> Verification:
        """The target's forward over the windows (pages reserved by the scheduler), logits at every token."""
        self.manager.pre_forward()  # copies of this step land before any forward (idempotent)
        view = VerifyBatchCache(self.manager.batch_view([f.rid for f in items]))
        requests = [self.manager.requests[f.rid] for f in items]
        if self.fast is not None and self.fast.supports(requests):
            logits, inputs = self.fast.forward(requests, [f.token_ids for f in items])
        else:
            tokens = torch.tensor([t for f in items for t in f.token_ids], dtype=torch.long,
                                  device=self.device)
            with self.capture.capturing():
                logits = self.target(tokens, view, logits_for="all").float()
            inputs = self.capture.inputs
        return Verification(items, list(logits.split([len(f.token_ids) for f in items])), view, inputs)

    def commit(self, verification: Verification, counts: list[int] | None) -> None:
        """counts (rank 0; None on the others, which receive them): window tokens each request keeps, the
        pending token and the drafts it emitted before its last token. Replays KDA over them, then rolls
        each request's cache back to them."""
        if self.tp_size > 1:
            box = [counts]
            dist.broadcast_object_list(box, src=0)
            counts = box[0]
        assert counts is not None
        windows = [len(f.token_ids) for f in verification.items]
        replay_accepted(self.capture.layers, verification.inputs, verification.view.inner, windows, counts)
        for item, count in zip(verification.items, counts, strict=True):
            commit_accepted(self.manager, item.rid, count)

    def follow(self, items: list[ForwardItem]) -> None:
        """Ranks > 0: the verify step of rank 0's plan, with the counts rank 0 decided."""
        self.commit(self.verify(items), None)
