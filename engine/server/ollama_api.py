"""Ollama's API beside OpenAI's and Anthropic's: GET /api/version, GET /api/tags, POST /api/show,
POST /api/chat and POST /api/generate, streaming as NDJSON (one JSON object a line; Ollama streams
unless `"stream": false`). Many local front-ends and tools speak only this API.

Options map to ours: temperature, top_p, top_k, min_p, seed, repeat_penalty, presence_penalty,
frequency_penalty, stop; num_predict is max_tokens (-1 or -2: until the context is full). Options
that choose how a model is loaded (num_ctx, num_gpu, num_thread, ...) are the server's settings
and are ignored here, as are keep_alive and think. `format` ("json" or a JSON schema) is enforced
by constrained decoding, and tools work as on the other APIs (engine/server/tools.py). A model's
reasoning (gpt-oss's analysis channel) comes as `thinking` (message.thinking in /api/chat), as Ollama
returns it. Sampling defaults are this server's (the other APIs' defaults), not Ollama's.
"""
from __future__ import annotations

import hashlib
import json
import time
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from engine.errors import UserError
from engine.server import parse
from engine.server.errors import ApiError, sse_error
from engine.server.generation import Generation, ready_engine
from engine.server.openai_api import is_done
from engine.server.tools import (Reading, Reply, ReplyFilter, check_template, for_model, openai_tool_use,
                                 output_grammar, reading)

OLLAMA_VERSION = "0.12.0"  # the Ollama release whose API these endpoints follow
NDJSON = "application/x-ndjson"
_OPTIONS = (("temperature", "number"), ("top_p", "number"), ("top_k", "int"), ("min_p", "number"), ("seed", "int"),
            ("repeat_penalty", "number"), ("presence_penalty", "number"), ("frequency_penalty", "number"))


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + f".{time.time_ns() % 10**9:09d}Z"


def _line(data: dict[str, Any]) -> str:
    return json.dumps(data, ensure_ascii=False) + "\n"


def _name(http: HttpRequest) -> str:
    return f"{http.app.state.model_id}:latest"


def _details(http: HttpRequest) -> dict[str, Any]:
    arch = http.app.state.model_arch
    return {"parent_model": "", "format": "gguf", "family": arch, "families": [arch], "parameter_size": "",
            "quantization_level": ""}


async def version(http: HttpRequest) -> Response:
    return JSONResponse({"version": OLLAMA_VERSION})


async def tags(http: HttpRequest) -> Response:
    state = http.app.state
    modified = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(state.model_created))
    # An identity of the served file (path, size, time), not a hash of its gigabytes.
    digest = hashlib.sha256(f"{state.model_id}:{state.model_size}:{state.model_created}".encode()).hexdigest()
    return JSONResponse({"models": [{"name": _name(http), "model": _name(http), "modified_at": modified,
                                     "size": state.model_size, "digest": digest, "details": _details(http)}]})


async def show(http: HttpRequest) -> Response:
    body = await parse.read_json(http)
    parse.field(body, "model", "string", required=True)
    tokenizer = ready_engine(http.app.state.worker).tokenizer
    capabilities = ["completion"]
    try:
        check_template(tokenizer)
        capabilities.append("tools")
    except ApiError:
        pass
    engine = http.app.state.worker.engine
    return JSONResponse({"modelfile": "", "parameters": "", "template": tokenizer.chat_template or "",
                         "details": _details(http), "capabilities": capabilities,
                         "model_info": {"general.architecture": http.app.state.model_arch,
                                        "moestudio.context_length": engine.n_ctx}})


def _options(body: dict) -> tuple[Any, int | None, tuple[str, ...]]:
    """(sampling, max_tokens, stops) from `options`."""
    options = parse.field(body, "options", "object", {})
    known = {name: options[name] for name, _ in _OPTIONS if options.get(name) is not None}
    sampling = parse.sampling(known, max_temperature=2.0)
    limit = parse.field(options, "num_predict", "int")
    if limit is not None and limit < -2:
        raise ApiError(400, f"'num_predict' must be a positive number of tokens, or -1 / -2, got {limit}",
                       param="num_predict")
    return sampling, (None if limit is None or limit < 0 else max(limit, 1)), parse.stops(options, "stop")


def _format_grammar(body: dict, tokenizer: Any) -> str | None:
    """`format`; with the `tokenizer` of a chat-templated request, in the model's format (tools.output_grammar)."""
    from engine.layers.grammar import json_schema_grammar

    fmt = body.get("format")

    def grammar(schema: dict) -> str:
        return json_schema_grammar(schema) if tokenizer is None else output_grammar(schema, tokenizer)
    try:
        if fmt in (None, ""):
            return None
        if fmt == "json":
            return grammar({"type": "object"})
        if isinstance(fmt, dict):
            return grammar(fmt)
    except UserError as e:
        raise ApiError(400, str(e), param="format") from None
    raise ApiError(400, f"'format' must be \"json\" or a JSON schema object, got {json.dumps(fmt)[:60]}",
                   param="format")


def _chat_messages(body: dict) -> list[dict[str, Any]]:
    messages = parse.field(body, "messages", "array", required=True)
    out = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("system", "user", "assistant", "tool"):
            raise ApiError(400, f"messages[{i}].role must be system, user, assistant or tool, got {role!r}")
        if m.get("images"):
            raise ApiError(400, f"messages[{i}].images: images are not supported")
        content = parse.field(m, "content", "string", "")
        message: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant" and m.get("tool_calls"):
            calls = m["tool_calls"]
            if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                                      for c in calls):
                raise ApiError(400, f"messages[{i}].tool_calls must be an array of {{\"function\": {{\"name\", "
                               "\"arguments\"}}}}")
            message["tool_calls"] = [{"type": "function", "function": dict(c["function"])} for c in calls]
        out.append(message)
    return out


def _timings(done: Any) -> dict[str, Any]:
    prefill_ns = int(done.ttft_s * 1e9)
    decode_ns = int((done.completion_tokens - 1) / done.decode_tokens_per_s * 1e9) if done.decode_tokens_per_s else 0
    return {"done_reason": "length" if done.finish_reason == "length" else "stop",
            "total_duration": prefill_ns + decode_ns, "load_duration": 0,
            "prompt_eval_count": done.prompt_tokens, "prompt_eval_duration": prefill_ns,
            "eval_count": done.completion_tokens, "eval_duration": decode_ns}


def _tool_calls(calls: list) -> list[dict[str, Any]]:
    return [{"function": {"name": c.name, "arguments": c.arguments}} for c in calls]


async def _respond(http: HttpRequest, body: dict, gen: Generation, field: str, read: Reading | None) -> Response:
    """Ollama's answer: one object, or NDJSON lines ending with the one that says done."""
    head = {"model": _name(http)}

    def piece(text: str, thinking: str = "") -> dict[str, Any]:
        extra = {"thinking": thinking} if thinking else {}
        return {"message": {"role": "assistant", "content": text, **extra}} if field == "message" else {
            "response": text, **extra}

    if not parse.field(body, "stream", "bool", True):
        out = await gen.collect(http)
        whole = read.parse(out.text) if read is not None else Reply(out.text, [])
        reply = piece(whole.content, whole.reasoning)
        if whole.calls:
            reply["message"]["tool_calls"] = _tool_calls(whole.calls)
        return JSONResponse({**head, "created_at": _now(), **reply, "done": True, **_timings(out.done)})
    await gen.wait_first(http)
    reply_filter = ReplyFilter(read) if read is not None else None

    async def lines():
        try:
            async for event in gen.events():
                if not is_done(event):
                    text, thinking = reply_filter.feed(event.text) if reply_filter else (event.text, "")
                    if text or thinking:
                        yield _line({**head, "created_at": _now(), **piece(text, thinking), "done": False})
                    continue
                tail = reply_filter.finish() if reply_filter else Reply("", [])
                calls = tail.calls
                last = piece(tail.content, tail.reasoning)
                if calls:
                    last["message"]["tool_calls"] = _tool_calls(calls)
                yield _line({**head, "created_at": _now(), **last, "done": True, **_timings(event)})
        except ApiError as e:
            yield sse_error("ollama", e)
    return StreamingResponse(lines(), media_type=NDJSON)


async def chat(http: HttpRequest) -> Response:
    body = await parse.read_json(http)
    messages, use = _chat_messages(body), openai_tool_use({"tools": body.get("tools")})
    tokenizer = ready_engine(http.app.state.worker).tokenizer
    if use is not None:
        use = for_model(use, tokenizer)
    sampling, max_tokens, stops = _options(body)
    if not messages:  # Ollama's way to load a model: nothing to generate
        ready_engine(http.app.state.worker)
        return JSONResponse({"model": _name(http), "created_at": _now(),
                             "message": {"role": "assistant", "content": ""}, "done": True, "done_reason": "load"})
    read = reading(tokenizer, use)
    gen = await Generation.start(http.app.state.worker, messages=messages, max_tokens=max_tokens, sampling=sampling,
                                 stops=stops, grammar=_format_grammar(body, tokenizer),
                                 tools=None if use is None else [t.for_template() for t in use.tools],
                                 special_tokens=read is not None)
    return await _respond(http, body, gen, "message", read)


async def generate(http: HttpRequest) -> Response:
    body = await parse.read_json(http)
    prompt = parse.field(body, "prompt", "string", "")
    system = parse.field(body, "system", "string", "")
    if body.get("images") or body.get("suffix"):
        raise ApiError(400, "'images' and 'suffix' are not supported")
    sampling, max_tokens, stops = _options(body)
    if not prompt:  # Ollama's way to load a model: nothing to generate
        ready_engine(http.app.state.worker)
        return JSONResponse({"model": _name(http), "created_at": _now(), "response": "", "done": True,
                             "done_reason": "load"})
    raw = parse.field(body, "raw", "bool", False)
    request: dict[str, Any] = {"prompt": prompt, "param": "prompt"} if raw else {
        "messages": ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]}
    # A templated prompt's reply is the model's turn, read in its format; a raw prompt's is plain text.
    tokenizer = None if raw else ready_engine(http.app.state.worker).tokenizer
    read = None if raw else reading(tokenizer, None)
    gen = await Generation.start(http.app.state.worker, max_tokens=max_tokens, sampling=sampling, stops=stops,
                                 grammar=_format_grammar(body, tokenizer), special_tokens=read is not None, **request)
    return await _respond(http, body, gen, "response", read)
