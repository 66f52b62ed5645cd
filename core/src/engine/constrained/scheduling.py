"""The scheduler's side of structured output.

``GrammarQueue`` holds the requests whose grammar is compiling (they wait here, not in the
batch: the scheduler admits them to its waiting queue once the compile is done), hands each
one its matcher, and builds the batch's token bitmask every step:

- ``submit(req)``: starts (or finds cached) the compile of the request's grammar key;
- ``poll()``: the requests whose grammar is ready, and those whose compile failed (the
  scheduler finishes them with the error instead of running them);
- ``set_mask(info, reqs, produces)``: fills each constrained row of a ``[B, ceil(V/32)]``
  int32 bitmask on the CPU (rows of unconstrained requests allow everything), copies it to the
  device and sets ``info.vocab_mask``; the sampler applies it to the logits in one batched op
  before sampling;
- ``accept_tokens(reqs, token_ids, appends)``: after sampling, feeds every constrained row's
  token to its matcher in one backend call (``GrammarBackend.accept_tokens``), before the
  scheduler appends the tokens (``Req.append_output`` takes each row's verdict; a refused token
  aborts that request).

The backend and its tokenizer tables are built lazily on the compile pool, so a server that
never sees a constrained request pays nothing, and the first one does not stall the loop.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import TYPE_CHECKING, Any

import torch

from engine.constrained.base import GrammarError, GrammarKey, TokenizerInfo, allocate_bitmask
from engine.constrained.compiler import GrammarCompiler

if TYPE_CHECKING:
    from engine.managers.schedule_batch import Req
    from engine.sampling.sampling_batch_info import SamplingBatchInfo

logger = logging.getLogger(__name__)


class GrammarQueue:
    """Args:
        backend_name: ``--grammar-backend``.
        tokenizer_path: the tokenizer to build token tables from (None: --skip-tokenizer-init).
        vocab_size: the model's logits width.
        stop_token_ids: the model's EOS ids.
        disabled / plugin_options: as for every plugin selection.
    """

    def __init__(self, backend_name: str, tokenizer_path: str | None, vocab_size: int,
                 stop_token_ids: set[int], device: torch.device, disabled: list[str] | tuple[str, ...] = (),
                 plugin_options: dict[str, dict[str, Any]] | None = None, trust_remote_code: bool = False) -> None:
        self.backend_name = backend_name
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(sorted(stop_token_ids))
        self.device = device
        self._disabled = list(disabled)
        self._plugin_options = plugin_options or {}
        self._trust_remote_code = trust_remote_code
        self.compiler = GrammarCompiler(self._make_backend)
        #: requests whose grammar is compiling, in arrival order.
        self.waiting: list[Req] = []
        self._bitmask: torch.Tensor | None = None

    def _make_backend(self) -> Any:
        import engine.plugins as plugins
        from engine.managers.tokenizer_utils import shared_tokenizer

        if self.tokenizer_path is None:
            raise GrammarError("structured output needs a tokenizer; this server runs with --skip-tokenizer-init")
        # The one stop-string checks decode with: a server loads it once, here, at start-up.
        tokenizer = shared_tokenizer(self.tokenizer_path, self._trust_remote_code)
        info = TokenizerInfo(tokenizer, self.vocab_size, self.stop_token_ids, self.tokenizer_path)
        backend = plugins.create_grammar_backend(self.backend_name, info, self._disabled, self._plugin_options)
        logger.info("grammar backend %s ready (vocabulary %d)", self.backend_name, self.vocab_size)
        return backend

    # -- compile -----------------------------------------------------------------------
    def submit(self, req: Req) -> bool:
        """Starts compiling ``req``'s grammar; False when it has none (it may run at once)."""
        key = GrammarKey.of(req.sampling_params)
        if key is None:
            return False
        req.grammar_key = key
        req.grammar_future = self.compiler.submit(key)
        self.waiting.append(req)
        return True

    def poll(self, wait_s: float = 0.0) -> tuple[list[Req], list[tuple[Req, str]]]:
        """(ready requests, (failed request, error message) pairs), both leaving ``waiting``.

        ``wait_s``: block up to this long for a compile to finish (only when the scheduler has
        nothing else to do; never while a batch runs).
        """
        if not self.waiting:
            return [], []
        futures: list[Future[Any]] = [r.grammar_future for r in self.waiting]
        if wait_s > 0 and not any(f.done() for f in futures):
            wait(futures, timeout=wait_s, return_when=FIRST_COMPLETED)
        # Tensor/pipeline ranks step in lockstep but compile on their own threads: rank 0's view
        # decides for all (the others wait for a compile rank 0 has finished; identity alone).
        from engine.distributed import broadcast_objects

        flags = broadcast_objects([f.done() for f in futures])
        ready: list[Req] = []
        failed: list[tuple[Req, str]] = []
        still: list[Req] = []
        for req, done in zip(self.waiting, flags):
            if not done:
                still.append(req)
                continue
            fut, req.grammar_future = req.grammar_future, None
            error = fut.exception()
            if error is None:
                try:
                    req.grammar = self.compiler.matcher(fut.result())
                except Exception as exc:  # a backend failing to start a matcher: that request only
                    error = exc
            if error is not None:
                logger.warning("request %s: grammar not compiled: %s", req.rid, error)
                failed.append((req, f"structured output: {error}"))
            else:
                ready.append(req)
        self.waiting = still
        return ready, failed

    def remove(self, req: Req) -> bool:
        if req in self.waiting:
            self.waiting.remove(req)
            return True
        return False

    # -- per step ----------------------------------------------------------------------
    def set_mask(self, info: SamplingBatchInfo, reqs: list[Req], produces: list[bool] | None = None) -> None:
        """Fills the bitmask of a batch's rows and attaches it to ``info`` (no-op when no row
        is constrained). ``produces[i]`` False: row i's token is thrown away (a prefill chunk
        that is not the last, a request finished after the step was launched)."""
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None and not r.finished()
                and (produces is None or produces[i])]
        if not rows:
            info.vocab_mask = None
            return
        bitmask = self._bitmask_for(len(reqs))
        if len(rows) < len(reqs):
            # Unconstrained rows allow every token; the backend overwrites its rows whole (a kit
            # test), so they are not cleared. numpy, not torch: a torch fill of this pinned buffer
            # runs on the OpenMP pool, which contends with the grammar library's threads (10 ms
            # for 1 MB measured on a busy host, 20 us on one thread).
            filled = set(rows)
            bitmask.numpy()[[i for i in range(len(reqs)) if i not in filled]] = -1
        backend = self.compiler.backend
        backend.fill_bitmasks([reqs[i].grammar for i in rows], bitmask, rows)
        info.vocab_mask = bitmask.to(self.device, non_blocking=True)
        info.apply_vocab_mask = backend.apply_bitmask

    def accept_tokens(self, reqs: Sequence[Req], token_ids: Sequence[int],
                      appends: Sequence[bool] | None = None) -> list[bool | None]:
        """Advances the matchers of a step's rows by their sampled tokens, all in one backend call.

        Args:
            reqs / token_ids: the step's rows and the token sampled for each.
            appends: ``appends[i]`` False: row i's token is not appended (a prefill chunk that is
                not the last, a prompt-only request); None: every row's is.

        Returns:
            Per row, what to hand ``Req.append_output``: whether the grammar accepted the token,
            or None where no matcher took it (unconstrained, finished, or not appended).
        """
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None and not r.finished()
                and (appends is None or appends[i])]
        verdicts: list[bool | None] = [None] * len(reqs)
        if not rows:
            return verdicts
        accepted = self.compiler.backend.accept_tokens([reqs[i].grammar for i in rows], [token_ids[i] for i in rows])
        for i, ok in zip(rows, accepted):
            verdicts[i] = bool(ok)
        return verdicts

    def _bitmask_for(self, batch_size: int) -> torch.Tensor:
        # One pinned host buffer, grown when needed. Reuse is safe: the host-to-device copy of
        # step N has been consumed by step N's sampling before step N+1 fills the buffer again,
        # because filling N+1 waits for N's sampled token.
        if self._bitmask is None or self._bitmask.shape[0] < batch_size:
            self._bitmask = allocate_bitmask(max(batch_size, 64), self.vocab_size)
        return self._bitmask[:batch_size]

    def shutdown(self) -> None:
        self.compiler.shutdown()
