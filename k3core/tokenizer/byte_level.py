"""Byte-level tokenizer for the ``nano`` preset: one token per byte plus the special tokens.

Ids: 0-255 are the bytes themselves; 256 [BOS], 257 [EOS], 258 [PAD], 259 [open], 260 [sep],
261 [close], 262 [end_of_msg]. ``vocab_size`` is 263; a model's embedding may be larger (padding).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from k3core.tokenizer.protocol import REQUIRED_SPECIALS, UnknownTokenError, decode_bytes

BYTE_VOCAB = 256
BYTE_SPECIALS: dict[str, int] = {name: BYTE_VOCAB + i for i, name in enumerate(REQUIRED_SPECIALS)}


class ByteTokenizer:
    def __init__(self) -> None:
        self._specials = dict(BYTE_SPECIALS)
        self._special_text = {i: name.encode() for name, i in self._specials.items()}
        self._special_pattern = re.compile("(" + "|".join(map(re.escape, self._specials)) + ")")

    @property
    def vocab_size(self) -> int:
        return BYTE_VOCAB + len(self._specials)

    @property
    def special_tokens(self) -> Mapping[str, int]:
        return self._specials

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        if not allow_special:
            return list(text.encode("utf-8"))
        ids: list[int] = []
        for piece in self._special_pattern.split(text):
            if piece in self._specials:
                ids.append(self._specials[piece])
            else:
                ids.extend(piece.encode("utf-8"))
        return ids

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        return decode_bytes(self, ids, skip_special)

    def token_bytes(self, token_id: int) -> bytes:
        if 0 <= token_id < BYTE_VOCAB:
            return bytes((token_id,))
        try:
            return self._special_text[token_id]
        except KeyError:
            raise UnknownTokenError(f"token id {token_id} outside vocabulary of {self.vocab_size}") from None
