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

from engine.errors import UserError
from engine.server import parse
from engine.server.errors import ApiError, sse_error
from engine.server.generation import Generation, Outcome, ready_engine
from engine.server.tool_formats import Reply
from engine.server.tools import ReplyFilter, call_grammar, for_model, openai_tool_use, output_grammar, reading

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def sse(data: dict[str, Any], event: str | None = None) -> str:
    return (f"event: {event}\n" if event else "") + f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def is_done(event: Any) -> bool:
    return hasattr(event, "finish_reason")


MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for the legacy completions API


def _unsupported(body: dict) -> None:
    if parse.field(body, "n", "int", 1) != 1:
        raise ApiError(400, "'n' must be 1: one sequence runs at a time", param="n", code="unsupported_value")


def chat_logprobs(body: dict) -> int | None:
    """Chat's `logprobs` (bool) and `top_logprobs` (0-20, only with logprobs) as OpenAI checks them."""
    wanted = parse.field(body, "logprobs", "bool", False)
    top = parse.field(body, "top_logprobs", "int")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"'top_logprobs' must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {top}",
                       param="top_logprobs", code="invalid_value")
    if top is not None and not wanted:
        raise ApiError(400, "'top_logprobs' needs 'logprobs' set to true", param="top_logprobs",
                       code="invalid_value")
    return (top or 0) if wanted else None


def completion_logprobs(body: dict) -> int | None:
    """The completions API's `logprobs`: how many alternatives per token (0-5), or absent."""
    n = parse.field(body, "logprobs", "int")
    if n is not None and not 0 <= n <= MAX_COMPLETION_LOGPROBS:
        raise ApiError(400, f"'logprobs' must be an integer from 0 to {MAX_COMPLETION_LOGPROBS}, got {n}",
                       param="logprobs", code="invalid_value")
    return n


def response_grammar(body: dict, tokenizer: Any = None) -> str | None:
    """`response_format`: text (free), json_object (any JSON object) or json_schema (its schema,
    enforced by constrained decoding whether or not `strict` is set). With the `tokenizer` of a chat
    request, the document is written in the model's format (tools.output_grammar)."""
    from engine.layers.grammar import json_schema_grammar

    fmt = parse.field(body, "response_format", "object")
    kind = None if fmt is None else fmt.get("type")
    if fmt is None or kind == "text":
        return None

    def grammar(schema: dict | bool) -> str:
        return json_schema_grammar(schema) if tokenizer is None else output_grammar(schema, tokenizer)
    try:
        if kind == "json_object":
            return grammar({"type": "object"})
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict):
                raise ApiError(400, "'response_format.json_schema' is required with type json_schema: "
                               "{\"name\": ..., \"schema\": {...}}", param="response_format", code="invalid_value")
            schema = spec.get("schema", {})
            if not isinstance(schema, (dict, bool)):
                raise ApiError(400, "'response_format.json_schema.schema' must be a JSON schema object",
                               param="response_format", code="invalid_value")
            return grammar(schema)
    except UserError as e:
        raise ApiError(400, str(e), param="response_format", code="invalid_value") from None
    raise ApiError(400, f"'response_format.type' must be text, json_object or json_schema, got {kind!r}",
                   param="response_format", code="invalid_value")


def _token_entry(tokenizer: Any, token: int, logprob: float) -> dict[str, Any]:
    piece = tokenizer.piece(token)
    return {"token": piece.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(piece)}


def chat_logprob_content(tokenizer: Any, events: list[Any]) -> dict[str, Any] | None:
    """Chat's `logprobs` object for these token events, or None when none carries log-probabilities."""
    content = [{**_token_entry(tokenizer, e.token, e.logprob),
                "top_logprobs": [_token_entry(tokenizer, t, lp) for t, lp in e.top_logprobs]}
               for e in events if e.token is not None and e.logprob is not None]
    return {"content": content, "refusal": None} if content else None


def completion_logprob_content(tokenizer: Any, events: list[Any], offset: int) -> dict[str, Any] | None:
    """The completions API's `logprobs` object (tokens, token_logprobs, top_logprobs, text_offset);
    `offset`: the text length before these events."""
    events = [e for e in events if e.token is not None and e.logprob is not None]
    if not events:
        return None
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in events:
        text = tokenizer.piece(e.token).decode("utf-8", errors="replace")
        out["tokens"].append(text)
        out["token_logprobs"].append(e.logprob)
        alternatives: dict[str, float] = {}
        for t, lp in e.top_logprobs:
            alternatives.setdefault(tokenizer.piece(t).decode("utf-8", errors="replace"), lp)
        out["top_logprobs"].append(alternatives)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def _assistant_calls(calls: Any, i: int) -> list[dict]:
    """An assistant message's tool_calls, checked: {"id", "type": "function", "function": {"name", "arguments"}}."""
    if not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
            and isinstance(c["function"].get("arguments"), (str, dict)) for c in calls):
        raise ApiError(400, f"messages[{i}].tool_calls must be an array of {{\"id\", \"type\": \"function\", "
                       "\"function\": {\"name\", \"arguments\"}}", param="messages")
    return [{"id": c.get("id", ""), "type": "function", "function": dict(c["function"])} for c in calls]


def chat_messages(body: dict) -> list[dict[str, Any]]:
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
        message: dict[str, Any] = {"role": ROLES[role], "content": text}
        if role == "assistant" and m.get("tool_calls"):
            message["tool_calls"] = _assistant_calls(m["tool_calls"], i)
        if role == "tool":
            message["tool_call_id"] = m.get("tool_call_id", "")
        out.append(message)
    return out


def usage(d: Any) -> dict[str, Any]:
    """OpenAI usage from a DoneEvent; cached_tokens = prompt tokens whose KV the last request left."""
    return {"prompt_tokens": d.prompt_tokens, "completion_tokens": d.completion_tokens,
            "total_tokens": d.prompt_tokens + d.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": d.cached_tokens}}


def _finish(reason: str) -> str:
    return "length" if reason == "length" else "stop"


async def _start(http: HttpRequest, body: dict, grammar: str | None = None, tokenizer: Any = None, **request: Any
                 ) -> tuple[Generation, bool, bool]:
    """`grammar`: a forced tool call's, which a response_format may not also constrain; `tokenizer`: a
    chat request's (its response_format is written in the model's format)."""
    _unsupported(body)
    response = response_grammar(body, tokenizer)
    if grammar is not None and response is not None:
        raise ApiError(400, "a forced tool call ('tool_choice' required or a function) and a JSON 'response_format' "
                       "cannot both constrain one reply", param="tool_choice", code="invalid_value")
    stream = parse.field(body, "stream", "bool", False)
    options = parse.field(body, "stream_options", "object", {})
    include_usage = parse.field(options, "include_usage", "bool", False)
    gen = await Generation.start(
        http.app.state.worker, max_tokens=parse.max_tokens(body, ("max_completion_tokens", "max_tokens")),
        sampling=parse.sampling(body, max_temperature=2.0), stops=parse.stops(body, "stop"),
        grammar=grammar or response, **request)
    return gen, stream, include_usage


async def chat_completions(http: HttpRequest) -> Response:
    body = await parse.read_json(http)
    messages, use = chat_messages(body), openai_tool_use(body)
    grammar = None
    tokenizer = ready_engine(http.app.state.worker).tokenizer
    if use is not None:
        use = for_model(use, tokenizer)
        grammar = call_grammar(use, tokenizer) if use.forced else None
    read = reading(tokenizer, use)
    gen, stream, include_usage = await _start(
        http, body, grammar, tokenizer, messages=messages, logprobs=chat_logprobs(body),
        tools=None if use is None else [t.for_template() for t in use.tools], special_tokens=read is not None)
    head = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": http.app.state.model_id}
    if not stream:
        out: Outcome = await gen.collect(http)
        reply = read.parse(out.text) if read is not None else Reply(out.text, [])
        text, calls = reply.content, reply.calls
        message: dict[str, Any] = {"role": "assistant", "content": text or None if calls else text}
        if reply.reasoning:  # as llama-server and other OpenAI-compatible servers return reasoning
            message["reasoning_content"] = reply.reasoning
        if calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}} for c in calls]
        return JSONResponse({**head, "object": "chat.completion", "system_fingerprint": None, "choices": [
            {"index": 0, "message": message, "logprobs": chat_logprob_content(tokenizer, out.tokens),
             "finish_reason": "tool_calls" if calls else _finish(out.done.finish_reason)}], "usage": usage(out.done)})
    await gen.wait_first(http)
    extra = {"usage": None} if include_usage else {}
    reply_filter = ReplyFilter(read) if read is not None else None

    def chunk(delta: dict, finish: str | None = None, logprobs: dict | None = None) -> str:
        return sse({**head, "object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}], **extra})

    async def events():
        yield chunk({"role": "assistant", "content": ""})
        try:
            async for event in gen.events():
                if not is_done(event):
                    logprobs = chat_logprob_content(tokenizer, [event])
                    text, reasoning = reply_filter.feed(event.text) if reply_filter else (event.text, "")
                    if text or reasoning or logprobs:
                        yield chunk(_delta(text, reasoning), logprobs=logprobs)
                    continue
                tail = reply_filter.finish() if reply_filter else Reply("", [])
                calls = tail.calls
                if tail.content or tail.reasoning:
                    yield chunk(_delta(tail.content, tail.reasoning))
                for i, c in enumerate(calls):  # the name first, then the arguments, as OpenAI streams them
                    yield chunk({"tool_calls": [{"index": i, "id": c.id, "type": "function",
                                                 "function": {"name": c.name, "arguments": ""}}]})
                    yield chunk({"tool_calls": [{"index": i, "function": {
                        "arguments": json.dumps(c.arguments, ensure_ascii=False)}}]})
                yield chunk({}, "tool_calls" if calls else _finish(event.finish_reason))
                if include_usage:
                    yield sse({**head, "object": "chat.completion.chunk", "choices": [], "usage": usage(event)})
            yield "data: [DONE]\n\n"
        except ApiError as e:
            yield sse_error("openai", e)
    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


def _delta(content: str, reasoning: str) -> dict[str, str]:
    """A chunk's delta: the content, and the reasoning (as `reasoning_content`) when there is some."""
    return {"reasoning_content": reasoning, **({"content": content} if content else {})} if reasoning else {
        "content": content}


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
    gen, stream, include_usage = await _start(http, body, prompt=_prompt(body), param="prompt",
                                              logprobs=completion_logprobs(body))
    head = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
            "model": http.app.state.model_id}
    tokenizer = http.app.state.worker.engine.tokenizer
    if not stream:
        out = await gen.collect(http)
        return JSONResponse({**head, "choices": [{"index": 0, "text": out.text,
                                                  "logprobs": completion_logprob_content(tokenizer, out.tokens, 0),
                                                  "finish_reason": _finish(out.done.finish_reason)}],
                             "usage": usage(out.done)})
    await gen.wait_first(http)

    async def events():
        offset = 0
        try:
            async for event in gen.events():
                text, finish = ("", _finish(event.finish_reason)) if is_done(event) else (event.text, None)
                logprobs = None if finish else completion_logprob_content(tokenizer, [event], offset)
                if text or finish or logprobs:
                    yield sse({**head, "choices": [{"index": 0, "text": text, "logprobs": logprobs,
                                                    "finish_reason": finish}]})
                offset += len(text)
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
