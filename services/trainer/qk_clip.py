"""QK-Clip fed by the forward pass (K2 report §2.1, MuonClip; K3 keeps it for its Gated MLA layers).

S_max^h = max over the batch of head h's pre-softmax logit (scaled, causal positions only) is measured from
the q and k each Gated MLA layer forms on the step's batch; a head over tau gets gamma_h = tau / S_max^h
(`muon.qk_clip_mla`). KDA layers have no softmax logits (L2-normalised q/k) and are left alone.

K2 measures S_max in the step's own forward, before the update, so a large update can still push a logit
past tau. Here the measurement runs after the update, in one no-grad forward over the same batch whose
forward pre-hooks measure and clip each MLA layer just before it runs: later layers then see the outputs
of the already clipped ones, so afterwards every head's max logit on that batch is <= tau (a clipped head
sits at tau). Cost: one no-grad forward per step, in training only; serving never registers the hooks and
the model's forward is unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

from k3core.layers.batch import BatchLayout
from k3core.layers.mla import GatedMLA
from k3core.ops.mla import causal_mask
from services.trainer.muon import qk_clip_mla


@dataclasses.dataclass
class ClipReport:
    max_logits: dict[int, torch.Tensor]  # mla_index -> [heads] S_max measured before that layer's clip
    gammas: dict[int, torch.Tensor]  # mla_index -> [heads] scale applied (1 = untouched)

    @property
    def clipped_heads(self) -> int:
        return sum(int((g < 1).sum()) for g in self.gammas.values())

    @property
    def max_logit(self) -> float:
        return max((float(s.max()) for s in self.max_logits.values()), default=float("-inf"))


def query_weight(layer: GatedMLA) -> torch.Tensor:
    """The matrix whose rows are the per-head queries [nope | rope]: q_b_proj with a query LoRA, else q_proj."""
    return layer.q_b_proj.weight if layer.q_lora else layer.q_proj.weight


@torch.no_grad()
def mla_max_logits(layer: GatedMLA, x: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
    """Per-head max pre-softmax logit [heads] (float32) of `layer` on its input x [T, hidden] of fresh
    sequences (nothing cached before: a training forward)."""
    if any(layout.context_lens):
        raise ValueError("S_max is measured on fresh sequences only (a training forward caches nothing before)")
    q = layer.queries(x).float()
    latent = layer.latent(x).float()
    keys = F.linear(latent[:, : layer.rank], layer.kv_b_proj.weight.float()).view(x.shape[0], layer.heads, -1)
    best = torch.full((layer.heads,), float("-inf"))
    for start, end in layout.token_ranges:
        qs, ks, k_pe = q[start:end], keys[start:end, :, : layer.nope], latent[start:end, layer.rank :]
        scores = torch.einsum("thd,shd->hts", qs[..., : layer.nope], ks)
        scores += torch.einsum("thp,sp->hts", qs[..., layer.nope :], k_pe)
        scores = (scores * layer.scale).masked_fill(~causal_mask(end - start, end - start), float("-inf"))
        best = torch.maximum(best, scores.flatten(1).max(dim=1).values)
    return best


class MLAClip:
    """Measures and clips every Gated MLA layer of a model during one forward it is given."""

    def __init__(self, model: torch.nn.Module, tau: float):
        if tau <= 0:
            raise ValueError(f"qk_clip_tau must be > 0, got {tau}")
        self.tau = tau
        self.layers = [m for m in model.modules() if isinstance(m, GatedMLA)]

    def run(self, forward: Callable[[], object]) -> ClipReport:
        report = ClipReport({}, {})

        def clip_before(layer: GatedMLA, inputs: tuple) -> None:
            x, layout = inputs[0], inputs[1]
            s_max = mla_max_logits(layer, x, layout)
            report.max_logits[layer.mla_index] = s_max
            report.gammas[layer.mla_index] = qk_clip_mla(
                query_weight(layer), layer.kv_b_proj.weight, s_max, self.tau, layer.nope, layer.rope, layer.v_dim)

        handles = [layer.register_forward_pre_hook(clip_before) for layer in self.layers]
        try:
            with torch.no_grad():
                forward()
        finally:
            for handle in handles:
                handle.remove()
        return report
