"""The bytes each token id stands for: what a grammar backend matches tokens against.

Tokenizers store their vocabulary in one of a few encodings; a grammar library needs every
token as the bytes it adds to the output:

- **byte-level BPE** (GPT-2, Llama 3, Qwen): each byte is one printable character of GPT-2's
  alphabet (a space is ``Ġ``, a newline ``Ċ``);
- **SentencePiece** (Llama 2, Mistral, Gemma): a space is ``▁`` and bytes outside the pieces are
  byte-fallback tokens ``<0x0A>``;
- **raw**: the piece is the text itself (UTF-8).

Special tokens (BOS, EOS, chat markers) stand for no text: a grammar never allows them (the
engine allows the stop ids itself once a grammar is complete), so they map to None, as do ids
past the tokenizer's vocabulary (logits padded to a round size). Added tokens that are not
special (``<tool_call>`` in some chat templates) are their text, whatever the encoding.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

TokenEncoding = Literal["byte_level", "sentencepiece", "raw"]

#: What ``token_encoding`` may answer (and ``token_bytes(encoding=...)`` accepts).
TOKEN_ENCODINGS: tuple[str, ...] = ("byte_level", "sentencepiece", "raw")

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes map to themselves, the rest to ``chr(256 + n)``."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def _decoder_types(tokenizer: Any) -> set[str]:
    """The decoder component types of a fast (``tokenizers``) tokenizer, nested sequences
    flattened, plus ``"byte_fallback"`` when its BPE model falls back to byte tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    data = json.loads(backend.to_str())
    found: set[str] = set()

    def walk(node: Any) -> None:
        if not isinstance(node, dict):
            return
        kind = node.get("type")
        if kind == "Replace" and "▁" in json.dumps(node.get("pattern", {}), ensure_ascii=False):
            found.add("Metaspace")
        elif isinstance(kind, str):
            found.add(kind)
        for child in node.get("decoders") or node.get("pretokenizers") or []:
            walk(child)

    walk(data.get("decoder"))
    walk(data.get("pre_tokenizer"))
    if (data.get("model") or {}).get("byte_fallback"):
        found.add("byte_fallback")
    return found


def token_encoding(tokenizer: Any) -> TokenEncoding:
    """How ``tokenizer`` writes bytes in its vocabulary: ``"byte_level"``, ``"sentencepiece"``
    or ``"raw"``, read from its decoder (fast tokenizers) or its type (slow ones)."""
    types = _decoder_types(tokenizer)
    if "ByteLevel" in types or hasattr(tokenizer, "byte_decoder"):
        return "byte_level"
    if types & {"Metaspace", "ByteFallback", "byte_fallback"} or hasattr(tokenizer, "sp_model"):
        return "sentencepiece"
    return "raw"


def special_token_ids(tokenizer: Any) -> set[int]:
    """The ids of the tokenizer's special tokens: ``all_special_ids`` and every added token
    marked special."""
    ids = {int(i) for i in getattr(tokenizer, "all_special_ids", ()) if i is not None}
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(token_id))
    return ids


def token_bytes(tokenizer: Any, vocab_size: int | None = None,
                encoding: TokenEncoding | None = None) -> list[bytes | None]:
    """Each token id's bytes, as a grammar backend matches them.

    Args:
        tokenizer: a Hugging Face tokenizer (``TokenizerInfo.tokenizer``).
        vocab_size: entries to return (``TokenizerInfo.vocab_size``, the logits' width); ids
            past the tokenizer's are None. Default: ``len(tokenizer)``.
        encoding: ``"byte_level"``, ``"sentencepiece"`` or ``"raw"``; default: read from the
            tokenizer (``token_encoding``).

    Returns:
        ``out[t]``: the bytes token ``t`` adds to the output (a SentencePiece word-start piece
        keeps its leading space), or None for special tokens and padded ids.
    """
    if encoding is None:
        encoding = token_encoding(tokenizer)
    elif encoding not in TOKEN_ENCODINGS:
        raise ValueError(f"token_bytes: encoding {encoding!r} is not one of {', '.join(TOKEN_ENCODINGS)}")
    size = len(tokenizer)
    width = size if vocab_size is None else vocab_size
    if width < 0:
        raise ValueError(f"token_bytes: vocab_size {vocab_size} is negative")
    special = special_token_ids(tokenizer)
    added = {int(i): t.content for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()}
    pieces = tokenizer.convert_ids_to_tokens(list(range(min(size, width))))
    byte_of = {ch: b for b, ch in gpt2_bytes_to_unicode().items()} if encoding == "byte_level" else {}
    out: list[bytes | None] = [None] * width
    for token_id, piece in enumerate(pieces):
        if token_id in special or piece is None:
            continue
        if token_id in added:  # added tokens are stored as their text in every encoding
            out[token_id] = added[token_id].encode("utf-8")
        elif encoding == "byte_level":
            if all(ch in byte_of for ch in piece):
                out[token_id] = bytes(byte_of[ch] for ch in piece)
            else:  # outside GPT-2's alphabet: a piece stored as text
                out[token_id] = piece.encode("utf-8")
        elif encoding == "sentencepiece":
            match = _BYTE_TOKEN.fullmatch(piece)
            out[token_id] = bytes([int(match.group(1), 16)]) if match else piece.replace("▁", " ").encode("utf-8")
        else:
            out[token_id] = piece.encode("utf-8")
    return out


__all__ = ["TOKEN_ENCODINGS", "TokenEncoding", "gpt2_bytes_to_unicode", "special_token_ids", "token_bytes",
           "token_encoding"]
