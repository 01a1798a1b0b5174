"""Configuration shared by the prefill and decode workers (flags, K3_PREFILL_* / K3_DECODE_* env, files)."""

from __future__ import annotations

import dataclasses
import json

import torch

from k3core.cache.layout import PoolLayout, plan_layout, shape_from_config
from k3core.config import K3Config
from k3core.presets import PRESET_NAMES, preset
from services.runtime import ServiceConfig

MAX_SPECULATIVE_TOKENS = 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WARMUP_MODES = ("auto", "on", "off")  # WorkerConfig.warmup (services/engine/warmup.py)


@dataclasses.dataclass
class WorkerConfig(ServiceConfig):
    model: str = "nano"
    # JSON object of K3Config fields to override on the preset (e.g. '{"kda_num_heads": 4}').
    model_overrides: str = ""
    # A Hugging Face-layout checkpoint directory; empty: seeded random weights (tests, benchmarks).
    checkpoint: str = ""
    weights_seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    # Intra-op threads per rank (0: torch's default). One per rank keeps TP ranks from fighting over cores.
    torch_threads: int = 1
    # Tensor-parallel ranks of this worker (one process each); rank 0 serves gRPC.
    tp_size: int = 1
    # torch.distributed rendezvous port on 127.0.0.1 (0: pick a free one).
    dist_port: int = 0
    num_pages: int = 512
    hash_block_tokens: int = 512
    # Host-memory tier for evicted prefix-cache entries and preempted requests; 0 disables it.
    cpu_tier_bytes: int = 0
    max_running: int = 64
    # Tokens computed per step (decode tokens + prefill chunks); prefill chunks are cut at hash-block ends.
    step_token_budget: int = 2048
    max_model_len: int = 32768
    max_tokens_limit: int = 8192
    # The cluster's KV transfer service (used when a request names none; else found through etcd).
    transfer_address: str = ""
    # A draft model preset enables speculative decoding on the decode worker (docs/serving.md); empty disables
    # it. The draft must share the target's vocabulary (tokenizer).
    draft_model: str = ""
    draft_model_overrides: str = ""  # JSON object of K3Config fields to override on the draft preset
    draft_checkpoint: str = ""  # empty: seeded random weights
    draft_weights_seed: int = -1  # -1: the target's weights_seed (same preset + overrides = the target itself)
    # Drafts proposed per running request per step (the target verifies them plus a bonus token in one forward).
    num_speculative_tokens: int = 4
    # Warm-up at start, before SERVING (services/engine/warmup.py): "auto" (on for CUDA, off on CPU, where
    # nothing is JIT-compiled), "on" or "off".
    warmup: str = "auto"

    def validate(self) -> list[str]:
        problems = super().validate()
        if self.model not in PRESET_NAMES:
            problems.append(f"model: unknown preset {self.model!r}; known: {', '.join(PRESET_NAMES)}")
        if self.dtype not in DTYPES:
            problems.append(f"dtype: one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.tp_size < 1:
            problems.append(f"tp_size: must be >= 1, got {self.tp_size}")
        if self.hash_block_tokens < 1:
            problems.append(f"hash_block_tokens: must be >= 1, got {self.hash_block_tokens}")
        if self.step_token_budget < self.hash_block_tokens:
            problems.append(f"step_token_budget: must be >= hash_block_tokens ({self.hash_block_tokens}) so a "
                            f"prefill chunk can reach a hash-block end, got {self.step_token_budget}")
        if self.warmup not in WARMUP_MODES:
            problems.append(f"warmup: one of {', '.join(WARMUP_MODES)}, got {self.warmup!r}")
        if self.num_pages < 4 or self.max_running < 1:
            problems.append("num_pages: must be >= 4; max_running: must be >= 1")
        if self.model_overrides:
            try:
                self.model_config()
            except (ValueError, TypeError) as exc:
                problems.append(f"model_overrides: {exc}")
        if not problems and self.model_config().kda_num_heads % self.tp_size:
            problems.append(f"tp_size: {self.tp_size} does not divide the model's "
                            f"{self.model_config().kda_num_heads} KDA heads")
        if self.draft_model and not problems:
            problems += self._draft_problems()
        return problems

    def _draft_problems(self) -> list[str]:
        if self.draft_model not in PRESET_NAMES:
            return [f"draft_model: unknown preset {self.draft_model!r}; known: {', '.join(PRESET_NAMES)}"]
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            return [f"num_speculative_tokens: must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                    f"got {self.num_speculative_tokens}"]
        try:
            draft = self.draft_config().model_config()
        except (ValueError, TypeError) as exc:
            return [f"draft_model_overrides: {exc}"]
        target = self.model_config().vocab_size
        if draft.vocab_size != target:
            return [f"draft_model: vocabulary of {draft.vocab_size} differs from the target's {target} "
                    "(the draft must share the tokenizer)"]
        return []

    def draft_config(self) -> WorkerConfig:
        """The draft model as a worker config of its own (its preset, overrides, weights; one rank)."""
        seed = self.weights_seed if self.draft_weights_seed < 0 else self.draft_weights_seed
        return dataclasses.replace(self, model=self.draft_model, model_overrides=self.draft_model_overrides,
                                   checkpoint=self.draft_checkpoint, weights_seed=seed, tp_size=1, draft_model="")

    def model_config(self) -> K3Config:
        config = preset(self.model)
        if self.model_overrides:
            overrides = json.loads(self.model_overrides)
            if not isinstance(overrides, dict):
                raise ValueError("must be a JSON object")
            config = config.replace(**overrides)
        return config

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def pool_layout(self) -> PoolLayout:
        """The page layout of one rank. The physical block is the one of TP=1 on every degree, so that
        MLA pages of a prefill at TP=p and a decode at TP=q hold the same tokens and travel page for page."""
        shape = shape_from_config(self.model_config(), self.model)
        dtypes = dict(state_dtype=torch.float32, conv_dtype=self.torch_dtype, mla_dtype=self.torch_dtype,
                      hash_block_tokens=self.hash_block_tokens)
        base = plan_layout(shape, 1, **dtypes)
        return plan_layout(shape, self.tp_size, **dtypes,
                           min_tokens_per_block=base.tokens_per_block)

    def to_argv(self) -> list[str]:
        """The flags that recreate this config (for the worker's non-zero ranks)."""
        argv = []
        for f in dataclasses.fields(self):
            argv += ["--" + f.name.replace("_", "-"), str(getattr(self, f.name))]
        return argv
