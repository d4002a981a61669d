"""OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions, /v1/models.

The `model` field may name anything: the loaded model answers (IDEs and agents send their
own model names), as llama-server does.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from engine.server import parse
from engine.server.errors import ApiError, sse_error
from engine.server.generation import Generation, Outcome

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def sse(data: dict[str, Any], event: str | None = None) -> str:
    return (f"event: {event}\n" if event else "") + f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def is_done(event: Any) -> bool:
    return hasattr(event, "finish_reason")


def _unsupported(body: dict) -> None:
    if parse.field(body, "n", "int", 1) != 1:
        raise ApiError(400, "'n' must be 1: one sequence runs at a time", param="n", code="unsupported_value")
    if body.get("logprobs") not in (None, False):
        raise ApiError(400, "'logprobs' is not supported", param="logprobs", code="unsupported_parameter")


def chat_messages(body: dict) -> list[dict[str, str]]:
    messages = parse.field(body, "messages", "array", required=True)
    if not messages:
        raise ApiError(400, "'messages' must not be empty", param="messages")
    out = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}", param="messages")
        content = m.get("content")
        text = "" if content is None and role == "assistant" else parse.text_content(content, f"messages[{i}].content")
        out.append({"role": ROLES[role], "content": text})
    return out


def usage(d: Any) -> dict[str, Any]:
    """OpenAI usage from a DoneEvent; cached_tokens = prompt tokens whose KV the last request left."""
    return {"prompt_tokens": d.prompt_tokens, "completion_tokens": d.completion_tokens,
            "total_tokens": d.prompt_tokens + d.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": d.cached_tokens}}


def _finish(reason: str) -> str:
    return "length" if reason == "length" else "stop"


async def _start(http: HttpRequest, body: dict, **prompt: Any) -> tuple[Generation, bool, bool]:
    _unsupported(body)
    stream = parse.field(body, "stream", "bool", False)
    options = parse.field(body, "stream_options", "object", {})
    include_usage = parse.field(options, "include_usage", "bool", False)
    gen = await Generation.start(
        http.app.state.worker, max_tokens=parse.max_tokens(body, ("max_completion_tokens", "max_tokens")),
        sampling=parse.sampling(body, max_temperature=2.0), stops=parse.stops(body, "stop"), **prompt)
    return gen, stream, include_usage


async def chat_completions(http: HttpRequest) -> Response:
    body = await parse.read_json(http)
    gen, stream, include_usage = await _start(http, body, messages=chat_messages(body))
    head = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": http.app.state.model_id}
    if not stream:
        out: Outcome = await gen.collect(http)
        return JSONResponse({**head, "object": "chat.completion", "system_fingerprint": None, "choices": [
            {"index": 0, "message": {"role": "assistant", "content": out.text}, "logprobs": None,
             "finish_reason": _finish(out.done.finish_reason)}], "usage": usage(out.done)})
    await gen.wait_first(http)
    extra = {"usage": None} if include_usage else {}

    def chunk(delta: dict, finish: str | None = None) -> str:
        return sse({**head, "object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **extra})

    async def events():
        yield chunk({"role": "assistant", "content": ""})
        try:
            async for event in gen.events():
                if not is_done(event):
                    if event.text:
                        yield chunk({"content": event.text})
                    continue
                yield chunk({}, _finish(event.finish_reason))
                if include_usage:
                    yield sse({**head, "object": "chat.completion.chunk", "choices": [], "usage": usage(event)})
            yield "data: [DONE]\n\n"
        except ApiError as e:
            yield sse_error("openai", e)
    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


def _prompt(body: dict) -> str | list[int]:
    value = body.get("prompt")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    raise ApiError(400, "'prompt' must be a non-empty string or token array (one prompt per request)", param="prompt")


async def completions(http: HttpRequest) -> Response:
    body = await parse.read_json(http)
    if body.get("echo") or body.get("suffix"):
        raise ApiError(400, "'echo' and 'suffix' are not supported", code="unsupported_parameter")
    gen, stream, include_usage = await _start(http, body, prompt=_prompt(body), param="prompt")
    head = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
            "model": http.app.state.model_id}
    if not stream:
        out = await gen.collect(http)
        return JSONResponse({**head, "choices": [{"index": 0, "text": out.text, "logprobs": None,
                                                  "finish_reason": _finish(out.done.finish_reason)}],
                             "usage": usage(out.done)})
    await gen.wait_first(http)

    async def events():
        try:
            async for event in gen.events():
                text, finish = ("", _finish(event.finish_reason)) if is_done(event) else (event.text, None)
                if text or finish:
                    yield sse({**head, "choices": [{"index": 0, "text": text, "logprobs": None,
                                                    "finish_reason": finish}]})
                if finish and include_usage:
                    yield sse({**head, "choices": [], "usage": usage(event)})
            yield "data: [DONE]\n\n"
        except ApiError as e:
            yield sse_error("openai", e)
    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


async def models(http: HttpRequest) -> Response:
    state = http.app.state
    if "anthropic-version" in http.headers:  # Anthropic's client lists models in its own shape
        created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(state.model_created))
        item = {"type": "model", "id": state.model_id, "display_name": state.model_id, "created_at": created}
        return JSONResponse({"data": [item], "has_more": False, "first_id": state.model_id, "last_id": state.model_id})
    return JSONResponse({"object": "list", "data": [
        {"id": state.model_id, "object": "model", "created": state.model_created, "owned_by": "moestudio"}]})
