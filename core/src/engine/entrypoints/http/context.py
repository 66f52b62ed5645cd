"""What every HTTP handler needs: the tokenizer manager, the tokenizer and the model's names."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.entrypoints.http.errors import APIError, engine_dead_error, shutting_down_error
from engine.managers.tokenizer_pool import TextTooLongError

if TYPE_CHECKING:
    from engine.config import ServerArgs
    from engine.entrypoints.http.live_view import LiveView
    from engine.entrypoints.http.tool_calling import ToolPlan
    from engine.managers.io_struct import SchedulerReady
    from engine.managers.tokenizer_manager import TokenizerManager
    from engine.metrics import ServerMetrics
    from engine.parsers import ReasoningParser, ToolCallParser

# The name the embedded default model is served under (its cache directory name is an artefact).
DEFAULT_MODEL_NAME = "default"


def served_model_name(args: ServerArgs, model_path: str) -> str:
    """``--served-model-name``, else the name of what ``--model-path`` names (the directory, or the
    GGUF file, not its cache directory), ``default`` for the embedded model."""
    if args.served_model_name:
        return args.served_model_name
    if not args.model_path:
        return DEFAULT_MODEL_NAME
    return os.path.basename(os.path.normpath(args.model_path)) or model_path


@dataclass
class ServingContext:
    args: ServerArgs
    manager: TokenizerManager
    ready: SchedulerReady
    model_path: str
    # The name clients put in ``model``; responses echo it.
    model_name: str
    # None with --skip-tokenizer-init: only token-id prompts work then.
    tokenizer: Any | None
    metrics: ServerMetrics | None = None
    # The live view's memory (/dashboard); None with --disable-dashboard.
    live_view: LiveView | None = None
    # Unix time the model was loaded (``created`` of /v1/models).
    created: int = field(default_factory=lambda: int(time.time()))
    # Memo of single-token texts for logprob outputs (decoding is the costly part).
    _token_texts: dict[int, str] = field(default_factory=dict)
    # --tool-call-parser / --reasoning-parser, built once (parsers are stateless); None when unset.
    tool_parser: ToolCallParser | None = field(init=False, default=None)
    reasoning_parser: ReasoningParser | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        import engine.plugins as plugins

        args = self.args
        if args.tool_call_parser:
            self.tool_parser = plugins.create_tool_call_parser(args.tool_call_parser, args.disable_plugin,
                                                               args.plugin_options)
        if args.reasoning_parser:
            self.reasoning_parser = plugins.create_reasoning_parser(args.reasoning_parser, args.disable_plugin,
                                                                    args.plugin_options)

    @property
    def context_len(self) -> int:
        return self.ready.context_len

    def check_model(self, name: str | None) -> None:
        """404 unless ``name`` is this server's model (its served name or its path); None means it."""
        if name is None or name in (self.model_name, self.model_path, self.args.model_path):
            return
        raise APIError(404, f"model '{name}' does not exist; this server serves '{self.model_name}'",
                       param="model", code="model_not_found")

    def resolve_model(self, name: str | None) -> str | None:
        """The LoRA adapter a generation request's ``model`` selects: an adapter's name, or
        ``BASE:NAME`` (SGLang's form); None for the base model. 404 for anything else."""
        if name is None or name in (self.model_name, self.model_path, self.args.model_path):
            return None
        if not self.args.lora_enabled:
            self.check_model(name)
        adapters = self.manager.lora.adapters
        if name in adapters:
            return name
        for i, char in enumerate(name):  # the base model's own name may hold a colon too
            if char == ":" and name[:i] in (self.model_name, self.model_path) and name[i + 1:] in adapters:
                return name[i + 1:]
        names = ", ".join(f"'{a}'" for a in sorted(adapters))
        also = f" and the LoRA adapters {names}" if names else " (no LoRA adapter is loaded now)"
        raise APIError(404, f"model '{name}' does not exist; this server serves '{self.model_name}'{also}",
                       param="model", code="model_not_found")

    def check_alive(self) -> None:
        if self.manager.dead is not None:
            raise engine_dead_error(self.manager.dead)

    def check_accepting(self) -> None:
        """Alive, and the request arrived before a shutdown's drain began (503 otherwise: load
        balancers retry elsewhere)."""
        self.check_alive()
        if self.manager.refuses_new():
            raise shutting_down_error("the server is shutting down and accepts no new requests; "
                                      "retry on another replica")

    async def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, tokenized off the event loop; over-long texts are a 400."""
        self.require_tokenizer(param)
        try:
            return await self.manager.pool.encode(text, add_special_tokens)
        except TextTooLongError as exc:
            raise APIError(400, f"{param}: {exc}", param=param, code="context_length_exceeded") from None

    def require_tokenizer(self, param: str) -> Any:
        if self.tokenizer is None:
            raise APIError(400, f"{param}: this server runs with --skip-tokenizer-init and cannot "
                                "handle text; send token ids", param=param)
        return self.tokenizer

    def check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.ready.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"{param}: token id {bad} is outside the vocabulary (0..{vocab - 1})", param=param)

    def token_text(self, token_id: int) -> str:
        """The text of one token (empty without a tokenizer)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""
            if len(self._token_texts) < 1 << 20:
                self._token_texts[token_id] = text
        return text

    async def render_chat(self, messages: list[Any], add_generation_prompt: bool = True,
                          template_kwargs: dict[str, Any] | None = None, tools: ToolPlan | None = None,
                          mm_items: list[Any] | None = None) -> list[int]:
        """Token ids of ``messages`` under the tokenizer's chat template (rendered and tokenized
        off the event loop); ``tools`` (a chat request's validated tool fields) are rendered
        through the template, or into the system prompt where the template ignores them."""
        from engine.entrypoints.http.tool_calling import ToolPlan, template_messages

        tokenizer = self.require_tokenizer("messages")
        # Image and video parts are taken where the caller collects the items (``mm_items``).
        media: list[Any] | None = [] if mm_items is not None else None
        conversation = [chat_message_dict(m, i, media) for i, m in enumerate(messages)]
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(400, f"messages: model '{self.model_name}' has no chat template; "
                                "use /v1/completions with a prompt", param="messages")
        conversation, tool_kwargs = template_messages(conversation, tools or ToolPlan(), tokenizer, self.tool_parser)
        template_kwargs = {**(template_kwargs or {}), **tool_kwargs}
        if media:
            assert mm_items is not None
            ids, items = await self.manager.render_chat_media(conversation, media, add_generation_prompt,
                                                              template_kwargs, tokenizer)
            mm_items.extend(items)
            return ids
        try:
            return await self.manager.pool.render_chat(conversation, add_generation_prompt, template_kwargs)
        except TextTooLongError as exc:
            raise APIError(400, f"messages: {exc}", param="messages", code="context_length_exceeded") from None
        except Exception as exc:  # jinja raise_exception(): the template's own rule, e.g. role order
            raise APIError(400, f"messages: the chat template rejected the conversation: {exc}",
                           param="messages") from None


def chat_message_dict(message: Any, index: int, media: list[Any] | None = None) -> dict[str, Any]:
    """One pydantic ChatMessage as the plain dict chat templates expect: text content, an
    assistant's ``tool_calls`` with their arguments decoded (templates write them as JSON), a
    tool message's ``tool_call_id``. With ``media`` (a list), image and video parts are accepted:
    the content stays a list of parts and their sources are appended to ``media``."""
    from engine.entrypoints.http.media_parts import is_media_part, media_part

    where = f"messages[{index}]"
    content = message.content
    if isinstance(content, list):
        texts, parts = [], []
        for j, part in enumerate(content):
            if media is not None and is_media_part(part.type):
                parts.append(media_part(part, f"{where}.content[{j}]", media))
                continue
            if part.type != "text" or part.text is None:
                accepted = "text, image_url and video_url parts" if media is not None else "only text parts"
                raise APIError(400, f"{where}.content[{j}].type: '{part.type}' parts are not supported here; "
                                    f"accepted: {accepted}", param=f"{where}.content[{j}].type")
            texts.append(part.text)
            parts.append({"type": "text", "text": part.text})
        content = parts if len(parts) > len(texts) else "\n".join(texts)
    out: dict[str, Any] = {"role": message.role, "content": content or ""}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        if message.role != "assistant":
            raise APIError(400, f"{where}.tool_calls: only assistant messages carry tool calls",
                           param=f"{where}.tool_calls")
        out["tool_calls"] = [_template_call(call, f"{where}.tool_calls[{j}]") for j, call in enumerate(message.tool_calls)]
    extra = message.model_extra or {}
    if message.role == "tool" and isinstance(extra.get("tool_call_id"), str):
        out["tool_call_id"] = extra["tool_call_id"]
    return out


def _template_call(call: dict[str, Any], where: str) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError(400, f"{where}.function.name: required, a string", param=f"{where}.function.name")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except ValueError:
            raise APIError(400, f"{where}.function.arguments: not valid JSON", param=f"{where}.function.arguments") from None
    out = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out
