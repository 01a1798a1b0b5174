"""One policy-optimisation step on the model: log-probs of the sampled tokens, the per-token off-policy
loss, Per-Head Muon (AdamW for embeddings, norms and vectors), the Quantile-Balancing router-bias update
from the routing scores seen in the step (the bias only selects experts; it is not trained by gradients),
then QK-Clip of the Gated MLA heads measured on the step's batch (`qk_clip.py`)."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import torch

from k3core.cache.contiguous import ContiguousBatchCache
from k3core.config import K3Config
from k3core.layers.moe import MoEGate
from k3core.model.k3model import K3Model
from k3core.ops.qb import qb_update_histogram
from services.trainer.loss import group_advantages, per_token_policy_loss
from services.trainer.muon import PerHeadMuon
from services.trainer.qk_clip import MLAClip

# Attention projections whose rows split into heads (Per-Head Muon orthogonalises each head's block).
HEADED = ("q_proj.weight", "q_b_proj.weight", "k_proj.weight", "v_proj.weight")


@dataclasses.dataclass
class Sample:
    group: str
    tokens: list[int]
    behaviour_logprobs: list[float]  # one per token; prompt tokens carry 0 and mask 0
    loss_mask: list[int]
    reward: float


@dataclasses.dataclass
class StepStats:
    loss: float
    tokens: int
    max_log_ratio: float
    max_attention_logit: float = float("-inf")  # largest MLA logit after the update, before QK-Clip
    clipped_heads: int = 0


def _heads_of(config: K3Config, name: str) -> int:
    """The heads a matrix's rows split into for Per-Head Muon; 0 orthogonalises it whole. A KDA layer's
    q/k/v have the KDA head count, an MLA layer's q_proj / q_b_proj the MLA one; they need not agree."""
    if not name.endswith(HEADED):
        return 0
    layer = int(name.split(".")[2])  # model.layers.<N>.self_attn.<proj>.weight
    return config.kda_num_heads if config.layer_kind(layer) == "kda" else config.num_attention_heads


def _padded(rows: list) -> torch.Tensor:
    """Rows of different lengths (float tensors keep their graph) -> [B, longest] float32, zero padded."""
    tensors = [torch.as_tensor(r, dtype=torch.float32) for r in rows]
    width = max(len(t) for t in tensors)
    return torch.stack([torch.nn.functional.pad(t, (0, width - len(t))) for t in tensors])


class Learner:
    def __init__(self, model: K3Model, lr: float = 2e-3, adam_lr: float = 3e-4, tau: float = 0.1,
                 max_log_ratio: float = 2.0, qk_clip_tau: float | None = 100.0):
        """tau: the loss's log-ratio penalty; qk_clip_tau: the MLA logit cap (K2: 100), None switches it off."""
        self.model, self.tau, self.max_log_ratio = model, tau, max_log_ratio
        self.qk_clip = MLAClip(model, qk_clip_tau) if qk_clip_tau is not None else None
        by_heads: dict[int, list[torch.nn.Parameter]] = defaultdict(list)
        vectors = []
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            if p.ndim == 2 and "embed_tokens" not in name and "lm_head" not in name:
                by_heads[_heads_of(model.config, name)].append(p)
            else:
                vectors.append(p)
        self.muon = PerHeadMuon([{"params": ps, "heads": h} for h, ps in sorted(by_heads.items())], lr=lr)
        self.adam = torch.optim.AdamW(vectors, lr=adam_lr, weight_decay=0.0)
        self.gates = [m for m in model.modules() if isinstance(m, MoEGate)]
        self._scores: dict[int, list[torch.Tensor]] = {}
        for gate in self.gates:
            gate.register_forward_hook(self._record_scores)

    def _record_scores(self, gate: MoEGate, _inputs, logits: torch.Tensor) -> None:
        self._scores.setdefault(id(gate), []).append(torch.sigmoid(logits.detach()))

    def _logits(self, samples: list[Sample]) -> torch.Tensor:
        """The model's logits at every token of the samples, packed [sum of lengths, vocab]."""
        caches = [self.model.new_sequence_cache() for _ in samples]
        batch = ContiguousBatchCache(caches, [len(s.tokens) for s in samples])
        return self.model(torch.tensor([t for s in samples for t in s.tokens]), batch)

    def token_logprobs(self, samples: list[Sample]) -> list[torch.Tensor]:
        """log p(token_t | tokens_<t) for t >= 1 of each sample, with gradients."""
        logp = torch.log_softmax(self._logits(samples).float(), dim=-1)
        out, offset = [], 0
        for s in samples:
            n = len(s.tokens)
            rows = logp[offset : offset + n - 1]
            out.append(rows.gather(1, torch.tensor(s.tokens[1:])[:, None])[:, 0])
            offset += n
        return out

    def step(self, samples: list[Sample]) -> StepStats:
        self._scores.clear()
        groups = sorted({s.group for s in samples})
        rewards = torch.tensor([s.reward for s in samples])
        advantages = torch.zeros(len(samples))
        for g in groups:
            idx = torch.tensor([i for i, s in enumerate(samples) if s.group == g])
            advantages[idx] = group_advantages(rewards[idx][None])[0]
        logp = _padded(self.token_logprobs(samples))
        behaviour = _padded([s.behaviour_logprobs[1:] for s in samples])
        mask = _padded([s.loss_mask[1:] for s in samples])
        loss = per_token_policy_loss(logp, behaviour, advantages, mask, self.tau, self.max_log_ratio)
        self.muon.zero_grad()
        self.adam.zero_grad()
        loss.backward()
        self.muon.step()
        self.adam.step()
        self._update_router_bias()
        ratio = ((logp.detach() - behaviour).abs() * mask).max().item()
        stats = StepStats(loss.item(), int(mask.sum().item()), ratio)
        if self.qk_clip is not None:  # last: it measures the weights (router bias included) the step ends with
            report = self.qk_clip.run(lambda: self._logits(samples))
            self._scores.clear()  # routing seen by the clip pass is not the step's
            stats.max_attention_logit, stats.clipped_heads = report.max_logit, report.clipped_heads
        return stats

    @torch.no_grad()
    def _update_router_bias(self) -> None:
        top_k = self.model.config.num_experts_per_token
        for gate in self.gates:
            scores = self._scores.get(id(gate))
            if scores:
                gate.e_score_correction_bias.copy_(
                    qb_update_histogram(torch.cat(scores), gate.e_score_correction_bias, top_k))
