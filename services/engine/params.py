"""Validated per-request generation options (from the proto's SamplingParams)."""

from __future__ import annotations

from dataclasses import dataclass

from k3.v1 import common_pb2
from services.runtime import errors

MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class GenerationOptions:
    temperature: float
    top_k: int
    top_p: float
    seed: int
    max_tokens: int
    stop: tuple[str, ...]
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    logprobs: bool = False
    top_logprobs: int = 0

    @classmethod
    def from_proto(cls, params: common_pb2.SamplingParams, *, vocab_size: int, max_tokens_limit: int,
                   field: str = "sampling") -> GenerationOptions:
        """Check every field and name the bad one (INVALID_ARGUMENT)."""
        if params.temperature < 0 or params.temperature != params.temperature:
            raise errors.InvalidArgument(f"{field}.temperature", f"must be >= 0, got {params.temperature}")
        top_p = params.top_p or 1.0
        if not 0 < top_p <= 1:
            raise errors.InvalidArgument(f"{field}.top_p", f"must be in (0, 1], got {params.top_p}")
        if params.max_tokens == 0:
            raise errors.InvalidArgument(f"{field}.max_tokens", "must be > 0")
        if params.max_tokens > max_tokens_limit:
            raise errors.InvalidArgument(f"{field}.max_tokens", f"{params.max_tokens} exceeds this worker's "
                                         f"limit of {max_tokens_limit}")
        if len(params.stop) > MAX_STOP_STRINGS or any(not s for s in params.stop):
            raise errors.InvalidArgument(f"{field}.stop", f"at most {MAX_STOP_STRINGS} non-empty strings")
        bad = [t for t in params.stop_token_ids if t >= vocab_size]
        if bad:
            raise errors.InvalidArgument(f"{field}.stop_token_ids", f"{bad} outside the vocabulary ({vocab_size})")
        if params.top_logprobs > MAX_TOP_LOGPROBS or (params.top_logprobs and not params.logprobs):
            raise errors.InvalidArgument(f"{field}.top_logprobs", f"must be 0..{MAX_TOP_LOGPROBS} and needs "
                                         f"{field}.logprobs, got {params.top_logprobs}")
        return cls(temperature=params.temperature, top_k=params.top_k, top_p=top_p, seed=params.seed,
                   max_tokens=params.max_tokens, stop=tuple(params.stop),
                   stop_token_ids=frozenset(params.stop_token_ids), ignore_eos=params.ignore_eos,
                   logprobs=params.logprobs, top_logprobs=params.top_logprobs)


def check_prompt(ids: list[int], vocab_size: int, max_len: int, field: str = "prompt.ids") -> None:
    if not ids:
        raise errors.InvalidArgument(field, "must not be empty")
    if len(ids) > max_len:
        raise errors.InvalidArgument(field, f"{len(ids)} tokens exceed this worker's limit of {max_len}")
    bad = next((t for t in ids if t >= vocab_size), None)
    if bad is not None:
        raise errors.InvalidArgument(field, f"token {bad} outside the vocabulary ({vocab_size})")
