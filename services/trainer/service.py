"""k3.v1.TrainerService: take trajectories, step the policy when a batch is full, publish weights."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Callable
from pathlib import Path

from prometheus_client import Counter, Gauge

from k3.v1 import trainer_pb2, trainer_pb2_grpc
from k3core.weights.checkpoint import save_checkpoint
from services.runtime import errors
from services.trainer.learner import Learner, Sample

log = logging.getLogger("k3.trainer")
STEPS = Counter("k3_trainer_steps_total", "Policy optimisation steps")
TRAJECTORIES = Counter("k3_trainer_trajectories_total", "Trajectories accepted")
WEIGHT_VERSION = Gauge("k3_trainer_weight_version", "Last published weight version")


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    def __init__(self, learner: Learner, batch_size: int, model_name: str, publish_dir: str,
                 publisher: Callable[[str, str], int] | None = None):
        self.learner, self.batch_size, self.model_name = learner, batch_size, model_name
        self.publish_dir = Path(publish_dir)
        # Writes (key, value) under the etcd prefix and answers how many workers watch it; None: no etcd.
        self.publisher = publisher
        self.buffer: list[Sample] = []
        self.step = 0
        self.version = 0
        self.lock = asyncio.Lock()  # the model: steps and weight snapshots
        self.publish_lock = asyncio.Lock()  # one publish at a time, so a version is written once

    def _sample(self, i: int, t: trainer_pb2.Trajectory) -> Sample:
        where = f"trajectories[{i}]"
        n = len(t.tokens.ids)
        if n < 2:
            raise errors.InvalidArgument(f"{where}.tokens", "needs at least 2 tokens")
        vocab = self.learner.model.config.vocab_size
        if max(t.tokens.ids) >= vocab:
            raise errors.InvalidArgument(f"{where}.tokens", f"token id >= vocab size {vocab}")
        for name, values in (("logprobs", t.logprobs), ("loss_mask", t.loss_mask)):
            if len(values) != n:
                raise errors.InvalidArgument(f"{where}.{name}", f"has {len(values)} entries for {n} tokens")
        if not math.isfinite(t.reward):
            raise errors.InvalidArgument(f"{where}.reward", "must be finite")
        if not any(t.loss_mask):
            raise errors.InvalidArgument(f"{where}.loss_mask", "masks out every token")
        return Sample(t.session.session_id or f"single-{i}", list(t.tokens.ids), list(t.logprobs),
                      list(t.loss_mask), t.reward)

    async def SubmitTrajectories(self, request, context):
        samples = [self._sample(i, t) for i, t in enumerate(request.trajectories)]
        async with self.lock:
            self.buffer.extend(samples)
            TRAJECTORIES.inc(len(samples))
            while len(self.buffer) >= self.batch_size:
                batch, self.buffer = self.buffer[: self.batch_size], self.buffer[self.batch_size:]
                stats = await asyncio.to_thread(self.learner.step, batch)
                self.step += 1
                STEPS.inc()
                log.info("policy step", extra={"step": self.step, "loss": round(stats.loss, 5),
                                               "tokens": stats.tokens, "max_log_ratio": round(stats.max_log_ratio, 3),
                                               "max_attention_logit": round(stats.max_attention_logit, 3),
                                               "clipped_heads": stats.clipped_heads})
        return trainer_pb2.SubmitTrajectoriesResponse(accepted=len(samples), step=self.step)

    async def PublishWeights(self, request, context):
        async with self.publish_lock:
            return await self._publish(request.version, request.location)

    async def _publish(self, version: int, location_text: str) -> trainer_pb2.PublishWeightsResponse:
        if version <= self.version:
            raise errors.FailedPrecondition(f"version {version} is not newer than {self.version}")
        location = Path(location_text) if location_text else self.publish_dir / f"v{version}"
        async with self.lock:
            state = {k: v.detach().clone() for k, v in self.learner.model.state_dict().items()}
        await asyncio.to_thread(save_checkpoint, location, state, self.learner.model.config)
        self.version = version
        WEIGHT_VERSION.set(self.version)
        notified = 0
        if self.publisher is not None:
            notified = await asyncio.to_thread(
                self.publisher, f"weights/{self.model_name}",
                json.dumps({"version": self.version, "location": str(location)}))
        log.info("published weights", extra={"version": self.version, "location": str(location)})
        return trainer_pb2.PublishWeightsResponse(workers_updated=notified)

    async def GetTrainerStatus(self, request, context):
        return trainer_pb2.GetTrainerStatusResponse(step=self.step, weight_version=self.version)
