"""One request as the engine tracks it, from arrival to its last streamed token."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from k3.v1 import common_pb2
from services.engine.params import GenerationOptions


class Phase(enum.Enum):
    WAITING = "waiting"  # not in the cache manager (new, or preempted)
    RUNNING = "running"  # admitted: has pages, gets tokens every step
    FINISHED = "finished"


@dataclass(frozen=True)
class ImportSource:
    """The prompt's cache comes from the transfer service instead of a local prefill."""

    handle_id: str
    transfer_address: str


@dataclass(frozen=True)
class ExportTarget:
    """After its prompt is computed, the request's cache goes to the transfer service (prefill worker)."""

    handle_id: str
    transfer_address: str


@dataclass(frozen=True)
class StepOutput:
    """What one step produced for a request (delivered to its stream)."""

    token_ids: list[int]
    text: str = ""
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    error: Exception | None = None
    # One common_pb2.TokenLogprob per token when the request asked for logprobs.
    logprobs: list = field(default_factory=list)
    # On a request's first output: seconds from its arrival to its first token. Carried here because the
    # stream converts the output on its own thread, after the engine may have accepted more tokens.
    ttft_s: float | None = None


@dataclass(eq=False)
class EngineRequest:
    rid: str
    prompt: list[int]
    options: GenerationOptions
    emit: Callable[[StepOutput], None]
    # Tokens the engine must not sample again (e.g. the prefill worker's first token, after an import).
    forced: list[int] = field(default_factory=list)
    # The forced tokens' logprobs (common_pb2.TokenLogprob) as their producer computed them.
    forced_logprobs: list = field(default_factory=list)
    source: ImportSource | None = None
    export: ExportTarget | None = None
    turn_boundaries: tuple[int, ...] = ()
    arrival: float = field(default_factory=time.monotonic)
    phase: Phase = Phase.WAITING
    output: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    cancelled: bool = False
    preemptions: int = 0
    # The prompt's chained hash-block hashes, computed on the submitting thread so that admitting a long
    # prompt does not hash it inside an engine step (see docs/cache.md, scheduler cost per step).
    prompt_chain: list[int] | None = None

    @property
    def tokens(self) -> list[int]:
        """Every token known: the prompt and what was generated (the cache manager's view)."""
        return self.prompt + self.output

    @property
    def finished(self) -> bool:
        return self.phase is Phase.FINISHED
