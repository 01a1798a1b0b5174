"""Speculative decoding on the decode worker: a draft model proposes, the target verifies in one forward.

Per step, every running request that is decoding (its pending token is its only uncomputed token) gets up
to `num_speculative_tokens` drafts from the draft model (`draft_runner`). The scheduler reserves pages for
the pending token plus the drafts; the target runs one forward over those windows with logits at every
position (`verify_replay`); `acceptance` decides which drafts stand; the engine streams them (stop
conditions cut the window), and the cache is advanced over the accepted prefix only.

A window never crosses a hash-block boundary (it may end on one): the KDA state at every boundary is then
a state the step commits, so checkpoints and hash registrations equal those of a non-speculative run (the
same rule as prefill chunks). A request also gets no more drafts than it may still emit tokens.

Tensor parallelism: the windows travel in the step's plan (`plan.verify`); every rank runs the verify
forward and replays its own KDA heads (`verify_replay.Verifier`), rank 0 alone runs the draft model and the
acceptance rule and sends the kept counts to the other ranks.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from services.engine.config import WorkerConfig
from services.engine.draft_runner import DraftRequest, DraftRunner, Proposal
from services.engine.executor import Executor
from services.engine.model_runner import build_model
from services.engine.request import EngineRequest
from services.engine.verify_replay import Verifier


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


class Speculator:
    """Rank 0's side: the draft model, the per-request window rule, the verifier and the metrics."""

    def __init__(self, draft: DraftRunner, verifier: Verifier, num_tokens: int, metrics: SpecMetrics):
        self.draft = draft
        self.verifier = verifier
        self.manager = verifier.manager
        self.num_tokens = num_tokens
        self.metrics = metrics
        self.proposed = 0  # totals since start (also exported as metrics)
        self.accepted = 0
        self.verifies = 0

    def window(self, req: EngineRequest) -> int:
        """Drafts this request may get now: capped by the next hash boundary (so the window needs no page
        beyond the pending token's, and every boundary state is one a step commits) and by max_tokens."""
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


def speculating(config: WorkerConfig, role: str) -> bool:
    """Speculative decoding is on: the decode worker with a draft model (the prefill worker emits one token
    per request: nothing to speculate)."""
    return bool(config.draft_model) and role == "decode"


def build_verifier(config: WorkerConfig, role: str, executor: Executor) -> Verifier | None:
    """Every rank's verifier when speculative decoding is on."""
    if not speculating(config, role):
        return None
    return Verifier(executor.runner.model, executor.manager, config.device, config.tp_size, executor.fastpath)


def build_speculator(config: WorkerConfig, role: str, executor: Executor) -> Speculator | None:
    """Rank 0's speculator (the draft model runs there only, replicated weights, one rank's cache)."""
    verifier = build_verifier(config, role, executor)
    if verifier is None:
        return None
    draft = DraftRunner(build_model(config.draft_config(), 0), config.device)
    return Speculator(draft, verifier, config.num_speculative_tokens, SpecMetrics.for_role(role))
