"""Anthropic-compatible POST /v1/messages (text and tool blocks; streaming with the documented
event order) and POST /v1/messages/count_tokens.

Stream: message_start, content_block_start (text), ping, content_block_delta (text_delta)...,
content_block_stop, then each tool_use block (content_block_start, one input_json_delta,
content_block_stop), message_delta (stop_reason, usage.output_tokens), message_stop. When the reply is
read in its model's format (tools, or gpt-oss) each block opens with its first text, after the ping.
Tools: engine/server/tools.py. A model's reasoning (gpt-oss's analysis channel) comes as `thinking`
blocks (thinking_delta) before the text when the request enables `thinking`; otherwise it is left out.

A last message from the assistant is a prefill: the reply continues it (engine/runtime/tokenizer.py).
Content is validated as Anthropic does: every message but a final assistant one needs non-empty
content, text blocks are non-empty, and a prefill must not end in whitespace.
"""
from __future__ import annotations

import json
import uuid
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from engine.errors import UserError
from engine.server import parse
from engine.server.errors import ApiError, sse_error
from engine.server.generation import Generation, ready_engine
from engine.server.tools import (Reply, ReplyFilter, ToolCall, ToolUse, anthropic_tool_use, call_grammar, for_model,
                                 output_grammar, reading)
from engine.server.openai_api import SSE_HEADERS, is_done, sse


def _system(body: dict) -> str | None:
    system = body.get("system")
    return None if system is None else parse.text_content(system, "system")


def _tool_blocks(content: Any, role: str, i: int) -> tuple[Any, list[dict], list[dict]]:
    """Splits tool_use (assistant) and tool_result (user) blocks from the text: (text content, calls, results)."""
    if not isinstance(content, list):
        return content, [], []
    kinds = {"assistant": "tool_use", "user": "tool_result"}
    text, calls, results = [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == kinds[role] == "tool_use":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input"), dict):
                raise ApiError(400, f"messages.{i}.content.{j}: a tool_use block needs 'name' and an object 'input'")
            calls.append({"id": block.get("id", ""), "type": "function",
                          "function": {"name": block["name"], "arguments": block["input"]}})
        elif kind == kinds[role] == "tool_result":
            result = block.get("content", "")
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id", ""),
                            "content": parse.text_content(result, f"messages.{i}.content.{j}.content")})
        else:
            text.append(block)
    return text, calls, results


def _messages(body: dict) -> list[dict[str, Any]]:
    messages = parse.field(body, "messages", "array", required=True)
    if not messages:
        raise ApiError(400, "messages: at least one message is required")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise ApiError(400, f"messages.{i}.role: must be 'user' or 'assistant', got {role!r}")
        content = m.get("content")
        if isinstance(content, list) and any(isinstance(b, dict) and b.get("text") == "" for b in content):
            raise ApiError(400, f"messages.{i}.content: text content blocks must be non-empty")
        prefill = role == "assistant" and i == len(messages) - 1
        if content in ("", []) and not prefill:
            raise ApiError(400, f"messages.{i}: all messages must have non-empty content except for the optional "
                           "final assistant message")
        content, calls, results = _tool_blocks(content, role, i)
        text = parse.text_content(content, f"messages.{i}.content")
        if prefill and text != text.rstrip():
            raise ApiError(400, f"messages.{i}: final assistant content cannot end with trailing whitespace")
        out.extend(results)  # a user turn's tool results come first, as the calls they answer were last
        if text or not results:
            out.append({"role": role, "content": text, **({"tool_calls": calls} if calls else {})})
        elif calls:
            out.append({"role": role, "content": "", "tool_calls": calls})
    return out


def _chat(body: dict) -> list[dict[str, Any]]:
    """The messages with the system prompt first, as the model's template takes them."""
    chat = _messages(body)
    system = _system(body)
    if system:
        chat.insert(0, {"role": "system", "content": system})
    return chat


def _stop_reason(reason: str, stop_sequence: str | None) -> str:
    if stop_sequence is not None:
        return "stop_sequence"
    return "max_tokens" if reason == "length" else "end_turn"


def _tools(http: HttpRequest, body: dict) -> tuple[ToolUse | None, str | None]:
    """The request's tools, checked against the model's template, and a forced call's grammar."""
    use = anthropic_tool_use(body)
    if use is None:
        return None, None
    tokenizer = ready_engine(http.app.state.worker).tokenizer
    use = for_model(use, tokenizer)
    return use, call_grammar(use, tokenizer) if use.forced else None


def _tool_use_block(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": call.arguments}


def _thinking(body: dict) -> bool:
    """Whether the request asks for the model's reasoning (`thinking` enabled or adaptive)."""
    thinking = parse.field(body, "thinking", "object")
    if thinking is None:
        return False
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise ApiError(400, f"thinking.type: must be 'enabled', 'disabled' or 'adaptive', got {kind!r}")
    return kind != "disabled"


def _output_grammar(body: dict, tokenizer: Any) -> str | None:
    """Structured outputs: `output_config.format` {"type": "json_schema", "schema"}, by constrained decoding
    (in the model's format: tools.output_grammar)."""
    config = parse.field(body, "output_config", "object", {})
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise ApiError(400, "output_config.format: must be {\"type\": \"json_schema\", \"schema\": {...}}")
    try:
        return output_grammar(fmt["schema"], tokenizer)
    except UserError as e:
        raise ApiError(400, f"output_config.format.schema: {e}") from None


async def messages(http: HttpRequest) -> Response:
    body = await parse.read_json(http)
    chat = _chat(body)
    use, grammar = _tools(http, body)
    thinking = _thinking(body)
    tokenizer = ready_engine(http.app.state.worker).tokenizer
    read = reading(tokenizer, use)
    output = _output_grammar(body, tokenizer)
    if grammar is not None and output is not None:
        raise ApiError(400, "tool_choice: a forced tool call and output_config.format cannot both constrain one reply")
    grammar = grammar or output
    stream = parse.field(body, "stream", "bool", False)
    gen = await Generation.start(http.app.state.worker, messages=chat,
                                 max_tokens=parse.max_tokens(body, ("max_tokens",), required=True),
                                 sampling=parse.sampling(body, max_temperature=1.0),
                                 stops=parse.stops(body, "stop_sequences"), grammar=grammar,
                                 tools=None if use is None else [t.for_template() for t in use.tools],
                                 special_tokens=read is not None)
    message: dict[str, Any] = {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
                               "model": http.app.state.model_id}
    if not stream:
        out = await gen.collect(http)
        d = out.done
        reply = read.parse(out.text) if read is not None else Reply(out.text, [])
        text, calls = reply.content, reply.calls
        content = ([{"type": "thinking", "thinking": reply.reasoning, "signature": ""}] if thinking and reply.reasoning
                   else []) + ([{"type": "text", "text": text}] if text or not calls else []) + [
            _tool_use_block(c) for c in calls]
        return JSONResponse({**message, "content": content,
                             "stop_reason": "tool_use" if calls else _stop_reason(d.finish_reason, out.stop_sequence),
                             "stop_sequence": out.stop_sequence,
                             "usage": {"input_tokens": d.prompt_tokens, "output_tokens": d.completion_tokens,
                                       "cache_read_input_tokens": d.cached_tokens}})
    await gen.wait_first(http)
    reply_filter = ReplyFilter(read) if read is not None else None

    async def events():
        yield sse({"type": "message_start", "message": {
            **message, "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": gen.prompt_tokens, "output_tokens": 0}}}, "message_start")
        blocks = _Blocks()
        if read is None:  # a read reply opens each block with its first text: a reply that is only a call has none
            yield blocks.open("text")
        yield sse({"type": "ping"}, "ping")
        try:
            async for event in gen.events():
                if not is_done(event):
                    text, reasoning = reply_filter.feed(event.text) if reply_filter else (event.text, "")
                    for line in [*blocks.delta("thinking", reasoning if thinking else ""), *blocks.delta("text", text)]:
                        yield line
                    continue
                tail = reply_filter.finish() if reply_filter else Reply("", [])
                calls = tail.calls
                for line in [*blocks.delta("thinking", tail.reasoning if thinking else ""),
                             *blocks.delta("text", tail.content, force=not (blocks.count or calls))]:
                    yield line
                for line in blocks.close():
                    yield line
                for call in calls:
                    block = _tool_use_block(call)
                    index = blocks.count
                    yield sse({"type": "content_block_start", "index": index,
                               "content_block": {**block, "input": {}}}, "content_block_start")
                    yield sse({"type": "content_block_delta", "index": index, "delta": {
                        "type": "input_json_delta", "partial_json": json.dumps(call.arguments, ensure_ascii=False)}},
                        "content_block_delta")
                    yield sse({"type": "content_block_stop", "index": index}, "content_block_stop")
                    blocks.count += 1
                stop = gen.stop_sequence(event)
                yield sse({"type": "message_delta",
                           "delta": {"stop_reason": "tool_use" if calls else _stop_reason(event.finish_reason, stop),
                                     "stop_sequence": stop},
                           "usage": {"output_tokens": event.completion_tokens}}, "message_delta")
                yield sse({"type": "message_stop"}, "message_stop")
        except ApiError as e:
            yield sse_error("anthropic", e)
    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


class _Blocks:
    """The text and thinking blocks of a stream, opened as their text comes: a delta of another kind than
    the open block's closes it and opens the next one."""
    FIELDS = {"text": ("text", "text_delta"), "thinking": ("thinking", "thinking_delta")}

    def __init__(self):
        self.count = 0  # blocks opened so far
        self.kind: str | None = None  # the open block's kind

    def open(self, kind: str) -> str:
        self.kind, self.count = kind, self.count + 1
        block = {"type": kind, self.FIELDS[kind][0]: "", **({"signature": ""} if kind == "thinking" else {})}
        return sse({"type": "content_block_start", "index": self.count - 1, "content_block": block},
                   "content_block_start")

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [sse({"type": "content_block_stop", "index": self.count - 1}, "content_block_stop")]

    def delta(self, kind: str, text: str, force: bool = False) -> list[str]:
        """The events that stream `text` in a block of `kind` (none for no text, unless `force`: then at
        least the block)."""
        if not text and not force:
            return []
        lines = [*self.close(), self.open(kind)] if self.kind != kind else []
        if text:
            field_, delta = self.FIELDS[kind]
            lines.append(sse({"type": "content_block_delta", "index": self.count - 1,
                              "delta": {"type": delta, field_: text}}, "content_block_delta"))
        return lines


async def count_tokens(http: HttpRequest) -> Response:
    """The prompt tokens /v1/messages would run for the same body (the model's template and tools included)."""
    body = await parse.read_json(http)
    chat = _chat(body)
    use, _ = _tools(http, body)
    tools = None if use is None else [t.for_template() for t in use.tools]
    return JSONResponse({"input_tokens": await Generation.count(http.app.state.worker, messages=chat, tools=tools)})
