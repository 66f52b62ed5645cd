"""Grammar compilation off the scheduler's critical path, cached by key.

``GrammarCompiler.submit(key)`` returns a future at once: a cached grammar's is already
done; otherwise the backend compiles on a small thread pool (the libraries release the GIL
while compiling) and the scheduler keeps the request in its waiting area until the future is
done. Compiled grammars stay in an LRU cache, so a repeated schema costs nothing.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from engine.constrained.base import GrammarBackend, GrammarError, GrammarKey, GrammarMatcher

logger = logging.getLogger(__name__)


class GrammarCompiler:
    """Compiles and caches grammars of one backend.

    Args:
        make_backend: builds the backend; called once, on the pool (building a backend reads the
            whole vocabulary, which takes a fraction of a second: not on the scheduler's thread).
        max_workers: compile threads.
        cache_size: compiled grammars kept (least recently used dropped first).
    """

    def __init__(self, make_backend: Callable[[], GrammarBackend], max_workers: int = 2,
                 cache_size: int = 256) -> None:
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[GrammarKey, Future[Any]] = OrderedDict()
        self._lock = threading.Lock()
        self.cache_size = cache_size
        # Counters for stats: compiles started, cache hits.
        self.compiles = 0
        self.hits = 0

    @property
    def backend(self) -> GrammarBackend:
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._make_backend()
            return self._backend

    def prepare(self) -> None:
        """Builds the backend on the pool now (a server does at start-up), so the first
        constrained request pays only its compile. A failure here is raised again, per request,
        when a grammar is compiled."""
        self._pool.submit(lambda: self.backend)

    def submit(self, key: GrammarKey) -> Future[Any]:
        """A future of the compiled grammar of ``key`` (shared by requests with the same key)."""
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return fut
            fut = self._pool.submit(self._compile, key)
            self._cache[key] = fut
            self.compiles += 1
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        fut.add_done_callback(lambda f, k=key: self._forget_failure(k, f))
        return fut

    def _compile(self, key: GrammarKey) -> Any:
        try:
            return self.backend.compile(key)
        except GrammarError:
            raise
        except Exception as exc:  # a library error: report it as the request's grammar error
            raise GrammarError(f"{key.field}: cannot compile: {exc}", key.field) from exc

    def _forget_failure(self, key: GrammarKey, fut: Future[Any]) -> None:
        # A failed compile is not cached: the error goes to the requests waiting on it only.
        if fut.exception() is not None:
            with self._lock:
                if self._cache.get(key) is fut:
                    del self._cache[key]

    def matcher(self, compiled: Any) -> GrammarMatcher:
        return self.backend.matcher(compiled)

    def cached(self, key: GrammarKey) -> bool:
        with self._lock:
            fut = self._cache.get(key)
            return fut is not None and fut.done() and fut.exception() is None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
