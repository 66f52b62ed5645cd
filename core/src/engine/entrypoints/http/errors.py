"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the server reports, whichever route and whatever went wrong, is
turned into this body so clients (the ``openai`` package included) can show the
message. Messages name the offending field and say what would be accepted.
"""

from __future__ import annotations

import json
import re
from http import HTTPStatus
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from engine.errors import did_you_mean
from engine.managers.tokenizer_manager import EngineDeadError, RequestError, ServerShuttingDownError

# OpenAI's error "type" for each status we send.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error to send as an HTTP response (raised anywhere inside a handler)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, extra: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        # Top-level keys beside "error" (an aborted native request's outputs, as SGLang clients read them).
        self.extra = extra or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code},
                **self.extra}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def engine_dead_error(exc: EngineDeadError | str) -> APIError:
    return APIError(500, f"the engine is not running: {exc}; the server is shutting down",
                    code="engine_dead")


def shutting_down_error(exc: ServerShuttingDownError | str) -> APIError:
    """The 503 of a server draining for shutdown (load balancers retry elsewhere)."""
    return APIError(503, str(exc), code="server_shutting_down")


def from_request_error(exc: RequestError, renames: dict[str, str] | None = None) -> APIError:
    """A tokenizer-manager validation error as a 400, with engine field names mapped to the API's."""
    renames = renames or {}
    message = str(exc)
    for engine_name, api_name in renames.items():
        message = re.sub(rf"\b{re.escape(engine_name)}\b", api_name, message)
    field = renames.get(exc.field, exc.field) if exc.field else None
    return APIError(400, message, param=field)


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """Validates a JSON body against ``model``; every problem is a 400 naming the field."""
    if not raw.strip():
        raise APIError(400, "the request body is empty; expected a JSON object", code="invalid_json")
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise from_validation_error(exc, model) from None


def from_validation_error(exc: ValidationError, model: type[BaseModel]) -> APIError:
    errors = exc.errors(include_url=False)
    first = errors[0]
    kind = first["type"]
    if kind == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON: {detail}", code="invalid_json")
    path = _path(first["loc"])
    if not path:
        return APIError(400, f"the request body must be a JSON object, got {_json_type(first.get('input'))}",
                        code="invalid_json")
    if kind == "extra_forbidden":
        leaf = str(first["loc"][-1])
        hint = did_you_mean(leaf, model.model_fields) if len(first["loc"]) == 1 else ""
        return APIError(400, f"{path}: unknown field '{leaf}'{hint}", param=path, code="unknown_field")
    if kind == "missing":
        return APIError(400, f"{path}: this field is required", param=path, code="missing_field")
    # A union field reports one error per member; say them all, once, at the field.
    same = [e for e in errors if _path(e["loc"]) == path]
    reasons = []
    for e in same:
        msg = _lower_first(e["msg"])
        if msg not in reasons:
            reasons.append(msg)
    value = json.dumps(first.get("input"))[:80] if _jsonable(first.get("input")) else "?"
    return APIError(400, f"{path}: invalid value {value} ({'; or '.join(reasons)})", param=path,
                    code="invalid_value")


def _path(loc: tuple[Any, ...]) -> str:
    """``('messages', 0, 'content', 'str')`` -> ``messages[0].content``.

    Pydantic inserts the union member it tried (``str``, ``list[int]``,
    ``function-after[...]``) into ``loc``; those are not fields and are dropped.
    """
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in _TYPE_TAGS:
            continue
        else:
            out += f".{part}" if out else part
    return out


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "null"}


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _json_type(value: Any) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return "null" if value is None else type(value).__name__


def install_error_handlers(app: Any) -> None:
    """Makes every error leave the server as an OpenAI error body."""

    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return exc.response()

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        status = exc.status_code
        if status == 404:
            message = f"no route {request.method} {request.url.path}; see /docs or docs/api.md"
        elif status == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail) or HTTPStatus(status).phrase
        return APIError(status, message).response(headers=getattr(exc, "headers", None))

    async def on_request_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestError)
        return from_request_error(exc).response()

    async def on_engine_dead(request: Request, exc: Exception) -> JSONResponse:
        return engine_dead_error(str(exc)).response()

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        # A bug, not the client's fault: answer 500 and keep serving (Starlette re-raises
        # the exception after this reply, so uvicorn logs its traceback).
        return APIError(500, f"internal server error: {type(exc).__name__}: {exc}").response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(RequestError, on_request_error)
    app.add_exception_handler(EngineDeadError, on_engine_dead)
    app.add_exception_handler(Exception, on_unexpected)
