"""A scheduling step as data: what rank 0 decided, replayed identically by every other TP rank.

Every rank owns a cache manager of the same page count; the manager's decisions depend only on the
sequence of calls, so replaying rank 0's successful calls gives every rank the same page ids (their
pages differ only in which KDA heads they hold).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ForwardItem:
    rid: str
    token_ids: list[int]  # the new tokens computed this step
    sample: bool  # the chunk reaches the last known token: its logits give the next token


@dataclass(frozen=True)
class ImportItem:
    rid: str
    handle_id: str
    transfer_address: str
    shared_tokens: int  # the local prefix hit: full blocks below it are shared and skipped
    reserved: bool  # tokens were reserved for the import (the forward_done that registers them)


@dataclass(frozen=True)
class ExportItem:
    rid: str
    handle_id: str
    transfer_address: str
    model: str


@dataclass
class StepPlan:
    manager_calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = field(default_factory=list)
    forward: list[ForwardItem] = field(default_factory=list)
    imports: list[ImportItem] = field(default_factory=list)
    exports: list[ExportItem] = field(default_factory=list)
    # Speculative decoding: verify windows (pending token + drafts), run before `forward` (engine/speculative.py).
    verify: list[ForwardItem] = field(default_factory=list)
    shutdown: bool = False

    @property
    def empty(self) -> bool:
        return not (self.manager_calls or self.forward or self.imports or self.exports)


class RecordingManager:
    """Rank 0's view of its cache manager: every call that succeeds is recorded for the other ranks.
    (A call that raises, e.g. OutOfPages, changes nothing by the manager's contract, so it is not sent.)"""

    def __init__(self, manager: Any):
        self.manager = manager
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        result = getattr(self.manager, name)(*args, **kwargs)
        self.calls.append((name, args, kwargs))
        return result

    def take_calls(self) -> list[tuple[str, tuple[Any, ...], dict[str, Any]]]:
        calls, self.calls = self.calls, []
        return calls
