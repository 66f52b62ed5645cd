"""The backend contract: what a program's executor asks of a server or an engine.

A backend turns requests into outputs; the language (state, roles, choice methods) stays out of
it. ``generate`` and ``abort`` are required; ``generate_stream``, ``score`` (``select``) and
``chat_template`` (roles) are optional, and a backend without one raises
``UnsupportedOperation`` naming it. ``engine_lang.testing.BackendConformance`` checks a backend.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from engine_lang.chat_template import ChatTemplate
from engine_lang.choices import ChoiceLogprobs


class UnsupportedOperation(RuntimeError):
    """The backend cannot do what the program asked (names the operation and the backend)."""


class BackendError(RuntimeError):
    """The server or engine refused or failed a request (its message is in the text)."""


class RequestAborted(BackendError):
    """The request was aborted (the program failed or was interrupted)."""


@dataclass
class GenRequest:
    """One generation: the prompt and the sampling fields, by the native API's names."""

    # The program's text so far (chat roles already rendered).
    text: str
    # max_new_tokens, stop, temperature, regex, json_schema... (only those set).
    sampling_params: dict[str, Any]
    # Request id; abort() takes it.
    rid: str
    # return_logprob, logprob_start_len, top_logprobs_num, return_text_in_logprobs (only those set).
    logprobs: dict[str, Any] = field(default_factory=dict)
    # The conversation so far when this generation opens an assistant message (chat APIs send
    # these instead of ``text``); None otherwise.
    messages: list[dict[str, Any]] | None = None


@dataclass
class GenOutput:
    text: str
    # As the native /generate's: prompt_tokens, completion_tokens, cached_tokens, finish_reason...
    meta_info: dict[str, Any]


@dataclass
class ScoreRequest:
    """Scores ``prefix + choice`` for every choice: one batched request with input logprobs."""

    prefix: str
    choices: list[str]
    # Request id; abort() takes it and stops every request the scoring sent under it.
    rid: str
    # Also score each choice alone (the unconditional_likelihood_normalized method).
    unconditional: bool = False


@dataclass
class ScoreOutput:
    choices: list[ChoiceLogprobs]
    # What the backend reports (cached_tokens of the scoring prompts, prompt_tokens of the prefix...).
    meta_info: dict[str, Any] = field(default_factory=dict)


class Backend:
    """Base class of frontend-language backends (register a subclass under the entry-point group
    ``engine_lang.backends``)."""

    #: The name users see in errors and ``engine_lang.backends.list_backends()``.
    name = "backend"

    def generate(self, req: GenRequest) -> GenOutput:
        raise UnsupportedOperation(f"gen: the {self.name} backend does not generate")

    def generate_stream(self, req: GenRequest) -> Iterator[GenOutput]:
        """Cumulative outputs (each holds the whole text so far); the last one is final."""
        raise UnsupportedOperation(f"gen(stream=True): the {self.name} backend does not stream")

    def score(self, req: ScoreRequest) -> ScoreOutput:
        raise UnsupportedOperation(f"select: the {self.name} backend cannot score choices (it returns no "
                                   "input logprobs)")

    def cache_prefix(self, text: str, rid: str) -> dict[str, Any] | None:
        """Prefix hint: makes the server cache ``text`` before branches or a batch that share it.
        Returns the request's meta info, or None where the backend has no prefix cache to fill."""
        return None

    def chat_template(self) -> ChatTemplate:
        raise UnsupportedOperation(f"chat roles (system/user/assistant): the {self.name} backend has no chat "
                                   "template")

    def abort(self, rid: str) -> None:
        """Stops request ``rid`` if it still runs (no error when it already finished)."""

    def close(self) -> None:
        """Releases connections (and, for an owned engine, the engine)."""

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
