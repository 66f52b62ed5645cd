"""SGLang's frontend language on this engine: ``import engine_lang as sgl``.

Programs are Python functions over a state (``@function``), built from text, ``gen``,
``select``, chat roles and ``fork``, run on a backend: ``RuntimeEndpoint(url)`` (``engine
serve``), ``Engine(...)`` (in process) or ``OpenAI(base_url)``. A client library: importing it
imports neither torch nor the engine. See docs/frontend.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine_lang.backends import (
    Backend,
    BackendError,
    RequestAborted,
    UnsupportedOperation,
    connect,
    list_backends,
)
from engine_lang.backends.openai import OpenAI
from engine_lang.backends.runtime_endpoint import RuntimeEndpoint
from engine_lang.chat_template import ChatTemplate
from engine_lang.choices import (
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from engine_lang.ir import assistant, gen, select, system, user
from engine_lang.program import SglFunction, function, get_default_backend, set_default_backend
from engine_lang.run_context import ProgramError
from engine_lang.state import ProgramState, ProgramStateGroup

if TYPE_CHECKING:
    from engine_lang.backends.engine import Engine

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # The in-process backend's module is light, but keeping it lazy keeps `import engine_lang`
    # independent of how that module grows.
    if name == "Engine":
        from engine_lang.backends.engine import Engine

        return Engine
    raise AttributeError(f"module 'engine_lang' has no attribute {name!r}")


__all__ = [
    "Backend", "BackendError", "ChatTemplate", "Engine", "OpenAI", "ProgramError", "ProgramState",
    "ProgramStateGroup", "RequestAborted", "RuntimeEndpoint", "SglFunction", "UnsupportedOperation", "assistant",
    "connect", "function", "gen", "get_default_backend", "greedy_token_selection", "list_backends", "select",
    "set_default_backend", "system", "token_length_normalized", "unconditional_likelihood_normalized", "user",
]
