"""xgrammar behind ``engine.constrained.GrammarBackend``."""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from engine.constrained import GrammarBackend, GrammarError, GrammarKey, GrammarMatcher, TokenizerInfo

if TYPE_CHECKING:
    import xgrammar as xgr
# xgrammar itself (~0.3 CPU-s to import) is imported where it is first used: a server builds this
# backend at start-up, off the first request's path, but most servers never see a grammar.

# Batches smaller than this are filled matcher by matcher (the thread pool costs more than it saves).
_BATCH_FILL_MIN = 4
# Acceptance splits a batch over threads only in slices of at least this many rows: one accept
# costs 1.5-2 us of C++ (the GIL released) since xgrammar is told the tokenizer's ids only (15-30 us
# with a padded 128k vocabulary), a hand-off to a pool thread tens of microseconds (batch 64 on
# 2 cores: 0.10 ms a step on one thread, 0.22 ms on two).
_ACCEPT_ROWS_PER_THREAD = 256

# xgrammar prefixes its errors with "[time] /path/file.cc:line: ": not the user's business.
_LOCATION = re.compile(r"^\s*\[[0-9:]+\]\s*\S+:\d+:\s*")


def _clean(exc: BaseException) -> str:
    return _LOCATION.sub("", str(exc)).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


class XGrammarMatcher(GrammarMatcher):
    def __init__(self, matcher: xgr.GrammarMatcher, vocab: int, words: int) -> None:
        self._m = matcher
        # xgrammar knows ``vocab`` ids (the tokenizer's, rounded up to whole bitmask words) and
        # writes ``words`` int32 words; the columns past them are padding the backend clears.
        self._vocab, self._words = vocab, words

    def accept_token(self, token_id: int) -> bool:
        return 0 <= token_id < self._vocab and bool(self._m.accept_token(token_id))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if bitmask.shape[1] == self._words:
            self._m.fill_next_token_bitmask(bitmask, row)
            return
        narrow = torch.empty((1, self._words), dtype=torch.int32)
        self._m.fill_next_token_bitmask(narrow, 0)
        dest = bitmask.numpy()
        dest[row, : self._words] = narrow.numpy()[0]
        dest[row, self._words :] = 0

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def copy(self) -> XGrammarMatcher:
        return XGrammarMatcher(self._m.fork(), self._vocab, self._words)


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
        # Set with the compiler: the ids xgrammar is told about (see ``compiler``) and its words.
        self._vocab = tokenizer_info.vocab_size
        self._words = (self._vocab + 31) // 32
        self._narrow: torch.Tensor | None = None  # batch fills' scratch when _words is narrower

    @property
    def compiler(self) -> xgr.GrammarCompiler:
        # Built on first use: reading the vocabulary takes ~0.2 s for 49k tokens.
        with self._lock:
            if self._compiler is None:
                info = self.tokenizer_info
                # xgrammar is told the tokenizer's ids only (rounded up to a whole bitmask word),
                # not the logits' padded width: it treats every id past the tokenizer as a special
                # token and clears them one by one in every fill (a Llama-3-shaped vocabulary of
                # 128,256 rows over a 49,152-token tokenizer: 115 us a row in a JSON string
                # against 9 us). The padded columns are cleared here instead, a word at a time.
                ids = max([_tokenizer_ids(info.tokenizer), *(t + 1 for t in info.stop_token_ids)])
                self._vocab = min(info.vocab_size, -(-ids // 32) * 32)
                self._words = (self._vocab + 31) // 32
                import xgrammar as xgr

                xinfo = xgr.TokenizerInfo.from_huggingface(
                    info.tokenizer, vocab_size=self._vocab, stop_token_ids=list(info.stop_token_ids) or None)
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
        import xgrammar as xgr

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
        import xgrammar as xgr

        return XGrammarMatcher(xgr.GrammarMatcher(compiled), self._vocab, self._words)

    def fill_bitmasks(self, matchers: list[GrammarMatcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        # xgrammar fills a batch on its own thread pool (the GIL released): at batch 64 that is
        # several times faster than 64 calls in turn.
        if (self.fill_threads <= 1 or len(matchers) < _BATCH_FILL_MIN
                or not all(isinstance(m, XGrammarMatcher) for m in matchers)):
            super().fill_bitmasks(matchers, bitmask, rows)
            return
        if self._batch is None:
            import xgrammar as xgr

            self._batch = xgr.BatchGrammarMatcher(max_threads=self.fill_threads)
        handles = [m._m for m in matchers]  # type: ignore[attr-defined]
        if bitmask.shape[1] == self._words:
            self._batch.batch_fill_next_token_bitmask(handles, bitmask, rows)
            return
        # xgrammar writes only whole contiguous rows of its own width (a strided view is not
        # honoured): fill a narrow scratch buffer, then copy its rows and clear the padding.
        if self._narrow is None or self._narrow.shape[0] < bitmask.shape[0]:
            self._narrow = torch.empty((bitmask.shape[0], self._words), dtype=torch.int32)
        self._batch.batch_fill_next_token_bitmask(handles, self._narrow, rows)
        dest = bitmask.numpy()
        dest[rows, : self._words] = self._narrow.numpy()[rows]
        dest[rows, self._words :] = 0

    def accept_tokens(self, matchers: Sequence[GrammarMatcher], token_ids: Sequence[int]) -> list[bool]:
        """One ``BatchGrammarMatcher.batch_accept_token`` call (a C++ loop, no Python per row), in
        slices on ``accept_threads`` threads for a large batch (each slice's matchers are its own,
        and xgrammar releases the GIL while it accepts)."""
        if len(matchers) != len(token_ids):
            raise ValueError(f"accept_tokens: {len(matchers)} matchers but {len(token_ids)} token ids")
        if not all(isinstance(m, XGrammarMatcher) for m in matchers):
            return super().accept_tokens(matchers, token_ids)
        ids = [int(t) for t in token_ids]
        if any(not 0 <= t < self._vocab for t in ids):  # padding ids: refused here, not by xgrammar
            return [m.accept_token(t) for m, t in zip(matchers, ids)]
        handles = [m._m for m in matchers]  # type: ignore[attr-defined]
        import xgrammar as xgr

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
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=width)
        if logits.shape[-1] > width:
            logits[:, width:] = float("-inf")


def _tokenizer_ids(tokenizer: Any) -> int:
    """One past the largest id the tokenizer produces (added tokens included)."""
    size = len(tokenizer)
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return max([size, *(int(i) + 1 for i in added)])


def _structural_tag(text: str) -> Any:
    """xgrammar's structural tag; SGLang's older form ``{"structures": [{"begin", "schema",
    "end"}], "triggers": [...]}`` is accepted too."""
    import xgrammar as xgr

    spec = json.loads(text)
    if isinstance(spec, dict) and "structures" in spec and "triggers" in spec:
        tags = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]) if not isinstance(s["schema"], str)
                                      else s["schema"], end=s["end"]) for s in spec["structures"]]
        return xgr.Grammar.from_structural_tag(tags, spec["triggers"])
    return xgr.Grammar.from_structural_tag(text)
