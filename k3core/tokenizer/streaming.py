"""Incremental detokenisation: text comes out as soon as it is whole UTF-8, never half a character."""

from __future__ import annotations

import codecs

from k3core.tokenizer.protocol import Tokenizer


class StreamDecoder:
    """Feed token ids one at a time; ``push`` returns the text that became complete.

    Bytes of a multi-byte character split across tokens are held back until the character is whole;
    an invalid sequence becomes U+FFFD. A special token first flushes any dangling partial character.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._special_ids = set(tokenizer.special_tokens.values())
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        raw = self._tokenizer.token_bytes(token_id)
        if token_id not in self._special_ids:
            return self._utf8.decode(raw)
        dangling = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return dangling if self._skip_special else dangling + raw.decode("utf-8")

    def flush(self) -> str:
        """End of stream: whatever partial character is left becomes U+FFFD."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text

    @property
    def pending(self) -> bool:
        return bool(self._utf8.getstate()[0])
