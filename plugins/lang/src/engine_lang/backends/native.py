"""What the backends on SGLang's native ``/generate`` share: request bodies, choice scoring and
prefix hints. ``RuntimeEndpoint`` sends the bodies over HTTP, ``Engine`` to an in-process engine.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from engine_lang.backends.base import Backend, GenOutput, GenRequest, ScoreOutput, ScoreRequest
from engine_lang.choices import ChoiceLogprobs


class NativeBackend(Backend):
    """Subclasses implement ``_call`` (one body, its output or list of outputs), ``_stream``
    (cumulative outputs) and ``_abort_one``; logprob entries are ``[logprob, id, text]``."""

    def __init__(self) -> None:
        # Requests sent under a program-level id (a scoring's prefix and batch): abort() stops all.
        self._children: dict[str, list[str]] = {}
        self._lock = threading.Lock()

    def _call(self, body: dict[str, Any]) -> Any:
        raise NotImplementedError

    def _stream(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        raise NotImplementedError

    def _abort_one(self, rid: str) -> None:
        raise NotImplementedError

    @staticmethod
    def _body(req: GenRequest, stream: bool) -> dict[str, Any]:
        return {"text": req.text, "sampling_params": dict(req.sampling_params), "rid": req.rid, "stream": stream,
                **req.logprobs}

    def generate(self, req: GenRequest) -> GenOutput:
        out = self._call(self._body(req, False))
        return GenOutput(out["text"], out["meta_info"])

    def generate_stream(self, req: GenRequest) -> Iterator[GenOutput]:
        for out in self._stream(self._body(req, True)):
            yield GenOutput(out["text"], out["meta_info"])

    def cache_prefix(self, text: str, rid: str) -> dict[str, Any] | None:
        # max_new_tokens 0 runs the prompt only: its KV stays in the radix cache for what follows.
        out = self._call({"text": text, "sampling_params": {"max_new_tokens": 0}, "rid": rid})
        return out["meta_info"]

    def score(self, req: ScoreRequest) -> ScoreOutput:
        n = len(req.choices)
        rids = [f"{req.rid}-{i}" for i in range(2 * n if req.unconditional else n)]
        with self._lock:
            self._children[req.rid] = [f"{req.rid}-prefix", *rids]
        try:
            return self._score(req, rids)
        finally:
            with self._lock:
                self._children.pop(req.rid, None)

    def _score(self, req: ScoreRequest, rids: list[str]) -> ScoreOutput:
        n = len(req.choices)
        prefix_tokens = 0
        if req.prefix:
            # Also the prefix hint: the choices' prompts then find the prefix in the cache.
            prefix_tokens = (self.cache_prefix(req.prefix, f"{req.rid}-prefix") or {})["prompt_tokens"]
        texts = [req.prefix + c for c in req.choices]
        # One token before the prefix's end: the choice may merge with the prefix's last token.
        starts = [max(prefix_tokens - 1, 0)] * n
        if req.unconditional:
            texts += list(req.choices)
            starts += [0] * n
        outs = self._call({"text": texts, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                           "logprob_start_len": starts, "return_text_in_logprobs": True, "rid": rids})
        choices = []
        for i in range(n):
            entries = [list(e) for e in outs[i]["meta_info"]["input_token_logprobs"]]
            first_text = entries[0][2] if entries else None
            if prefix_tokens and len(entries) > 1 and first_text is not None and req.prefix.endswith(first_text):
                entries = entries[1:]  # that token is the prefix's own last token, not the choice's
            uncond = None
            if req.unconditional:
                uncond = [e[0] for e in outs[n + i]["meta_info"]["input_token_logprobs"]]
            choices.append(ChoiceLogprobs(entries, uncond))
        meta = {"prefix_tokens": prefix_tokens,
                "cached_tokens": [o["meta_info"].get("cached_tokens", 0) for o in outs[:n]]}
        return ScoreOutput(choices, meta)

    def abort(self, rid: str) -> None:
        with self._lock:
            targets = [rid, *self._children.get(rid, [])]
        for target in targets:
            self._abort_one(target)
