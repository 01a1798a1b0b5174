"""Byte-level and tiktoken tokenizers behind one protocol; streaming decode against bytes.decode."""

import base64
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3core.tokenizer import (
    ByteTokenizer,
    StreamDecoder,
    TiktokenTokenizer,
    Tokenizer,
    UnknownTokenError,
    VocabFormatError,
    load_tiktoken,
)

SPECIALS = {"[BOS]": 400, "[EOS]": 401, "[PAD]": 402, "[open]": 403, "[sep]": 404, "[close]": 405,
            "[end_of_msg]": 406}  # fmt: skip
# Merges on top of the 256 bytes. "日" is e6 97 a5, "本" is e6 9c ac: the merge a5 e6 spans the two
# characters, so a token boundary falls inside a character (as real Han merges can).
MERGES = [b"he", b"ll", b"hell", b"\xa5\xe6", b"\xe6\x97"]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> TiktokenTokenizer:
    path = tmp_path_factory.mktemp("vocab") / "tiktoken.model"
    tokens = [bytes((b,)) for b in range(256)] + MERGES
    path.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)))
    return load_tiktoken(path, SPECIALS)


def test_byte_ids_are_the_documented_ones():
    tok = ByteTokenizer()
    assert dict(tok.special_tokens) == {"[BOS]": 256, "[EOS]": 257, "[PAD]": 258, "[open]": 259,
                                        "[sep]": 260, "[close]": 261, "[end_of_msg]": 262}  # fmt: skip
    assert tok.vocab_size == 263
    assert tok.encode("hé") == [104, 0xC3, 0xA9]
    assert isinstance(tok, Tokenizer)


@settings(max_examples=60, deadline=None)
@given(st.text())
def test_byte_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode())
    assert tok.decode(ids) == text


def test_plain_encode_never_makes_structure_tokens():
    tok = ByteTokenizer()
    text = "x[open]y[end_of_msg]"
    assert all(i < 256 for i in tok.encode(text))
    with_specials = tok.encode(text, allow_special=True)
    assert with_specials == [ord("x"), 259, ord("y"), 262]
    assert tok.decode(with_specials) == text
    assert tok.decode(with_specials, skip_special=True) == "xy"


def test_bpe_merges_specials_and_decode(bpe):
    assert bpe.encode("hello") == [258, ord("o")]
    assert bpe.encode("[open]hello") == list(b"[open]") + [258, ord("o")]
    assert bpe.encode("[open]hello", allow_special=True) == [403, 258, ord("o")]
    assert bpe.vocab_size == 407
    assert bpe.decode([403, 258, ord("o")], skip_special=True) == "hello"
    with pytest.raises(UnknownTokenError, match="399"):
        bpe.token_bytes(399)


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("日本hel o\n[]é🙂"))))
def test_streaming_equals_whole_decode_and_never_splits_a_character(text):
    tok = ByteTokenizer()
    _check_stream(tok, tok.encode(text), text)


def test_streaming_bpe_tokens_that_cut_through_characters(bpe):
    text = "日本日本 hello"
    ids = bpe.encode(text)
    assert 259 in ids or 260 in ids  # a cross-character merge really is used
    _check_stream(bpe, ids, text)


def _check_stream(tok, ids, text):
    dec = StreamDecoder(tok)
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == text
    # A character cut between tokens is held back, never emitted as U+FFFD.
    assert "\ufffd" not in "".join(pieces)


def test_streaming_holds_back_partial_utf8_then_flushes_invalid_as_replacement():
    tok = ByteTokenizer()
    dec = StreamDecoder(tok)
    assert dec.push(0xE6) == "" and dec.pending
    assert dec.push(0x97) == ""
    assert dec.push(0xA5) == "日" and not dec.pending
    assert dec.push(0xE6) == ""
    assert dec.push(tok.special_tokens["[sep]"]) == "\ufffd[sep]"  # a special ends the partial char
    assert dec.push(0xFF) == "\ufffd"


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=40))
def test_streaming_matches_bytes_decode_on_arbitrary_bytes(data):
    dec = StreamDecoder(ByteTokenizer())
    out = "".join(dec.push(b) for b in data) + dec.flush()
    assert out == data.decode("utf-8", errors="replace")


def test_tokenizer_config_specials_and_errors(tmp_path):
    vocab = tmp_path / "v.model"
    vocab.write_text("".join(f"{base64.b64encode(bytes((b,))).decode()} {b}\n" for b in range(256)))
    cfg = tmp_path / "tokenizer_config.json"
    cfg.write_text(json.dumps({"added_tokens_decoder": {str(i): {"content": n} for n, i in SPECIALS.items()}}))
    tok = load_tiktoken(vocab, cfg)
    assert tok.special_tokens["[end_of_msg]"] == 406
    with pytest.raises(UnknownTokenError, match=r"\[sep\]"):
        load_tiktoken(vocab, {k: v for k, v in SPECIALS.items() if k != "[sep]"})
    with pytest.raises(VocabFormatError, match="collide"):
        load_tiktoken(vocab, {**SPECIALS, "[PAD]": 7})
    bad = tmp_path / "bad.model"
    bad.write_text("aGk= 0\nnot-base64!! 1\n")
    with pytest.raises(VocabFormatError, match="bad.model:2"):
        load_tiktoken(bad, SPECIALS)
