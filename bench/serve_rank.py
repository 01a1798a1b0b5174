"""One TP-1 engine rank for bench/serve.py: the paged pool, reference prefill, the decode fast path, timers.

Nothing here imports the service runtime (grpc_health, pyetcd): the accelerator image lacks it.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import numpy as np
import torch

from k3core.cache.checkpoints import CheckpointPolicy
from k3core.cache.layout import plan_layout, shape_from_config
from k3core.cache.manager import PrefixCacheManager
from k3core.config import K3Config
from k3core.model import K3Model
from kernels.perf import harness
from services.engine.decode_inputs import DecodeInputs
from services.engine.model_runner import ModelRunner


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def set_environ(values: dict[str, str | None]) -> None:
    """Each name set to its value, or unset where the value is None (an A/B switch and its restore)."""
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Bytes/s of a device-to-device copy (read + write counted): the kernel benchmark's ceiling
    (`harness.copy_bandwidth`) on CUDA, wall time of copies on the CPU."""
    if device.startswith("cuda"):
        return harness.copy_bandwidth(nbytes / 2**30)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync()
    started, reps = time.perf_counter(), 10
    for _ in range(reps):
        dst.copy_(src)
    sync()
    return 2 * nbytes * reps / (time.perf_counter() - started)


@torch.no_grad()
def random_model(config: K3Config, device: str, dtype: torch.dtype) -> K3Model:
    """Seeded random weights drawn on the device (a 2.4B-parameter CPU init would dominate the run)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = K3Model(config)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            param.fill_(1.0)
        elif name.endswith("A_log") or name.endswith("e_score_correction_bias"):
            param.zero_()
        else:
            param.normal_(0.0, 1.0 / math.sqrt(param.shape[-1]))
    return model.to(dtype).eval()


class ForwardTimer:
    """Device time of the forward (CUDA events), or wall time on the CPU."""

    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available()
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        self.began = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self.end.record()
        self.ended = time.perf_counter()

    def seconds(self) -> float:
        return self.start.elapsed_time(self.end) / 1e3 if self.cuda else self.ended - self.began


class Rank:
    """One TP-1 engine rank: pool, reference prefill, decode fast path (on CUDA), greedy sampling.

    It drives the cache manager with the calls the engine's executor makes (append, reserve, pre_forward,
    forward, forward_done, commit_step)."""

    def __init__(self, model: K3Model, name: str, args: argparse.Namespace, dtype: torch.dtype):
        layout = plan_layout(shape_from_config(model.config, name), 1, state_dtype=torch.float32, conv_dtype=dtype,
                             mla_dtype=dtype, hash_block_tokens=args.hash_block)
        # Every chunk end keeps its checkpoint (no supersede), so a later prompt sharing the prefix finds one.
        self.manager = PrefixCacheManager(layout, args.num_pages, policy=CheckpointPolicy(supersede=False),
                                          device=args.device)
        # The longest sequence either part builds: the TTFT prompt or a decode row's context (a profile row too).
        max_len = max(args.prefix + args.increment, max(args.contexts)) + args.steps + 64
        self.runner = ModelRunner(model, args.device, max_model_len=max_len, max_batch=max(args.batches))
        self.fast = self.runner.decode_fastpath(self.manager, tp_size=1)
        self.budget = args.budget
        self.vocab = min(997, model.config.vocab_size - 2)  # token ids 1..vocab in every prompt here
        self.forward_s: list[float] = []

    def prefill(self, rid: str, tokens: list[int]) -> tuple[int, int]:
        """Admit and prefill a prompt in hash-aligned chunks; (first token, prompt tokens served by the cache)."""
        manager = self.manager
        hit = manager.add_request(rid, tokens)
        req = manager.requests[rid]
        while req.num_computed < len(tokens):
            n = manager.prefill_chunk(rid, self.budget)
            manager.reserve(rid, n)
            manager.pre_forward()
            start = req.num_computed
            logits = self.runner.forward([tokens[start : start + n]], manager.batch_view([rid]))
            manager.forward_done(rid)
            manager.commit_step()
        self.last_logits = logits[-1]
        return int(logits[-1].argmax()), hit

    def fill(self, rids: list[str], context: int) -> list[list[int]]:
        """Requests at `context` tokens without a forward (pages reserved, marked computed); their prompts.
        Their MLA pages are zeroed: the pool has one free list for both kinds, so a page this fill takes may
        have held a finished row's KDA state, whose float32 bytes read as bf16 latents hold Inf/NaN (session
        9: from the first MLA layer on every row was NaN and routed to the same top-k experts). A prefill
        writes every latent before a decode reads it; the KDA state pages are zeroed on a miss already."""
        manager = self.manager
        prompts = [[(7919 * i + 31 * j + context) % self.vocab + 1 for j in range(context)] for i in range(len(rids))]
        for rid, prompt in zip(rids, prompts, strict=True):
            hit = manager.add_request(rid, prompt)
            manager.reserve(rid, context - hit)
        pages = [p for rid in rids for block in manager.requests[rid].blocks for p in block.pages]
        if pages and manager.store is not None:
            manager.store.data[torch.tensor(pages, device=manager.store.data.device)] = 0
        manager.pre_forward()
        for rid in rids:
            manager.forward_done(rid)
        manager.commit_step()
        return prompts

    def next_tokens(self, batch: int, step: int) -> list[int]:
        """The tokens fed back: one pseudo-random id per row and step. (The greedy argmax of random weights
        is the same token for every row, so every row would route to the same few experts; a trained
        model's batch spreads over them, which is what the roofline assumes.)"""
        return self.next_token_array(batch, step).tolist()

    def next_token_array(self, batch: int, step: int) -> np.ndarray:
        """`next_tokens` as an int64 array (the engine loop's feed: one vectorised expression, since it runs
        between the tokens' arrival and the next launch)."""
        return (104729 * (step + 1) + 7919 * np.arange(batch, dtype=np.int64)) % self.vocab + 1

    def begin_step(self, rids: list[str], tokens: list[int]) -> None:
        """Append each row's token and reserve its slot: the executor's calls before a decode forward."""
        for rid, token in zip(rids, tokens, strict=True):
            self.manager.append_tokens(rid, [token])
            self.manager.reserve(rid, 1)

    def step_inputs(self, rids: list[str], tokens: list[int]) -> DecodeInputs:
        """`begin_step`, then the fast path's `DecodeInputs` of the rows on `tokens` (on its device), for an
        eager `fast.decoder.forward` outside the engine's loop."""
        self.begin_step(rids, tokens)
        fast = self.fast
        cached = [self.manager.requests[r] for r in rids]
        return fast.builder.view(torch.from_numpy(fast.builder.build(cached, tokens, len(rids))).to(fast.device),
                                 len(rids))

    def end_step(self, rids: list[str]) -> None:
        for rid in rids:
            self.manager.forward_done(rid)
        self.manager.commit_step()

    def decode(self, rids: list[str], tokens: list[int]) -> list[int]:
        manager = self.manager
        self.begin_step(rids, tokens)
        manager.pre_forward()
        cached = [manager.requests[r] for r in rids]
        timer = ForwardTimer()
        if self.fast is not None and self.fast.supports(cached):
            logits = self.fast.forward(cached, tokens)
        else:
            logits = self.runner.forward([[t] for t in tokens], manager.batch_view(rids))
        timer.stop()
        next_tokens = logits.argmax(-1).tolist()
        self.forward_s.append(timer.seconds())
        self.end_step(rids)
        return next_tokens

    def finish(self, rids: list[str], keep_turn: bool = False) -> None:
        for rid in rids:
            self.manager.finish(rid, keep_turn)
