"""BPE tokenizer from a tiktoken-format vocabulary (the released Kimi ``tiktoken.model``).

File format: one ``<base64 token bytes> <rank>`` per line; the rank is the token id. Special tokens
come as a separate ``{name: id}`` map or from a Hugging Face ``tokenizer_config.json``
(``added_tokens_decoder``). Encoding runs through the ``tiktoken`` package (Rust BPE).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Mapping
from pathlib import Path

from k3core.tokenizer.protocol import UnknownTokenError, check_required_specials, decode_bytes

# The pre-tokenisation split of the Kimi tokenizers: Han runs, cased words with English
# contractions, 1-3 digit groups, punctuation runs, newlines, whitespace.
KIMI_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
        r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
        r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)


class VocabFormatError(ValueError):
    """A vocabulary file that does not parse; the message names the file and line."""


def read_ranks(path: str | Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(Path(path).read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            token_b64, rank = line.split()
            token = base64.b64decode(token_b64, validate=True)
            ranks[token] = int(rank)
        except (ValueError, base64.binascii.Error) as exc:
            raise VocabFormatError(f"{path}:{lineno}: expected '<base64> <rank>', got {line[:60]!r}") from exc
    if len(set(ranks.values())) != len(ranks):
        raise VocabFormatError(f"{path}: duplicate ranks")
    return ranks


def specials_from_tokenizer_config(path: str | Path) -> dict[str, int]:
    """``{content: id}`` from the ``added_tokens_decoder`` block of a ``tokenizer_config.json``."""
    decoder = json.loads(Path(path).read_text()).get("added_tokens_decoder")
    if not isinstance(decoder, dict):
        raise VocabFormatError(f"{path}: no 'added_tokens_decoder' object")
    return {entry["content"]: int(token_id) for token_id, entry in decoder.items()}


class TiktokenTokenizer:
    def __init__(
        self,
        ranks: Mapping[bytes, int],
        special_tokens: Mapping[str, int],
        *,
        pat_str: str = KIMI_PAT_STR,
        name: str = "k3",
    ) -> None:
        import tiktoken  # optional dependency (extra "tokenizers"): only needed for real vocabularies

        check_required_specials(special_tokens)
        clash = sorted(set(special_tokens.values()) & set(ranks.values()))
        if clash:
            raise VocabFormatError(f"special-token ids {clash[:5]} collide with BPE ranks")
        self._specials = dict(special_tokens)
        self._special_bytes = {i: name.encode() for name, i in self._specials.items()}
        self._encoding = tiktoken.Encoding(
            name=name, pat_str=pat_str, mergeable_ranks=dict(ranks), special_tokens=self._specials
        )
        self._vocab_size = max([*ranks.values(), *self._specials.values()]) + 1

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def special_tokens(self) -> Mapping[str, int]:
        return self._specials

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        if allow_special:
            return self._encoding.encode(text, allowed_special="all")
        return self._encoding.encode(text, allowed_special=set(), disallowed_special=())

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        return decode_bytes(self, ids, skip_special)

    def token_bytes(self, token_id: int) -> bytes:
        if token_id in self._special_bytes:
            return self._special_bytes[token_id]
        try:
            return self._encoding.decode_single_token_bytes(token_id)
        except KeyError:
            raise UnknownTokenError(f"token id {token_id} is not in the vocabulary") from None


def load_tiktoken(
    vocab_path: str | Path,
    special_tokens: Mapping[str, int] | str | Path,
    *,
    pat_str: str = KIMI_PAT_STR,
) -> TiktokenTokenizer:
    """Load a tiktoken vocabulary; ``special_tokens`` is a map or a ``tokenizer_config.json`` path."""
    if isinstance(special_tokens, str | Path):
        special_tokens = specials_from_tokenizer_config(special_tokens)
    return TiktokenTokenizer(read_ranks(vocab_path), special_tokens, pat_str=pat_str)
