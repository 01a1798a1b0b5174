"""XTML token writer: XML structure spelled with reserved tokens instead of angle brackets (app. F).

    element:  [open]tag attr="v"[sep] body [close]tag[sep]
    message:  [open]role attr="v"[sep] body [end_of_msg]

Attribute values are JSON string literals, so quotes and backslashes inside them stay unambiguous.
Text goes through ``tokenizer.encode`` without specials: a user who types "[open]" gets bytes, not
structure. Every piece is encoded on its own, so a rendering never depends on what follows it; that
is what makes earlier turns an exact token prefix of later ones.
"""

from __future__ import annotations

import json
import re

from k3core.tokenizer.protocol import CLOSE, END_OF_MSG, OPEN, SEP, Tokenizer, special_id

_ATTR = re.compile(r'\s+([A-Za-z_][\w-]*)=("(?:[^"\\]|\\.)*")')
_TAG = re.compile(r"[A-Za-z_][\w-]*")


class ChatTemplateError(ValueError):
    """A request the template cannot render; the message names the offending field."""


def format_header(tag: str, attrs: dict[str, str] | None = None) -> str:
    parts = [tag] + [f"{name}={json.dumps(value, ensure_ascii=False)}" for name, value in (attrs or {}).items()]
    return " ".join(parts)


def parse_header(header: str) -> tuple[str, dict[str, str]]:
    """Inverse of :func:`format_header`; raises ValueError on anything else."""
    tag_match = _TAG.match(header)
    if not tag_match:
        raise ValueError(f"bad element header {header!r}")
    attrs: dict[str, str] = {}
    pos = tag_match.end()
    while pos < len(header):
        m = _ATTR.match(header, pos)
        if not m:
            raise ValueError(f"bad attributes in element header {header!r}")
        attrs[m.group(1)] = json.loads(m.group(2))
        pos = m.end()
    return tag_match.group(0), attrs


class XtmlWriter:
    """Appends tokens and remembers where each message ended (KDA checkpoint positions)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.message_ends: list[int] = []
        self._open = special_id(tokenizer, OPEN)
        self._sep = special_id(tokenizer, SEP)
        self._close = special_id(tokenizer, CLOSE)
        self._end = special_id(tokenizer, END_OF_MSG)

    def text(self, text: str) -> None:
        self.tokens.extend(self.tokenizer.encode(text))

    def open(self, tag: str, attrs: dict[str, str] | None = None) -> None:
        self.tokens.append(self._open)
        self.text(format_header(tag, attrs))
        self.tokens.append(self._sep)

    def close(self, tag: str) -> None:
        self.tokens.append(self._close)
        self.text(tag)
        self.tokens.append(self._sep)

    def element(self, tag: str, body: str, attrs: dict[str, str] | None = None) -> None:
        self.open(tag, attrs)
        self.text(body)
        self.close(tag)

    def end_message(self) -> None:
        self.tokens.append(self._end)
        self.message_ends.append(len(self.tokens))

    def message(self, role: str, body: str, attrs: dict[str, str] | None = None) -> None:
        self.open(role, attrs)
        self.text(body)
        self.end_message()
