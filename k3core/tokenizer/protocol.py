"""The one tokenizer interface the chat template, the workers and the gateway program against."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol, runtime_checkable

# XTML structure tokens (report appendix F): angle brackets of XML replaced by reserved tokens.
OPEN = "[open]"
SEP = "[sep]"
CLOSE = "[close]"
END_OF_MSG = "[end_of_msg]"
BOS = "[BOS]"
EOS = "[EOS]"
PAD = "[PAD]"
XTML_SPECIALS = (OPEN, SEP, CLOSE, END_OF_MSG)
REQUIRED_SPECIALS = (BOS, EOS, PAD, *XTML_SPECIALS)


@runtime_checkable
class Tokenizer(Protocol):
    """Text <-> token ids. Plain ``encode`` NEVER yields a special token, so user text that spells
    ``[open]`` stays literal bytes and cannot inject structure into a chat template."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def special_tokens(self) -> Mapping[str, int]: ...

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]: ...

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...


class UnknownTokenError(ValueError):
    """A token id outside the vocabulary, or a special token the vocabulary lacks."""


def special_id(tokenizer: Tokenizer, name: str) -> int:
    try:
        return tokenizer.special_tokens[name]
    except KeyError:
        raise UnknownTokenError(f"tokenizer has no special token {name!r}") from None


def check_required_specials(specials: Mapping[str, int]) -> None:
    missing = [name for name in REQUIRED_SPECIALS if name not in specials]
    if missing:
        raise UnknownTokenError(f"special-token map lacks {missing} (XTML needs {list(REQUIRED_SPECIALS)})")


def decode_bytes(tokenizer: Tokenizer, ids: Iterable[int], skip_special: bool) -> str:
    """Shared decode: concatenate token bytes, invalid UTF-8 becomes U+FFFD."""
    special_ids = set(tokenizer.special_tokens.values())
    parts = [tokenizer.token_bytes(i) for i in ids if not (skip_special and i in special_ids)]
    return b"".join(parts).decode("utf-8", errors="replace")
