"""The draft model of speculative decoding and its own caches (contiguous, one per request).

A draft cache only ever *commits* verified tokens before the pending one (the last sampled token, not yet
computed by the target). Each step the draft first catches up on the tokens verified since its last step
(one chunk; nothing when the request was preempted and gained no token), then decodes the pending token and
its own proposals one token at a time and, when done, restores the KDA states and length it had after the
catch-up (its MLA rows past that length are scratch). So a rejected proposal never reaches the committed
cache, and only one saved KDA state per request exists.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3core.cache.contiguous import ContiguousBatchCache, SequenceCache
from k3core.model import K3Model
from services.engine.acceptance import draft_token
from services.engine.params import GenerationOptions


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


class DraftRunner:
    def __init__(self, model: K3Model, device: str):
        self.model = model
        self.device = torch.device(device)
        self.caches: dict[str, SequenceCache] = {}

    def forget(self, rid: str) -> None:
        self.caches.pop(rid, None)

    @torch.no_grad()
    def propose(self, requests: list[DraftRequest]) -> dict[str, Proposal]:
        if not requests:
            return {}
        caches = [self.caches.setdefault(r.rid, self.model.new_sequence_cache()) for r in requests]
        self._catch_up(requests, caches)
        saved = [(c.kda_conv.clone(), c.kda_state.clone(), c.length) for c in caches]
        tokens: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        active = list(range(len(requests)))
        step = [r.tokens[-1] for r in requests]  # the pending token first, then each new proposal
        while active:
            logits = self.model.decode(torch.tensor(step, device=self.device), [caches[i] for i in active])
            rows = dict(zip(active, logits, strict=True))
            for i in active:
                req = requests[i]
                token, dist = draft_token(rows[i].float(), req.options, req.first_index + len(tokens[i]))
                tokens[i].append(token)
                if dist is not None:
                    probs[i].append(dist)
            active = [i for i in active if len(tokens[i]) < requests[i].count]
            step = [tokens[i][-1] for i in active]
        for cache, (conv, state, length) in zip(caches, saved, strict=True):
            cache.kda_conv, cache.kda_state, cache.length = conv, state, length
        return {r.rid: Proposal(t, p if r.options.temperature > 0 else None)
                for r, t, p in zip(requests, tokens, probs, strict=True)}

    def _catch_up(self, requests: list[DraftRequest], caches: list[SequenceCache]) -> None:
        """Commit the verified tokens before the pending one that each draft cache lacks (one forward)."""
        behind = [(r.tokens[c.length : -1], c) for r, c in zip(requests, caches, strict=True)
                  if c.length < len(r.tokens) - 1]
        if not behind:
            return
        batch = ContiguousBatchCache([c for _, c in behind], [len(n) for n, _ in behind])
        flat = torch.tensor([t for n, _ in behind for t in n], device=self.device)
        self.model(flat, batch, logits_for="last")
        batch.commit()
