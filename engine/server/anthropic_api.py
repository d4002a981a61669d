"""Anthropic-compatible POST /v1/messages (text content; streaming with the documented event order)
and POST /v1/messages/count_tokens.

Stream: message_start, content_block_start, ping, content_block_delta (text_delta)...,
content_block_stop, message_delta (stop_reason, usage.output_tokens), message_stop.

A last message from the assistant is a prefill: the reply continues it (engine/runtime/tokenizer.py).
Content is validated as Anthropic does: every message but a final assistant one needs non-empty
content, text blocks are non-empty, and a prefill must not end in whitespace.
"""
from __future__ import annotations

import uuid
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from engine.server import parse
from engine.server.errors import ApiError, sse_error
from engine.server.generation import Generation
from engine.server.openai_api import SSE_HEADERS, is_done, sse


def _system(body: dict) -> str | None:
    system = body.get("system")
    return None if system is None else parse.text_content(system, "system")


def _messages(body: dict) -> list[dict[str, str]]:
    messages = parse.field(body, "messages", "array", required=True)
    if not messages:
        raise ApiError(400, "messages: at least one message is required")
    out = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise ApiError(400, f"messages.{i}.role: must be 'user' or 'assistant', got {role!r}")
        content = m.get("content")
        if isinstance(content, list) and any(isinstance(b, dict) and b.get("text") == "" for b in content):
            raise ApiError(400, f"messages.{i}.content: text content blocks must be non-empty")
        text = parse.text_content(content, f"messages.{i}.content")
        prefill = role == "assistant" and i == len(messages) - 1
        if content in ("", []) and not prefill:
            raise ApiError(400, f"messages.{i}: all messages must have non-empty content except for the optional "
                           "final assistant message")
        if prefill and text != text.rstrip():
            raise ApiError(400, f"messages.{i}: final assistant content cannot end with trailing whitespace")
        out.append({"role": role, "content": text})
    return out


def _chat(body: dict) -> list[dict[str, str]]:
    """The messages with the system prompt first, as the model's template takes them."""
    if body.get("tools"):
        raise ApiError(400, "tools: not supported yet: this server does not do tool calling")
    chat = _messages(body)
    system = _system(body)
    if system:
        chat.insert(0, {"role": "system", "content": system})
    return chat


def _stop_reason(reason: str, stop_sequence: str | None) -> str:
    if stop_sequence is not None:
        return "stop_sequence"
    return "max_tokens" if reason == "length" else "end_turn"


async def messages(http: HttpRequest) -> Response:
    body = await parse.read_json(http)
    chat = _chat(body)
    stream = parse.field(body, "stream", "bool", False)
    gen = await Generation.start(http.app.state.worker, messages=chat,
                                 max_tokens=parse.max_tokens(body, ("max_tokens",), required=True),
                                 sampling=parse.sampling(body, max_temperature=1.0),
                                 stops=parse.stops(body, "stop_sequences"))
    message: dict[str, Any] = {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
                               "model": http.app.state.model_id}
    if not stream:
        out = await gen.collect(http)
        d = out.done
        return JSONResponse({**message, "content": [{"type": "text", "text": out.text}],
                             "stop_reason": _stop_reason(d.finish_reason, out.stop_sequence),
                             "stop_sequence": out.stop_sequence,
                             "usage": {"input_tokens": d.prompt_tokens, "output_tokens": d.completion_tokens,
                                       "cache_read_input_tokens": d.cached_tokens}})
    await gen.wait_first(http)

    async def events():
        yield sse({"type": "message_start", "message": {
            **message, "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": gen.prompt_tokens, "output_tokens": 0}}}, "message_start")
        yield sse({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                  "content_block_start")
        yield sse({"type": "ping"}, "ping")
        try:
            async for event in gen.events():
                if not is_done(event):
                    if event.text:
                        yield sse({"type": "content_block_delta", "index": 0,
                                   "delta": {"type": "text_delta", "text": event.text}}, "content_block_delta")
                    continue
                stop = gen.stop_sequence(event)
                yield sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
                yield sse({"type": "message_delta",
                           "delta": {"stop_reason": _stop_reason(event.finish_reason, stop), "stop_sequence": stop},
                           "usage": {"output_tokens": event.completion_tokens}}, "message_delta")
                yield sse({"type": "message_stop"}, "message_stop")
        except ApiError as e:
            yield sse_error("anthropic", e)
    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


async def count_tokens(http: HttpRequest) -> Response:
    """The prompt tokens /v1/messages would run for the same body (the model's template included)."""
    body = await parse.read_json(http)
    return JSONResponse({"input_tokens": await Generation.count(http.app.state.worker, messages=_chat(body))})
