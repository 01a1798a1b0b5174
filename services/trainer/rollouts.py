"""Partial rollouts (K3 report §4.1.2): N prompts x K completions are in flight; an iteration's generation
stops as soon as a fraction lambda of the N*K trajectories has finished, paused trajectories are resumed
first in the next iteration, and a prompt's group goes to policy optimisation the moment all K are done.

The scheduler is pure bookkeeping (no I/O): the trainer asks it what to start, tells it what finished, and
asks whether to pause. Trajectories keep the policy version of every token they hold, since one long
trajectory may span several weight versions (the loss corrects per token).
"""

from __future__ import annotations

import dataclasses
from collections import deque


@dataclasses.dataclass
class Trajectory:
    prompt_id: str
    sample: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    reward: float | None = None

    @property
    def key(self) -> tuple[str, int]:
        return self.prompt_id, self.sample

    @property
    def done(self) -> bool:
        return self.reward is not None


class PartialRolloutScheduler:
    def __init__(self, samples_per_prompt: int, pause_fraction: float):
        if not 0 < pause_fraction <= 1:
            raise ValueError(f"pause_fraction (lambda) must be in (0, 1], got {pause_fraction}")
        self.k = samples_per_prompt
        self.pause_fraction = pause_fraction
        self.paused: deque[Trajectory] = deque()
        self.active: dict[tuple[str, int], Trajectory] = {}
        self.finished: dict[str, list[Trajectory]] = {}
        self.iteration_total = 0
        self.iteration_done = 0

    def start_iteration(self, new_prompts: list[str]) -> list[Trajectory]:
        """Paused trajectories first, then K fresh ones per new prompt: what to (re)submit for generation."""
        resumed = list(self.paused)
        self.paused.clear()
        fresh = [Trajectory(p, s) for p in new_prompts for s in range(self.k)]
        for t in resumed + fresh:
            self.active[t.key] = t
        self.iteration_total = len(self.active)
        self.iteration_done = 0
        return resumed + fresh

    def record_tokens(self, key: tuple[str, int], tokens: list[int], logprobs: list[float], version: int) -> None:
        t = self.active[key]
        t.tokens.extend(tokens)
        t.logprobs.extend(logprobs)
        t.versions.extend([version] * len(tokens))

    def finish(self, key: tuple[str, int], reward: float) -> list[Trajectory] | None:
        """Mark a trajectory done; returns its prompt's whole group once all K are done."""
        t = self.active.pop(key)
        t.reward = reward
        self.iteration_done += 1
        group = self.finished.setdefault(t.prompt_id, [])
        group.append(t)
        if len(group) == self.k:
            return sorted(self.finished.pop(t.prompt_id), key=lambda x: x.sample)
        return None

    def should_pause(self) -> bool:
        return self.iteration_done >= self.pause_fraction * self.iteration_total

    def pause_rest(self) -> list[Trajectory]:
        """Stop generation of every unfinished trajectory; they resume first next iteration."""
        stopped = list(self.active.values())
        self.paused.extend(stopped)
        self.active.clear()
        return stopped
