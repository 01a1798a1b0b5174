"""The draft model of speculative decoding and its own caches (contiguous, one per request).

A draft cache only ever *commits* verified tokens before the pending one (the last sampled token, not yet
computed by the target). A proposal decodes the pending token and then the draft's own proposals one
token at a time, capturing each fed token's projected KDA inputs, and afterwards restores the KDA states
and length the cache had (its MLA rows past that length stay in place). At the next proposal, the fed
tokens the target has verified since (the pending token and the accepted drafts) are committed by
replaying their projected inputs through the verify kernel, as on the target: no draft token is computed
twice, a rejected one never reaches the committed cache, and one saved KDA state per request is all that
is stored. Verified tokens the draft never fed (a prompt, a step without speculation) are computed in one
chunk forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from k3core.cache.contiguous import ContiguousBatchCache, SequenceCache
from k3core.model import K3Model
from services.engine.acceptance import draft_token
from services.engine.params import GenerationOptions
from services.engine.verify_replay import KDA_INPUTS, ProjectionCapture, replay_accepted


@dataclass(frozen=True)
class DraftRequest:
    rid: str
    tokens: list[int]  # every verified token: the prompt, the output, ending with the pending token
    count: int  # drafts wanted (>= 1)
    first_index: int  # output position of the first draft (seeds the draft's sampling)
    options: GenerationOptions


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]
    probs: list[torch.Tensor] | None  # the distribution each draft was drawn from (None: greedy)


@dataclass
class _Fed:
    """Tokens a proposal fed past the committed length, with each one's projected inputs {kda layer: 5 x [.]}."""

    tokens: list[int] = field(default_factory=list)
    inputs: list[dict[int, list[torch.Tensor]]] = field(default_factory=list)


class DraftRunner:
    def __init__(self, model: K3Model, device: str):
        self.model = model
        self.device = torch.device(device)
        self.capture = ProjectionCapture(model)
        self.caches: dict[str, SequenceCache] = {}
        self._fed: dict[str, _Fed] = {}

    def forget(self, rid: str) -> None:
        self.caches.pop(rid, None)
        self._fed.pop(rid, None)

    @torch.no_grad()
    def propose(self, requests: list[DraftRequest]) -> dict[str, Proposal]:
        if not requests:
            return {}
        caches = [self.caches.setdefault(r.rid, self.model.new_sequence_cache()) for r in requests]
        self._replay_verified(requests, caches)
        self._catch_up(requests, caches)
        saved = [(c.kda_conv.clone(), c.kda_state.clone(), c.length) for c in caches]
        fed = [_Fed() for _ in requests]
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        active = list(range(len(requests)))
        while active:
            step = [drafts[i][-1] if drafts[i] else requests[i].tokens[-1] for i in active]  # pending token first
            with self.capture.capturing():
                logits = self.model.decode(torch.tensor(step, device=self.device), [caches[i] for i in active])
            for row, i in enumerate(active):
                fed[i].tokens.append(step[row])
                fed[i].inputs.append({layer: [t[row] for t in ts] for layer, ts in self.capture.inputs.items()})
                req = requests[i]
                token, dist = draft_token(logits[row].float(), req.options, req.first_index + len(drafts[i]))
                drafts[i].append(token)
                if dist is not None:
                    probs[i].append(dist)
            active = [i for i in active if len(drafts[i]) < requests[i].count]
        for cache, (conv, state, length) in zip(caches, saved, strict=True):
            cache.kda_conv, cache.kda_state, cache.length = conv, state, length
        self._fed.update((r.rid, f) for r, f in zip(requests, fed, strict=True))
        return {r.rid: Proposal(d, p if r.options.temperature > 0 else None)
                for r, d, p in zip(requests, drafts, probs, strict=True)}

    def _replay_verified(self, requests: list[DraftRequest], caches: list[SequenceCache]) -> None:
        """Commit the tokens the last proposal fed that the target has verified since, by replay."""
        kept = []
        for req, cache in zip(requests, caches, strict=True):
            fed = self._fed.pop(req.rid, None)
            verified = req.tokens[cache.length : -1]
            count = 0
            while fed is not None and count < min(len(fed.tokens), len(verified)) \
                    and fed.tokens[count] == verified[count]:
                count += 1
            if count:
                kept.append((cache, fed.inputs[:count]))
        if not kept:
            return
        counts = [len(inputs) for _, inputs in kept]
        view = ContiguousBatchCache([cache for cache, _ in kept], counts)
        packed = {layer.kda_index: [torch.stack([token[layer.kda_index][slot] for _, inputs in kept for token in inputs])
                                    for slot in range(len(KDA_INPUTS))] for layer in self.capture.layers}
        replay_accepted(self.capture.layers, packed, view, counts, counts)
        view.commit()  # the replayed states land; lengths advance over rows written when the tokens were fed

    def _catch_up(self, requests: list[DraftRequest], caches: list[SequenceCache]) -> None:
        """Commit, in one forward, the verified tokens before the pending one that a draft cache still lacks."""
        behind = [(r.tokens[c.length : -1], c) for r, c in zip(requests, caches, strict=True)
                  if c.length < len(r.tokens) - 1]
        if not behind:
            return
        batch = ContiguousBatchCache([c for _, c in behind], [len(n) for n, _ in behind])
        flat = torch.tensor([t for n, _ in behind for t in n], device=self.device)
        self.model(flat, batch, logits_for="last")
        batch.commit()
