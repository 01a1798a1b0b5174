"""The rollout driver: partial rollouts on the serving fleet feeding the trainer (K3 report §4.1.2, §5.3.1).

One iteration: paused trajectories first, then K fresh samples of each new prompt, kept in flight up to
the auto-throttle's concurrency (AIMD on the worker's running / waiting / KV usage). When a fraction
lambda of the iteration's trajectories has finished, the rest are paused (their streams cancelled, the
tokens received so far kept) to resume first next iteration. A finished trajectory is scored by the
reward function; a prompt's group goes to the trainer once all K are done, with the behaviour log-prob
and weight version of every generated token. Between iterations, nothing is in flight: every
`publish_every_steps` policy steps the driver asks the trainer to publish, loads the same checkpoint
into its behaviour model and waits until the worker serves it, so a token's version is always known.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections import deque
from collections.abc import Callable
from pathlib import Path

from k3.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from services.trainer.behaviour import BehaviourPolicy
from services.trainer.rollout_backend import DecodeBackend
from services.trainer.rollouts import PartialRolloutScheduler, Trajectory
from services.trainer.throttle import AutoThrottle

_MASK = (1 << 63) - 1


@dataclasses.dataclass(frozen=True)
class Prompt:
    prompt_id: str  # unique: it names the group of K samples at the trainer
    tokens: list[int]
    max_new_tokens: int


RewardFn = Callable[[Prompt, list[int]], float]


@dataclasses.dataclass
class DriverConfig:
    publish_dir: str  # where the trainer writes v<N> (a path the workers and the driver can read)
    samples_per_prompt: int = 4
    pause_fraction: float = 0.7
    prompts_per_iteration: int = 8
    publish_every_steps: int = 1
    sampling: common_pb2.SamplingParams = dataclasses.field(
        default_factory=lambda: common_pb2.SamplingParams(temperature=1.0))
    seed: int = 0
    # Take each token's behaviour log-prob from the worker's stream (sampling.logprobs) instead of scoring
    # it with the driver's own model; off to score everything locally (e.g. as a cross-check).
    serving_logprobs: bool = True


@dataclasses.dataclass
class DriverStats:
    iterations: int = 0
    paused: int = 0  # trajectory pauses (one trajectory may pause several times)
    submitted: list[trainer_pb2.Trajectory] = dataclasses.field(default_factory=list)
    step: int = 0
    version: int = 0


class RolloutDriver:
    def __init__(self, backend: DecodeBackend, trainer: trainer_pb2_grpc.TrainerServiceStub,
                 policy: BehaviourPolicy, reward: RewardFn, config: DriverConfig,
                 throttle: AutoThrottle | None = None):
        self.backend, self.trainer, self.policy, self.reward, self.config = backend, trainer, policy, reward, config
        self.throttle = throttle or AutoThrottle(min_concurrency=1, max_concurrency=256, concurrency=16)
        self.scheduler = PartialRolloutScheduler(config.samples_per_prompt, config.pause_fraction)
        self.prompts: dict[str, Prompt] = {}
        self.stats = DriverStats()
        self._published_step = 0

    async def run(self, prompts: list[Prompt]) -> DriverStats:
        """Roll out every prompt to completion; the policy and the workers must start at the trainer's
        current version (the driver publishes the following ones)."""
        status = await self.trainer.GetTrainerStatus(trainer_pb2.GetTrainerStatusRequest())
        self.stats.version, self.stats.step = status.weight_version, status.step
        self._published_step = status.step
        queue = deque(prompts)
        while True:
            new = [queue.popleft() for _ in range(min(self.config.prompts_per_iteration, len(queue)))]
            self.prompts.update((p.prompt_id, p) for p in new)
            batch = self.scheduler.start_iteration([p.prompt_id for p in new])
            if not batch:
                return self.stats
            await self._iteration(batch)
            self.stats.iterations += 1
            await self._maybe_publish()

    async def _iteration(self, batch: list[Trajectory]) -> None:
        todo = deque(batch)  # resumed ones first, as the scheduler ordered them
        running: dict[asyncio.Task, tuple[Trajectory, list[int], list[float]]] = {}
        submissions: list[asyncio.Task] = []
        try:
            while todo or running:
                concurrency = self.throttle.update(await self.backend.signals())
                while todo and len(running) < concurrency:
                    trajectory, segment, served = todo.popleft(), [], []
                    task = asyncio.create_task(self._generate(trajectory, segment, served))
                    running[task] = trajectory, segment, served
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    trajectory, segment, served = running.pop(task)
                    task.result()  # a failed generation ends the run (the trainer keeps what it got)
                    self._finish(trajectory, segment, served, submissions)
                if self.scheduler.should_pause():
                    break
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            await asyncio.gather(*submissions)  # a policy step runs while generation goes on
        for trajectory, segment, served in running.values():
            self._record(trajectory, segment, served)
        self.stats.paused += len(self.scheduler.pause_rest())

    async def _generate(self, t: Trajectory, segment: list[int], served: list[float]) -> None:
        prompt = self.prompts[t.prompt_id]
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(self.config.sampling)
        sampling.max_tokens = prompt.max_new_tokens - len(t.tokens)
        # Greedy keeps the policy's convention (a deterministic policy: log-prob 0), so only sampled ask.
        sampling.logprobs = self.config.serving_logprobs and sampling.temperature > 0
        if sampling.max_tokens <= 0:
            return
        # A resumed segment draws from a fresh stream (the engine seeds token i from (seed, i)).
        key = f"{self.config.seed}/{t.prompt_id}/{t.sample}/{len(t.tokens)}".encode()
        sampling.seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & _MASK
        rid = f"rollout-{t.prompt_id}-{t.sample}-{len(t.tokens)}"
        await self.backend.generate(rid, prompt.tokens + t.tokens, sampling, segment,
                                    served if sampling.logprobs else None)

    def _record(self, t: Trajectory, segment: list[int], served: list[float]) -> None:
        """The segment's behaviour log-probs: the worker's when it streamed one per token, else scored by
        the driver's own model (greedy, or serving_logprobs off)."""
        if segment:
            logprobs = served if len(served) == len(segment) else self.policy.logprobs(
                self.prompts[t.prompt_id].tokens + t.tokens, segment)
            self.scheduler.record_tokens(t.key, segment, logprobs, self.stats.version)

    def _finish(self, t: Trajectory, segment: list[int], served: list[float],
                submissions: list[asyncio.Task]) -> None:
        self._record(t, segment, served)
        prompt = self.prompts[t.prompt_id]
        group = self.scheduler.finish(t.key, self.reward(prompt, list(t.tokens)))
        if group is not None:
            submissions.append(asyncio.create_task(self._submit(prompt, group)))

    async def _submit(self, prompt: Prompt, group: list[Trajectory]) -> None:
        n = len(prompt.tokens)
        trajectories = [trainer_pb2.Trajectory(
            session=common_pb2.SessionRef(session_id=prompt.prompt_id),
            tokens=common_pb2.TokenIds(ids=prompt.tokens + t.tokens),
            logprobs=[0.0] * n + t.logprobs, loss_mask=[0] * n + [1] * len(t.tokens), reward=t.reward,
            policy_versions=[0] * n + t.versions) for t in group if t.tokens]
        if trajectories:
            reply = await self.trainer.SubmitTrajectories(trainer_pb2.SubmitTrajectoriesRequest(trajectories=trajectories))
            self.stats.step = max(self.stats.step, reply.step)
            self.stats.submitted.extend(trajectories)

    async def _maybe_publish(self) -> None:
        if self.stats.step - self._published_step < self.config.publish_every_steps:
            return
        version = self.stats.version + 1
        location = str(Path(self.config.publish_dir) / f"v{version}")
        await self.trainer.PublishWeights(trainer_pb2.PublishWeightsRequest(version=version, location=location))
        await asyncio.to_thread(self.policy.load, location)
        await self.backend.wait_version(version)
        self.stats.version, self._published_step = version, self.stats.step
