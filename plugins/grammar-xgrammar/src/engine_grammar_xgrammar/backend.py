"""xgrammar behind ``engine.constrained.GrammarBackend``."""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import xgrammar as xgr

from engine.constrained import GrammarBackend, GrammarError, GrammarKey, GrammarMatcher, TokenizerInfo

# Batches smaller than this are filled matcher by matcher (the thread pool costs more than it saves).
_BATCH_FILL_MIN = 4
# Acceptance splits a batch over threads only in slices of at least this many rows: one accept
# costs 15-30 us of C++ (the GIL released), a hand-off to a pool thread tens of microseconds.
_ACCEPT_ROWS_PER_THREAD = 8

# xgrammar prefixes its errors with "[time] /path/file.cc:line: ": not the user's business.
_LOCATION = re.compile(r"^\s*\[[0-9:]+\]\s*\S+:\d+:\s*")


def _clean(exc: BaseException) -> str:
    return _LOCATION.sub("", str(exc)).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


class XGrammarMatcher(GrammarMatcher):
    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._m = matcher

    def accept_token(self, token_id: int) -> bool:
        return bool(self._m.accept_token(token_id))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def copy(self) -> XGrammarMatcher:
        return XGrammarMatcher(self._m.fork())


class XGrammarBackend(GrammarBackend):
    def __init__(self, tokenizer_info: TokenizerInfo, options: dict[str, Any] | None = None) -> None:
        super().__init__(tokenizer_info)
        options = options or {}
        self.any_whitespace = bool(options.get("any_whitespace", False))
        self.compile_threads = int(options.get("compile_threads", 2))
        self.fill_threads = int(options.get("fill_threads", 0)) or min(8, os.cpu_count() or 1)
        self.accept_threads = int(options.get("accept_threads", 0)) or min(8, os.cpu_count() or 1)
        self._batch: xgr.BatchGrammarMatcher | None = None
        self._accept_pool: ThreadPoolExecutor | None = None
        self._compiler: xgr.GrammarCompiler | None = None
        self._lock = threading.Lock()

    @property
    def compiler(self) -> xgr.GrammarCompiler:
        # Built on first use: reading the vocabulary takes ~0.2 s for 49k tokens.
        with self._lock:
            if self._compiler is None:
                info = self.tokenizer_info
                xinfo = xgr.TokenizerInfo.from_huggingface(
                    info.tokenizer, vocab_size=info.vocab_size,
                    stop_token_ids=list(info.stop_token_ids) or None)
                # The engine caches compiled grammars by key; xgrammar's own cache would double it.
                self._compiler = xgr.GrammarCompiler(xinfo, max_threads=self.compile_threads, cache_enabled=False)
            return self._compiler

    def validate(self, key: GrammarKey) -> None:
        # Grammar construction only (no token tables): well under a millisecond for a schema.
        self._grammar(key)

    def compile(self, key: GrammarKey) -> Any:
        grammar = self._grammar(key)
        try:
            return self.compiler.compile_grammar(grammar)
        except Exception as exc:
            raise GrammarError(f"{key.field}: {_clean(exc)}", key.field) from None

    def _grammar(self, key: GrammarKey) -> xgr.Grammar:
        try:
            if key.kind == "json_schema":
                return xgr.Grammar.from_json_schema(key.text, any_whitespace=self.any_whitespace)
            if key.kind == "regex":
                return xgr.Grammar.from_regex(key.text)
            if key.kind == "ebnf":
                return xgr.Grammar.from_ebnf(key.text)
            if key.kind == "structural_tag":
                return _structural_tag(key.text)
        except Exception as exc:
            raise GrammarError(f"{key.field}: {_clean(exc)}", key.field) from None
        raise GrammarError(f"{key.field}: grammar kind '{key.kind}' is not supported by xgrammar", key.field)

    def matcher(self, compiled: Any) -> GrammarMatcher:
        return XGrammarMatcher(xgr.GrammarMatcher(compiled))

    def fill_bitmasks(self, matchers: list[GrammarMatcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        # xgrammar fills a batch on its own thread pool (the GIL released): at batch 64 that is
        # several times faster than 64 calls in turn.
        if (self.fill_threads <= 1 or len(matchers) < _BATCH_FILL_MIN
                or not all(isinstance(m, XGrammarMatcher) for m in matchers)):
            super().fill_bitmasks(matchers, bitmask, rows)
            return
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(max_threads=self.fill_threads)
        self._batch.batch_fill_next_token_bitmask([m._m for m in matchers], bitmask, rows)

    def accept_tokens(self, matchers: Sequence[GrammarMatcher], token_ids: Sequence[int]) -> list[bool]:
        """One ``BatchGrammarMatcher.batch_accept_token`` call (a C++ loop, no Python per row), in
        slices on ``accept_threads`` threads for a large batch (each slice's matchers are its own,
        and xgrammar releases the GIL while it accepts)."""
        if len(matchers) != len(token_ids):
            raise ValueError(f"accept_tokens: {len(matchers)} matchers but {len(token_ids)} token ids")
        if not all(isinstance(m, XGrammarMatcher) for m in matchers):
            return super().accept_tokens(matchers, token_ids)
        handles = [m._m for m in matchers]  # type: ignore[attr-defined]
        ids = [int(t) for t in token_ids]
        accept = xgr.BatchGrammarMatcher.batch_accept_token
        slices = min(self.accept_threads, len(handles) // _ACCEPT_ROWS_PER_THREAD)
        if slices <= 1:
            return accept(handles, ids)
        if self._accept_pool is None:
            self._accept_pool = ThreadPoolExecutor(self.accept_threads - 1, thread_name_prefix="xgrammar-accept")
        bounds = [len(handles) * i // slices for i in range(slices + 1)]
        # The calling thread takes the first slice while the pool runs the others.
        futures = [self._accept_pool.submit(accept, handles[a:b], ids[a:b])
                   for a, b in zip(bounds[1:-1], bounds[2:])]
        accepted = accept(handles[: bounds[1]], ids[: bounds[1]])
        for future in futures:
            accepted.extend(future.result())
        return accepted

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        # xgrammar's kernel (CUDA/Triton on a GPU, a CPU loop otherwise): one launch per batch.
        # vocab_size: logits may be wider than the bitmask covers (padded); those stay as they are
        # here, so they are masked separately.
        if not logits.is_contiguous():  # xgrammar's kernels index rows by a fixed stride
            super().apply_bitmask(logits, bitmask)
            return
        width = min(logits.shape[-1], bitmask.shape[-1] * 32)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=width)
        if logits.shape[-1] > width:
            logits[:, width:] = float("-inf")


def _structural_tag(text: str) -> Any:
    """xgrammar's structural tag; SGLang's older form ``{"structures": [{"begin", "schema",
    "end"}], "triggers": [...]}`` is accepted too."""
    spec = json.loads(text)
    if isinstance(spec, dict) and "structures" in spec and "triggers" in spec:
        tags = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]) if not isinstance(s["schema"], str)
                                      else s["schema"], end=s["end"]) for s in spec["structures"]]
        return xgr.Grammar.from_structural_tag(tags, spec["triggers"])
    return xgr.Grammar.from_structural_tag(text)
