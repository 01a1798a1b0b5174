"""Speculative decoding on the decode worker: a draft model proposes, the target verifies in one forward.

Per step, every running request that is decoding (its pending token is its only uncomputed token) gets up
to `num_speculative_tokens` drafts from the draft model (`draft_runner`). The scheduler reserves pages for
the pending token plus the drafts; the target runs one forward over those windows with logits at every
position (`verify_replay`); `acceptance` decides which drafts stand; the engine streams them (stop
conditions cut the window), and the cache is advanced over the accepted prefix only.

A window never crosses a hash-block boundary (it may end on one): the KDA state at every boundary is then
a state the step commits, so checkpoints and hash registrations equal those of a non-speculative run (the
same rule as prefill chunks). A request also gets no more drafts than it may still emit tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from prometheus_client import Counter, Gauge, Histogram

from k3core.cache.manager import PrefixCacheManager
from services.engine.config import WorkerConfig
from services.engine.draft_runner import DraftRequest, DraftRunner, Proposal
from services.engine.model_runner import build_model
from services.engine.plan import ForwardItem
from services.engine.request import EngineRequest
from services.engine.verify_replay import (
    ProjectionCapture,
    VerifyBatchCache,
    commit_accepted,
    replay_accepted,
)


class SpecMetrics:
    """k3_<role>_spec_*: drafts proposed and accepted, acceptance rate, tokens emitted per verify."""

    _by_role: dict[str, SpecMetrics] = {}

    @classmethod
    def for_role(cls, role: str) -> SpecMetrics:
        if role not in cls._by_role:
            cls._by_role[role] = cls(role)
        return cls._by_role[role]

    def __init__(self, role: str):
        p = f"k3_{role}_spec"
        self.proposed = Counter(f"{p}_draft_tokens", "Draft tokens proposed to the target")
        self.accepted = Counter(f"{p}_accepted_tokens", "Draft tokens the target accepted")
        self.acceptance_rate = Gauge(f"{p}_acceptance_rate", "Accepted / proposed draft tokens since start")
        self.tokens_per_step = Histogram(f"{p}_tokens_per_step", "Tokens a request emits per verify step "
                                         "(accepted drafts + 1)", buckets=tuple(range(1, 18)))


@dataclass
class Verification:
    """A verify forward whose cache effects wait for the acceptance decision (`Speculator.commit`)."""

    items: list[ForwardItem]
    logits: list[torch.Tensor]  # [window, V] per item
    view: VerifyBatchCache
    inputs: dict[int, list[torch.Tensor]]  # the windows' projected KDA inputs, per KDA layer


class Speculator:
    def __init__(self, draft: DraftRunner, target: torch.nn.Module, manager: PrefixCacheManager,
                 num_tokens: int, device: str, metrics: SpecMetrics):
        self.draft = draft
        self.target = target
        self.manager = manager
        self.num_tokens = num_tokens
        self.device = torch.device(device)
        self.metrics = metrics
        self.capture = ProjectionCapture(target)
        self.proposed = 0  # totals since start (also exported as metrics)
        self.accepted = 0
        self.verifies = 0

    def window(self, req: EngineRequest) -> int:
        """Drafts this request may get now: capped by the next hash boundary and by its max_tokens."""
        cached = self.manager.requests[req.rid]
        if cached.num_tokens - cached.num_computed != 1 or not req.output or req.forced or req.export is not None:
            return 0
        hash_block = self.manager.layout.hash_block_tokens
        to_boundary = (cached.num_computed // hash_block + 1) * hash_block - cached.num_computed - 1
        return max(0, min(self.num_tokens, to_boundary, req.options.max_tokens - len(req.output) - 1))

    def propose(self, running: list[EngineRequest]) -> dict[str, Proposal]:
        wanted = [DraftRequest(r.rid, r.tokens, n, len(r.output), r.options)
                  for r in running if (n := self.window(r)) > 0]
        return self.draft.propose(wanted)

    @torch.no_grad()
    def verify(self, items: list[ForwardItem]) -> Verification:
        """The target's forward over the windows (pages reserved by the scheduler), logits at every token."""
        self.manager.pre_forward()  # copies of this step land before any forward (idempotent)
        view = VerifyBatchCache(self.manager.batch_view([f.rid for f in items]))
        tokens = torch.tensor([t for f in items for t in f.token_ids], dtype=torch.long, device=self.device)
        with self.capture.capturing():
            logits = self.target(tokens, view, logits_for="all").float()
        return Verification(items, list(logits.split([len(f.token_ids) for f in items])), view,
                            self.capture.inputs)

    def commit(self, verification: Verification, counts: dict[str, int]) -> None:
        """counts: rid -> window tokens to keep (the pending token and the drafts the request emitted before
        its last token). Replays KDA over them, then rolls each request's cache back to them."""
        windows = [len(f.token_ids) for f in verification.items]
        kept = [counts[f.rid] for f in verification.items]
        replay_accepted(self.capture.layers, verification.inputs, verification.view.inner, windows, kept)
        for item, count in zip(verification.items, kept, strict=True):
            commit_accepted(self.manager, item.rid, count)

    def record(self, drafts: int, accepted: int) -> None:
        self.proposed += drafts
        self.accepted += accepted
        self.verifies += 1
        self.metrics.proposed.inc(drafts)
        self.metrics.accepted.inc(accepted)
        self.metrics.tokens_per_step.observe(accepted + 1)
        self.metrics.acceptance_rate.set(self.accepted / self.proposed)

    def forget(self, rid: str) -> None:
        self.draft.forget(rid)


def build_speculator(config: WorkerConfig, role: str, target: torch.nn.Module,
                     manager: PrefixCacheManager) -> Speculator | None:
    """The decode worker's speculator when a draft model is configured (the prefill worker emits one token
    per request: nothing to speculate)."""
    if not config.draft_model or role != "decode":
        return None
    draft_config = config.draft_config()
    draft = DraftRunner(build_model(draft_config, 0), config.device)
    return Speculator(draft, target, manager, config.num_speculative_tokens, config.device,
                      SpecMetrics.for_role(role))
