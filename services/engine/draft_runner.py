"""The draft model of speculative decoding and its own caches (contiguous, one per request).

A draft cache only ever *commits* verified tokens. Each step the draft first catches up on the tokens the
target verified since its last step (one chunk: the accepted drafts and the pending token), which gives the
logits of the first proposal; then it decodes its proposals one token at a time and, when done, restores
the KDA states and length it had after the catch-up (its MLA rows past that length are scratch). So a
rejected proposal never reaches the committed cache, and only one saved KDA state per request exists.
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
        logits = self._catch_up(requests, caches)
        saved = [(c.kda_conv.clone(), c.kda_state.clone(), c.length) for c in caches]
        tokens: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        active = list(range(len(requests)))
        rows = dict(zip(active, logits, strict=True))
        while active:
            for i in active:
                req = requests[i]
                token, dist = draft_token(rows[i].float(), req.options, req.first_index + len(tokens[i]))
                tokens[i].append(token)
                if dist is not None:
                    probs[i].append(dist)
            active = [i for i in active if len(tokens[i]) < requests[i].count]
            if active:
                step = torch.tensor([tokens[i][-1] for i in active], device=self.device)
                rows = dict(zip(active, self.model.decode(step, [caches[i] for i in active]), strict=True))
        for cache, (conv, state, length) in zip(caches, saved, strict=True):
            cache.kda_conv, cache.kda_state, cache.length = conv, state, length
        return {r.rid: Proposal(t, p if r.options.temperature > 0 else None)
                for r, t, p in zip(requests, tokens, probs, strict=True)}

    def _catch_up(self, requests: list[DraftRequest], caches: list[SequenceCache]) -> torch.Tensor:
        """Commit the verified tokens each draft cache lacks; logits [B, V] at each last token."""
        new = [r.tokens[c.length:] for r, c in zip(requests, caches, strict=True)]
        if any(not n for n in new):
            raise ValueError("a draft request brings no token past its draft cache (the pending token is missing)")
        batch = ContiguousBatchCache(caches, [len(n) for n in new])
        flat = torch.tensor([t for n in new for t in n], device=self.device)
        logits = self.model(flat, batch, logits_for="last")
        batch.commit()
        return logits
