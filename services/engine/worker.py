"""Bootstraps a worker: its TP ranks (one process each), the cache manager and model on every rank, and
the engine on rank 0. A worker of any TP degree is one logical gRPC endpoint (rank 0's)."""

from __future__ import annotations

import datetime
import logging
import os
import subprocess
import sys
import threading
import time

import torch.distributed as dist

from k3.v1 import common_pb2
from k3core.cache.cpu_tier import CpuTier
from k3core.cache.manager import PrefixCacheManager
from k3core.tokenizer import ByteTokenizer
from services.engine.config import WorkerConfig
from services.engine.engine import Engine
from services.engine.executor import Executor
from services.engine.heap import freeze_startup_heap
from services.engine.metrics import EngineMetrics
from services.engine.model_runner import ModelRunner, build_model
from services.engine.output import OutputProcessor
from services.engine.plan import RecordingManager, StepPlan
from services.engine.scheduler import Scheduler
from services.engine.speculative import build_speculator, build_verifier, speculating
from services.engine.warmup import WarmupReport, warm_up
from services.runtime.ports import free_port

log = logging.getLogger("k3.worker")

# Ranks wait on rank 0 between steps; an idle worker must not hit the collective timeout.
IDLE_TIMEOUT = datetime.timedelta(days=30)


def init_distributed(config: WorkerConfig, rank: int, port: int) -> None:
    backend = "nccl" if config.device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=config.tp_size, timeout=IDLE_TIMEOUT)


def build_executor(config: WorkerConfig, role: str, rank: int, instance: common_pb2.InstanceId,
                   metrics: EngineMetrics | None) -> Executor:
    model = build_model(config, rank)
    cpu_tier = CpuTier(config.cpu_tier_bytes) if config.cpu_tier_bytes else None
    manager = PrefixCacheManager(config.pool_layout(), config.num_pages, device=config.device, cpu_tier=cpu_tier,
                                 metrics=metrics.cache if metrics else None)
    return Executor(manager, ModelRunner(model, config.device), rank=rank, tp_size=config.tp_size,
                    total_heads=config.model_config().kda_num_heads, instance=instance,
                    auth_token=config.auth_token, speculative=speculating(config, role))


class Worker:
    """Rank 0: starts the other ranks, builds its own, runs the engine."""

    def __init__(self, config: WorkerConfig, role: str):
        self.config = config
        self.role = role
        self.metrics = EngineMetrics.for_role(role)
        self.children: list[subprocess.Popen] = []
        self.engine: Engine | None = None
        self.warmup: WarmupReport | None = None

    def start(self, instance: common_pb2.InstanceId) -> Engine:
        config = self.config
        broadcast = None
        if config.tp_size > 1:
            port = config.dist_port or free_port()
            for rank in range(1, config.tp_size):
                cmd = [sys.executable, "-m", "services.engine.rank_main", self.role, str(rank), str(port),
                       *config.to_argv()]
                self.children.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL))
            init_distributed(config, 0, port)
            broadcast = _broadcast
        executor = build_executor(config, self.role, 0, instance, self.metrics)
        # Before the barrier and the engine: the app marks the worker SERVING (and registers it) only after.
        self.warmup = warm_up(executor, config, self.role, export=True)
        if config.tp_size > 1:
            dist.barrier()  # serving starts only once every rank holds its shard
        recording = RecordingManager(executor.manager)
        scheduler = Scheduler(recording, hash_block_tokens=config.hash_block_tokens, max_running=config.max_running,
                              step_token_budget=config.step_token_budget, model_name=config.model)
        model_config = config.model_config()
        tokenizer = ByteTokenizer()
        output = OutputProcessor(tokenizer if tokenizer.vocab_size == model_config.vocab_size else None,
                                 model_config.eos_token_id)
        speculator = build_speculator(config, self.role, executor)
        self.engine = Engine(executor, scheduler, recording, output, self.metrics, broadcast, speculator)
        self.engine.start()
        return self.engine

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.stop()
        for child in self.children:
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()


def _broadcast(plan: StepPlan) -> None:
    dist.broadcast_object_list([plan], src=0)


def run_rank(config: WorkerConfig, role: str, rank: int, port: int) -> None:
    """Ranks > 0: replay every step rank 0 broadcasts until it says shut down (or dies)."""
    _exit_with_parent()
    init_distributed(config, rank, port)
    instance = common_pb2.InstanceId(service=role, cluster=config.cluster, instance=f"{config.instance}-r{rank}")
    executor = build_executor(config, role, rank, instance, None)
    verifier = build_verifier(config, role, executor)  # speculative decoding: verify windows on every rank
    warm_up(executor, config, role, export=False)  # the same forwards as rank 0's: their collectives pair up
    freeze_startup_heap()  # as rank 0's `Engine.start`: a full GC pass here would stall every rank's collectives
    dist.barrier()
    try:
        while True:
            box: list[StepPlan | None] = [None]
            dist.broadcast_object_list(box, src=0)
            plan = box[0]
            assert plan is not None
            if plan.shutdown:
                break
            executor.replay(plan)
            if plan.verify:
                assert verifier is not None
                verifier.follow(plan.verify)
            executor.execute(plan)
    except RuntimeError as exc:  # rank 0 (or a peer) went away: this rank has nothing left to serve
        log.error("tensor-parallel group broken; rank exiting", extra={"rank": rank, "error": str(exc)[:200]})
        os._exit(3)
    executor.close()
    dist.destroy_process_group()


def _exit_with_parent() -> None:
    """A rank whose rank 0 died must not linger (its collectives would block forever)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()
