"""Errors as each API shapes them, so that every official client raises its own exception type.

OpenAI:    {"error": {"message", "type", "param", "code"}}
Anthropic: {"type": "error", "error": {"type", "message"}}
Ollama:    {"error": "message"}
"""
from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse

# HTTP status -> Anthropic error type (docs.anthropic.com "Errors").
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    422: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error"}
# HTTP status -> OpenAI error type.
_OPENAI_TYPES = {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error",
                 503: "server_unavailable"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def openai_body(err: ApiError) -> dict[str, Any]:
    kind = _OPENAI_TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "server_error")
    return {"error": {"message": err.message, "type": kind, "param": err.param, "code": err.code}}


def anthropic_body(err: ApiError) -> dict[str, Any]:
    kind = _ANTHROPIC_TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def ollama_body(err: ApiError) -> dict[str, Any]:
    return {"error": err.message}


def api_of(path: str) -> str:
    """Which API's error shape a path answers in."""
    if path.startswith("/api/"):
        return "ollama"
    return "anthropic" if path.startswith("/v1/messages") else "openai"


def _body(api: str, err: ApiError) -> dict[str, Any]:
    return {"anthropic": anthropic_body, "ollama": ollama_body}.get(api, openai_body)(err)


def error_response(api: str, err: ApiError) -> JSONResponse:
    body = _body(api, err)
    headers = {"www-authenticate": "Bearer"} if err.status == 401 else None
    return JSONResponse(body, status_code=err.status, headers=headers)


def sse_error(api: str, err: ApiError) -> str:
    """An error after a stream has started (the status line is already sent); Ollama's streams are NDJSON."""
    if api == "anthropic":
        return f"event: error\ndata: {json.dumps(anthropic_body(err))}\n\n"
    if api == "ollama":
        return json.dumps(ollama_body(err)) + "\n"
    return f"data: {json.dumps(openai_body(err))}\n\n"
