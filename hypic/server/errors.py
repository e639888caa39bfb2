"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every refusal goes through ``APIError`` so that clients (the ``openai`` package included) get a
status they can act on and the field that was wrong; ``kind`` is what /metrics counts errors by.
Anything unexpected is a 500 that is logged, counted and never takes the server down.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("hypic.server")

_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*): (.*)$", re.S)
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|[A-Z].*|.*[\[\-].*)$")  # union-member tags in pydantic locs


# fields other servers (vLLM, OpenAI) take and hypic does not: refused in words, not as a typo
NOT_SERVED = {
    "spaces_between_special_tokens": "special tokens are decoded as the tokenizer joins them",
    "guided_decoding_backend": "use response_format",
    "guided_whitespace_pattern": "use response_format", "functions": "the legacy functions; send tools",
    "function_call": "the legacy function_call; send tool_choice", "documents": "send documents as messages",
    "chat_template": "the server uses the model's template", "mm_processor_kwargs": "hypic reads text only",
    "kv_transfer_params": "hypic has no disaggregated prefill", "vllm_xargs": "no vLLM plugin arguments",
}


MAX_MESSAGE, MAX_PARAM = 2000, 200  # characters of an error's message and param: see ``clipped``


def clipped(text: str, limit: int) -> str:
    """``text`` cut to about ``limit`` characters, saying how much was left out. A message quotes
    what was wrong, and that may be a 30 MB model name or a 4 MB metadata key: a refusal is no
    reason to send the input back whole."""
    if len(text) <= limit:
        return text
    head = text[:limit]
    return f"{head}… ({len(text) - limit} characters more)"


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, kind: str = "invalid_request",
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        message = clipped(message, MAX_MESSAGE)
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.param = None if param is None else clipped(param, MAX_PARAM)
        self.type, self.code, self.headers = type, code, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def from_value_error(e: ValueError, default_param: str | None) -> APIError:
    """``ValueError("field: why")`` (how hypic's validators speak) → a 400 naming the field."""
    m = _FIELD.match(str(e))
    return bad_request(str(e), m.group(1) if m else default_param)


def loc_to_param(loc: tuple) -> str | None:
    """pydantic's ("messages", 0, "content") → "messages[0].content"."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _TYPE_TAG.match(str(part)):
            out += ("." if out else "") + str(part)
    return out or None


def from_validation_error(e: ValidationError) -> APIError:
    """The deepest problem pydantic found (in a union, the member the input came closest to: one
    whose type it has); at equal depth a wrong value, then a wrong type, then an unknown field (a typo
    usually explains a missing one)."""
    rank = {"missing": 0, "extra_forbidden": 1}

    def weight(err: dict) -> int:
        return rank.get(err["type"], 2 if err["type"].endswith("_type") else 3)

    first = max(e.errors(include_url=False), key=lambda err: (len(err["loc"]), weight(err)))
    param = loc_to_param(tuple(first["loc"]))
    message = first["msg"]
    if first["type"] == "value_error":  # our own validators: "field: why" names the field itself
        message = str(first.get("ctx", {}).get("error", message))
        m = _FIELD.match(message)
        if m and param is None:
            return bad_request(message, m.group(1))
        if m and not param.endswith(m.group(1)):  # a nested object's own check names its field:
            param = f"{param}.{m.group(1)}"        # messages[0] + "content: …" → messages[0].content
            return bad_request(f"{param}: {m.group(2)}", param)
    elif first["type"] == "extra_forbidden":
        why = NOT_SERVED.get(str(first["loc"][-1])) if first["loc"] else None
        message = "unrecognized field" if why is None else f"not supported: {why}"
    elif first["type"] == "missing":
        message = "required field is missing"
    elif first["type"] == "model_type":
        message = "expected a JSON object"
    return bad_request(f"{param}: {message}" if param else message, param)


def install_handlers(app: FastAPI, count_error: Callable[[str], None]) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        count_error(e.kind)
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
        count_error("invalid_request")
        errs = e.errors()
        param = loc_to_param(tuple(errs[0]["loc"])[1:]) if errs else None
        return bad_request(str(errs[0]["msg"]) if errs else "invalid request", param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found" if e.status_code == 404 else "invalid_request"
        count_error(kind)
        detail = str(e.detail)
        if detail == "Not Found":  # no such route: say which was asked
            detail = f"{request.method} {request.url.path}: no such route here"
        elif detail == "Method Not Allowed":
            detail = f"{request.method} {request.url.path}: the route takes other methods"
        return APIError(e.status_code, detail, kind=kind, type="invalid_request_error",
                        headers=getattr(e, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        count_error("internal")
        return APIError(500, "internal server error", kind="internal", type="server_error").response()
