"""LoRA adapters in the tokenizer manager: the registry of names requests may select, and
``load_lora_adapter`` / ``unload_lora_adapter``. Mixed into ``TokenizerManager`` (docs/lora.md).

A request names an adapter (``lora_path`` of /generate and ``Engine.generate``, ``model`` of
the OpenAI routes); the registry turns that into the adapter NAME the scheduler knows, or
refuses it with an error naming the field before anything is sent, so an unknown adapter
fails its own request only. The scheduler holds the adapters themselves and answers every
load and unload with the whole set it holds, which the registry adopts: the scheduler may drop
adapters on its own (the least recently used beyond ``--max-loaded-loras``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from typing import Any

from engine.managers.io_struct import LoadLoraAdapterReqInput, LoraAdapterReqOutput, UnloadLoraAdapterReqInput
from engine.managers.request_state import RequestError

logger = logging.getLogger("engine.managers.tokenizer_manager")

# How long a LoRA load or unload waits for the scheduler (reading an adapter from disk included).
LORA_TIMEOUT_S = 60.0
# How to get an adapter served, for the errors that say none by that name is.
_HOW_TO_LOAD = "load one with POST /load_lora_adapter or Engine.load_lora_adapter"


class LoraRegistry:
    """Adapter names -> paths the server serves, and the adapters being unloaded."""

    def __init__(self, enabled: bool, adapters: dict[str, str]) -> None:
        # --lora-paths or --enable-lora was given (otherwise every adapter request is refused).
        self.enabled = enabled
        # Name -> adapter directory of each adapter requests may use now.
        self.adapters: dict[str, str] = dict(adapters)
        # Names whose unload is under way: refused at once, and not re-adopted from a reply
        # that was sent before the unload reached the scheduler.
        self.unloading: set[str] = set()
        # Loads and unloads go to the scheduler one at a time, so their replies' adapter sets
        # are adopted in the order the scheduler produced them.
        self.lock = asyncio.Lock()

    def describe(self) -> str:
        """The loaded names for error messages: ``'a', 'b'`` or ``none``."""
        return ", ".join(repr(n) for n in sorted(self.adapters)) or "none"

    def check_enabled(self, field: str, value: Any) -> None:
        if not self.enabled:
            raise RequestError(f"{field}: {value!r} asks for LoRA adapters, which this server runs without; "
                               "start it with --lora-paths NAME=PATH or --enable-lora", field)

    def resolve(self, value: Any, field: str = "lora_path") -> str | None:
        """The adapter name ``value`` selects (None: the base model).

        Args:
            value: an adapter's name, or the path it was loaded from; None for the base model.
            field: the request field, named in the error (``lora_path[2]`` for a batch's third).
        Raises:
            RequestError: the value names no loaded adapter (or LoRA is off).
        """
        if value is None:
            return None
        if not isinstance(value, str) or not value:
            raise RequestError(f"{field}: invalid value {value!r}; accepted: the name of a loaded LoRA adapter, "
                               "or null for the base model", field)
        self.check_enabled(field, value)
        if value in self.adapters:
            return value
        name = self._name_of_path(value)
        if name is not None:
            return name
        state = "is being unloaded" if value in self.unloading else "is not loaded"
        raise RequestError(f"{field}: LoRA adapter {value!r} {state}; loaded: {self.describe()} ({_HOW_TO_LOAD})",
                           field)

    def _name_of_path(self, value: str) -> str | None:
        """The adapter loaded from directory ``value`` (SGLang clients may send the path)."""
        if os.sep not in value and not os.path.isdir(value):
            return None  # a name, not a path: no filesystem look-up for every unknown name
        wanted = os.path.realpath(value)
        return next((n for n, p in self.adapters.items() if os.path.realpath(p) == wanted), None)

    def adopt(self, loaded: dict[str, str]) -> None:
        """Takes the scheduler's set of loaded adapters (from a load or unload reply)."""
        self.adapters = {name: path for name, path in loaded.items() if name not in self.unloading}


def merge_loaded(sets: list[dict[str, str]]) -> dict[str, str]:
    """The adapters every data-parallel replica holds (a request may be routed to any of them)."""
    first, *rest = sets
    return {name: path for name, path in first.items() if all(s.get(name) == path for s in rest)}


class LoraMixin:
    """LoRA adapters of ``TokenizerManager``."""

    # Provided by TokenizerManager.
    args: Any
    sends: list[Any]
    control_waiters: dict[int, asyncio.Future[Any]]
    _tokens: Any
    start: Any
    _check_alive: Any

    @functools.cached_property
    def lora(self) -> LoraRegistry:
        """The LoRA adapters requests may name (the --lora-paths ones until a load or unload)."""
        args = self.args
        return LoraRegistry(bool(getattr(args, "lora_enabled", False)), dict(getattr(args, "lora_paths", None) or {}))

    async def load_lora_adapter(self, name: str, path: str, pinned: bool = False,
                                timeout: float = LORA_TIMEOUT_S) -> dict[str, str]:
        """Loads the PEFT adapter directory ``path`` under ``name`` on every replica.

        Returns the adapters loaded afterwards (name -> path). Raises RequestError naming the
        field (``lora_name`` or ``lora_path``) when the name is taken or the scheduler refuses
        the adapter, asyncio.TimeoutError when the scheduler does not answer in ``timeout`` s.
        """
        registry = self.lora
        registry.check_enabled("lora_name", name)
        for field_name, value in (("lora_name", name), ("lora_path", path)):
            if not isinstance(value, str) or not value.strip():
                raise RequestError(f"{field_name}: invalid value {value!r}; accepted: a non-empty string", field_name)
        if any(c.isspace() for c in name):
            raise RequestError(f"lora_name: invalid value {name!r}; accepted: a name without spaces", "lora_name")
        if name in registry.unloading:
            raise RequestError(f"lora_name: LoRA adapter {name!r} is being unloaded; load it again once that "
                               "has finished", "lora_name")
        if name in registry.adapters:
            raise RequestError(f"lora_name: LoRA adapter {name!r} is already loaded (from {registry.adapters[name]}); "
                               "unload it first or choose another name", "lora_name")
        reply = await self._lora_call(lambda token: LoadLoraAdapterReqInput(name, path, pinned, token), timeout)
        if not reply.success:
            raise RequestError(reply.message, _field_of(reply.message, "lora_path"))
        logger.info("LoRA adapter '%s' loaded from %s; loaded: %s", name, path, registry.describe())
        return dict(registry.adapters)

    async def unload_lora_adapter(self, name: str, timeout: float = LORA_TIMEOUT_S) -> dict[str, str]:
        """Unloads adapter ``name``: new requests naming it are refused from now on; those
        running on it finish with it (the scheduler keeps it until then). Returns the adapters
        loaded afterwards; raises as ``load_lora_adapter``."""
        registry = self.lora
        registry.check_enabled("lora_name", name)
        if name not in registry.adapters:
            raise RequestError(f"lora_name: LoRA adapter {name!r} is not loaded; loaded: {registry.describe()}",
                               "lora_name")
        registry.unloading.add(name)
        del registry.adapters[name]
        try:
            reply = await self._lora_call(lambda token: UnloadLoraAdapterReqInput(name, token), timeout)
        finally:
            registry.unloading.discard(name)
        if not reply.success:
            raise RequestError(reply.message, _field_of(reply.message, "lora_name"))
        logger.info("LoRA adapter '%s' unloaded; loaded: %s", name, registry.describe())
        return dict(registry.adapters)

    async def _lora_call(self, make: Any, timeout: float) -> LoraAdapterReqOutput:
        """Sends ``make(token)`` to every replica and waits for their replies (one call at a
        time); adopts the adapter set they report, whether the call succeeded or not."""
        self._check_alive()
        self.start()
        registry = self.lora
        async with registry.lock:
            loop = asyncio.get_running_loop()
            tokens, futures = [], []
            for sock in self.sends:
                token = next(self._tokens)
                fut: asyncio.Future[LoraAdapterReqOutput] = loop.create_future()
                self.control_waiters[token] = fut
                tokens.append(token)
                futures.append(fut)
                sock.send_pyobj(make(token))
            try:
                replies = list(await asyncio.wait_for(asyncio.gather(*futures), timeout))
            finally:
                for token in tokens:
                    self.control_waiters.pop(token, None)
            registry.adopt(merge_loaded([r.loaded for r in replies]))
        failed = next((r for r in replies if not r.success), None)
        return failed or replies[0]


def _field_of(message: str, default: str) -> str:
    """The request field a scheduler's refusal names first (its messages start with the field)."""
    head = message.split(None, 1)[0].rstrip(":") if message.strip() else ""
    return head if head in ("lora_name", "lora_path") else default
