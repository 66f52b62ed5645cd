"""Structured output: the grammar-backend interface, compilation and batched token masks.

Backends are plugins (``register_grammar_backends``, hook API 4); see
docs/structured_output.md.
"""

from engine.constrained.base import (
    GRAMMAR_KINDS,
    GrammarBackend,
    GrammarError,
    GrammarKey,
    GrammarMatcher,
    TokenizerInfo,
    allocate_bitmask,
    allowed_tokens,
    apply_token_bitmask,
    bitmask_width,
    unpack_bitmask,
)
from engine.constrained.compiler import GrammarCompiler
from engine.constrained.vocab import TOKEN_ENCODINGS, special_token_ids, token_bytes, token_encoding

__all__ = [
    "GRAMMAR_KINDS",
    "TOKEN_ENCODINGS",
    "GrammarBackend",
    "GrammarCompiler",
    "GrammarError",
    "GrammarKey",
    "GrammarMatcher",
    "TokenizerInfo",
    "allocate_bitmask",
    "allowed_tokens",
    "apply_token_bitmask",
    "bitmask_width",
    "special_token_ids",
    "token_bytes",
    "token_encoding",
    "unpack_bitmask",
]
