"""The offline ``Engine`` API (SGLang-shaped), on the same three processes as the server."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

from engine.config import ServerArgs
from engine.entrypoints.launch import launch_runtime
from engine.managers.tokenizer_manager import EmbeddingRequest, GenerateRequest, TokenizerManager


class Engine:
    """Runs a model offline: ``Engine(model_path=..., **server_args).generate(...)``.

    Keyword arguments are ``ServerArgs`` fields (the CLI flags in snake case).
    """

    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        values = dict(kwargs)
        if model_path is not None:
            values["model_path"] = model_path
        self.server_args = ServerArgs.from_dict(values, where=" (Engine argument)")
        args = self.server_args
        # The tokenizer is loaded while the scheduler loads the model (launch_runtime).
        self.runtime = launch_runtime(args)
        tokenizer = self.runtime.tokenizer
        self.loop = asyncio.new_event_loop()
        self.tokenizer_manager: TokenizerManager = self.loop.run_until_complete(self._make_manager(tokenizer))
        self._closed = False

    async def _make_manager(self, tokenizer: Any) -> TokenizerManager:
        rt = self.runtime
        manager = TokenizerManager(self.server_args, rt.model_path, rt.ipc, rt.ready, rt.processes, tokenizer)
        manager.start()
        return manager

    @property
    def tokenizer(self) -> Any:
        return self.tokenizer_manager.tokenizer

    # -- generation ----------------------------------------------------------------
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int = 0,
        stream: bool = False,
        rid: str | list[str] | None = None,
        priority: int | None = None,
        lora_path: str | list[str | None] | None = None,
        image_data: Any = None,
        video_data: Any = None,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """Generates for one prompt (returns a dict) or a batch (returns a list of dicts).

        Each dict has ``text``, ``output_ids`` and ``meta_info`` (``prompt_tokens``,
        ``completion_tokens``, ``cached_tokens``, ``finish_reason``...). With
        ``stream=True`` (single prompt) returns an iterator of cumulative outputs.
        With ``sampling_params["n"] > 1`` a single prompt returns a list of n outputs.
        ``lora_path``: the LoRA adapter (its name) every prompt runs with, or one per prompt
        (None: the base model); docs/lora.md.
        ``image_data`` / ``video_data``: a vision-language model's images (a data: URL, path or URL,
        or a list) and videos (frame lists) for the prompt, one entry per prompt of a batch; the
        prompt holds the model's placeholder once per item (docs/multimodal.md).
        """
        reqs, single = self._build_requests(prompt, sampling_params, input_ids, return_logprob,
                                            logprob_start_len, top_logprobs_num, rid, priority, lora_path,
                                            (image_data, video_data))
        if stream:
            if not single or len(reqs) != 1:
                raise ValueError("stream=True takes a single prompt with n=1")
            return self._stream(reqs[0])
        outputs = self.loop.run_until_complete(self._run_all(reqs))
        return outputs[0] if single and len(outputs) == 1 else outputs

    def _build_requests(self, prompt: Any, sampling_params: Any, input_ids: Any, return_logprob: bool,
                        logprob_start_len: int | None, top_logprobs_num: int, rid: Any,
                        priority: int | None, lora_path: Any = None,
                        media: tuple[Any, Any] = (None, None)) -> tuple[list[GenerateRequest], bool]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt and input_ids")
        if prompt is not None:
            single = isinstance(prompt, str)
            texts: list[Any] = [prompt] if single else list(prompt)
            ids: list[Any] = [None] * len(texts)
        else:
            single = not input_ids or not isinstance(input_ids[0], list)
            ids = [input_ids] if single else list(input_ids)
            texts = [None] * len(ids)
        n = len(texts)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or {}] * n
        if len(params) != n:
            raise ValueError(f"sampling_params has {len(params)} entries for {n} prompts")
        rids = rid if isinstance(rid, list) else [rid] * n
        loras = lora_path if isinstance(lora_path, list) else [lora_path] * n
        if len(loras) != n:
            raise ValueError(f"lora_path has {len(loras)} entries for {n} prompts")
        images, videos = ([value] * n if value is None or single else list(value) for value in media)
        if len(images) != n or len(videos) != n:
            raise ValueError(f"image_data/video_data: a batch of {n} prompts needs one entry (or None) per prompt")
        reqs: list[GenerateRequest] = []
        for i in range(n):
            p = dict(params[i])
            copies = int(p.pop("n", 1) or 1)
            for c in range(copies):
                this_rid = rids[i] if copies == 1 else (f"{rids[i]}-{c}" if rids[i] else None)
                cp = dict(p)
                if copies > 1 and cp.get("seed") is not None:
                    cp["seed"] = cp["seed"] + c  # distinct but reproducible samples
                reqs.append(GenerateRequest(
                    text=texts[i], input_ids=ids[i], sampling_params=cp, rid=this_rid,
                    return_logprob=return_logprob,
                    logprob_start_len=-1 if logprob_start_len is None else logprob_start_len,
                    top_logprobs_num=top_logprobs_num, priority=priority or 0, lora_path=loras[i],
                    image_data=images[i], video_data=videos[i]))
            if copies > 1:
                single = False
        return reqs, single

    async def _run_all(self, reqs: list[GenerateRequest]) -> list[dict[str, Any]]:
        manager = self.tokenizer_manager
        prepared = [manager.prepare(r) for r in reqs]  # validate the whole batch first

        async def one(req: GenerateRequest, prep: Any) -> dict[str, Any]:
            out: dict[str, Any] = {}
            async for out in manager.generate(req, prep):
                pass
            return out

        return list(await asyncio.gather(*(one(r, p) for r, p in zip(reqs, prepared))))

    def _stream(self, req: GenerateRequest) -> Iterator[dict[str, Any]]:
        req.stream = True
        agen = self.tokenizer_manager.generate(req)
        try:
            while True:
                try:
                    yield self.loop.run_until_complete(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self.loop.run_until_complete(agen.aclose())

    async def async_generate(self, prompt: str | None = None, sampling_params: dict[str, Any] | None = None,
                             input_ids: list[int] | None = None, **kwargs: Any) -> dict[str, Any]:
        """Async variant for one prompt, usable inside the engine's own loop only."""
        req = GenerateRequest(text=prompt, input_ids=input_ids, sampling_params=sampling_params or {}, **kwargs)
        out: dict[str, Any] = {}
        async for out in self.tokenizer_manager.generate(req):
            pass
        return out

    # -- pooling (--task embed / score) ------------------------------------------------
    def encode(self, prompt: str | list[str] | list[int] | list[list[int]],
               dimensions: int | None = None) -> dict[str, Any] | list[dict[str, Any]]:
        """Pools one input (returns a dict) or a batch (returns a list of dicts), as SGLang's
        ``Engine.encode``: each dict has ``embedding`` (floats) and ``meta_info``
        (``prompt_tokens``, ``cached_tokens``). An input is a text or a list of token ids.
        Raises ``RequestError`` naming the field on bad input."""
        single = isinstance(prompt, str) or (isinstance(prompt, list) and bool(prompt)
                                             and all(isinstance(t, int) for t in prompt))
        inputs: list[Any] = [prompt] if single else list(prompt)
        req = EmbeddingRequest(inputs=inputs, dimensions=dimensions, field_name="prompt")
        results = self.loop.run_until_complete(self.tokenizer_manager.embed(req))
        outputs = [{"embedding": r.embedding, "meta_info": {"prompt_tokens": r.prompt_tokens,
                                                            "cached_tokens": r.cached_tokens}} for r in results]
        return outputs[0] if single else outputs

    # -- LoRA adapters -----------------------------------------------------------------
    def load_lora_adapter(self, name: str, path: str, pinned: bool = False) -> dict[str, str]:
        """Loads the PEFT adapter directory ``path`` as ``name``; returns the loaded adapters
        (name -> path). Raises RequestError naming the field when it cannot be served."""
        return self.loop.run_until_complete(self.tokenizer_manager.load_lora_adapter(name, path, pinned))

    def unload_lora_adapter(self, name: str) -> dict[str, str]:
        """Unloads ``name`` (requests running on it finish with it); returns the loaded adapters."""
        return self.loop.run_until_complete(self.tokenizer_manager.unload_lora_adapter(name))

    # -- control -------------------------------------------------------------------
    def flush_cache(self) -> bool:
        return self.loop.run_until_complete(self.tokenizer_manager.control("flush_cache")).ok

    def get_server_info(self) -> dict[str, Any]:
        reply = self.loop.run_until_complete(self.tokenizer_manager.control("server_info"))
        ready = self.runtime.ready
        return {**self.server_args.to_dict(), **reply.data, "model_path": self.runtime.model_path,
                "context_len": ready.context_len, "attention_backend": ready.attention_backend,
                "platform": ready.platform, "dtype": ready.dtype, "device": ready.device,
                "router": self.tokenizer_manager.router.stats()}

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.loop.run_until_complete(self.tokenizer_manager.close())
        finally:
            self.runtime.shutdown()
            self.loop.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            if not getattr(self, "_closed", True):
                self.shutdown()
        except Exception:
            pass
