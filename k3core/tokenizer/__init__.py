"""Tokenizers behind one protocol: byte-level for ``nano``, tiktoken BPE for released vocabularies."""

from k3core.tokenizer.byte_level import BYTE_SPECIALS, ByteTokenizer
from k3core.tokenizer.protocol import (
    BOS,
    CLOSE,
    END_OF_MSG,
    EOS,
    OPEN,
    PAD,
    SEP,
    Tokenizer,
    UnknownTokenError,
    special_id,
)
from k3core.tokenizer.streaming import StreamDecoder
from k3core.tokenizer.tiktoken_vocab import KIMI_PAT_STR, TiktokenTokenizer, VocabFormatError, load_tiktoken

__all__ = [
    "BOS",
    "BYTE_SPECIALS",
    "CLOSE",
    "END_OF_MSG",
    "EOS",
    "KIMI_PAT_STR",
    "OPEN",
    "PAD",
    "SEP",
    "ByteTokenizer",
    "StreamDecoder",
    "TiktokenTokenizer",
    "Tokenizer",
    "UnknownTokenError",
    "VocabFormatError",
    "load_tiktoken",
    "special_id",
]
