"""Per-token log-probs in OpenAI's shape: `choices[].logprobs.content[]` entries of token text, logprob,
UTF-8 bytes and top_logprobs, built from the workers' common_pb2.TokenLogprob."""

from __future__ import annotations

from collections.abc import Iterable

from k3.v1 import common_pb2
from k3core.tokenizer.byte_level import ByteTokenizer


def _token(tokenizer: ByteTokenizer, token_id: int, logprob: float) -> dict:
    raw = tokenizer.token_bytes(token_id)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}


def openai_content(tokenizer: ByteTokenizer, logprobs: Iterable[common_pb2.TokenLogprob]) -> list[dict]:
    """One entry per generated token (control tokens of the chat format included, as their text)."""
    return [{**_token(tokenizer, lp.token_id, lp.logprob),
             "top_logprobs": [_token(tokenizer, alt.token_id, alt.logprob) for alt in lp.top]}
            for lp in logprobs]
