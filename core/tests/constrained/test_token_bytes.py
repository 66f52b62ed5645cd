"""``engine.constrained.token_bytes``: every token id's bytes for byte-level BPE, SentencePiece
(``▁`` and ``<0xNN>`` byte-fallback tokens) and raw vocabularies; special tokens and padded
ids are None, non-special added tokens are their text."""

from __future__ import annotations

import os
from typing import Any

import pytest

from engine.constrained import TOKEN_ENCODINGS, special_token_ids, token_bytes, token_encoding

TEXTS = ["Hello world", "{\"name\": \"Ann\", \"age\": 31}\n", "naïve café ☕ 12+3", "  two  spaces\ttab"]


@pytest.fixture(scope="module")
def byte_level() -> Any:
    from transformers import AutoTokenizer

    import engine.testing

    return AutoTokenizer.from_pretrained(os.path.join(os.path.dirname(engine.testing.__file__), "tiny_tokenizer"))


def _sentencepiece(raw: bool = False) -> Any:
    """A Llama-2-style tokenizer: Metaspace pieces, 256 byte-fallback tokens, an added
    non-special token; with ``raw`` a WordLevel vocabulary whose pieces are plain text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    if raw:
        for piece in ["Hello", " ", "world", "{", "}"]:
            vocab[piece] = len(vocab)
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Split(" ", "isolated")
    else:
        for b in range(256):
            vocab[f"<0x{b:02X}>"] = len(vocab)
        for piece in ["▁", "▁Hello", "▁world", "Hel", "lo", "{", "\"", "na", "▁caf"]:
            vocab[piece] = len(vocab)
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    t = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    t.add_tokens(["<tool_call>"])
    return t


def test_byte_level_tokens_concatenate_to_the_text(byte_level: Any) -> None:
    assert token_encoding(byte_level) == "byte_level"
    table = token_bytes(byte_level)
    assert len(table) == len(byte_level)
    for text in TEXTS:
        ids = byte_level.encode(text, add_special_tokens=False)
        assert b"".join(table[i] or b"?" for i in ids) == text.encode("utf-8"), text
    space = byte_level.convert_tokens_to_ids("Ġ")
    assert table[space] == b" "


def test_special_and_padded_ids_are_none(byte_level: Any) -> None:
    table = token_bytes(byte_level, len(byte_level) + 64)
    assert len(table) == len(byte_level) + 64
    special = special_token_ids(byte_level)
    assert byte_level.eos_token_id in special and {0, 1, 2, 3} <= special  # <|im_start|> is special too
    assert all(table[i] is None for i in special)
    assert all(b is None for b in table[len(byte_level):])
    assert all(b for i, b in enumerate(table[: len(byte_level)]) if i not in special)


def test_sentencepiece_spaces_and_byte_fallback() -> None:
    tok = _sentencepiece()
    assert token_encoding(tok) == "sentencepiece"
    table = token_bytes(tok)
    assert table[tok.convert_tokens_to_ids("<0x0A>")] == b"\n"
    assert table[tok.convert_tokens_to_ids("<0xE2>")] == b"\xe2"
    assert table[tok.convert_tokens_to_ids("▁Hello")] == b" Hello"
    assert table[tok.convert_tokens_to_ids("<tool_call>")] == b"<tool_call>"  # added, not special
    assert table[tok.eos_token_id] is None and table[tok.unk_token_id] is None
    for text in ["Hello world", "naïve café ☕\n{\"x\"}"]:
        ids = tok.encode(text, add_special_tokens=False)
        # The word-start marker of the first piece is a space a detokenizer strips.
        assert b"".join(table[i] or b"?" for i in ids) == b" " + text.encode("utf-8"), text


def test_raw_vocabulary_and_explicit_encoding() -> None:
    tok = _sentencepiece(raw=True)
    assert token_encoding(tok) == "raw"
    table = token_bytes(tok)
    assert table[tok.convert_tokens_to_ids("world")] == b"world" and table[tok.convert_tokens_to_ids(" ")] == b" "
    # An explicit encoding wins over detection; an unknown one names the accepted ones.
    piece = _sentencepiece()
    assert token_bytes(piece, encoding="raw")[piece.convert_tokens_to_ids("▁Hello")] == "▁Hello".encode()
    with pytest.raises(ValueError, match="encoding 'bpe' is not one of " + ", ".join(TOKEN_ENCODINGS)):
        token_bytes(piece, encoding="bpe")  # type: ignore[arg-type]
