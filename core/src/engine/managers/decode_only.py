"""What the detokenizer process decodes with: a tokenizer's Rust backend alone, where it decodes alike.

The main process loads the tokenizer and hands it to the detokenizer (``launch``). A transformers
tokenizer unpickles only with transformers imported, about 0.8 s of CPU in a process that needs
nothing else of it. The detokenizer calls one method, ``decode(ids, skip_special_tokens=...)``
(``IncrementalDetokenizer``), and for a ``TokenizersBackend`` that is the ``tokenizers`` library's
own decode unless the class adds a clean-up pass; then ``BackendDecoder`` (which pickles with
``tokenizers`` alone) is sent instead. Any other tokenizer is sent as it is.
"""

from __future__ import annotations

from typing import Any

# Ids decoded both ways before the backend alone is trusted: a later transformers whose decode
# does something more is caught here rather than in a reply's text.
_CHECK_IDS = 512


class BackendDecoder:
    """``decode`` of a transformers ``TokenizersBackend``, on its ``tokenizers.Tokenizer`` alone."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend  # tokenizers.Tokenizer

    def decode(self, token_ids: int | list[int], skip_special_tokens: bool = False, **kwargs: Any) -> str:
        """As ``TokenizersBackend.decode`` without clean-up; ``spaces_between_special_tokens`` and other
        keywords are ignored, as that class ignores them."""
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        return str(self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens))


def decoding_tokenizer(tokenizer: Any) -> Any:
    """The object to send the detokenizer for ``tokenizer``: a ``BackendDecoder`` where that decodes
    exactly as ``tokenizer.decode`` does, else ``tokenizer`` itself (None stays None)."""
    if tokenizer is None:
        return None
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: keep the tokenizer
        return tokenizer
    cls = type(tokenizer)
    if not isinstance(tokenizer, TokenizersBackend) or cls.decode is not TokenizersBackend.decode \
            or cls._decode is not TokenizersBackend._decode:
        return tokenizer  # a class of its own decodes its own way
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or _cleans_up(tokenizer, backend):
        return tokenizer
    decoder = BackendDecoder(backend)
    ids = list(range(min(_CHECK_IDS, len(tokenizer))))
    for skip in (False, True):
        for sample in (ids, ids[:1], ids[-3:]):
            if decoder.decode(sample, skip_special_tokens=skip) != tokenizer.decode(sample, skip_special_tokens=skip):
                return tokenizer
    return decoder


def _cleans_up(tokenizer: Any, backend: Any) -> bool:
    """Whether ``TokenizersBackend._decode`` runs ``clean_up_tokenization`` on this tokenizer's text
    (it skips that for BPE models unless told to corrupt their output anyway)."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    forced = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    return type(backend.model).__name__ != "BPE" or bool(forced)
