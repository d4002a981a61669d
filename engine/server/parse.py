"""Reading request bodies: size limit, UTF-8, JSON, and typed fields with messages naming the field.

Unknown fields are ignored (clients send their own extensions); known fields of the wrong
type or range are refused with 400 and the field's name, never coerced silently.
"""
from __future__ import annotations

import json
import math
import re
from typing import TYPE_CHECKING, Any

from starlette.requests import Request as HttpRequest

from engine.server.errors import ApiError

if TYPE_CHECKING:
    from engine.layers.sampler import SamplingParams

MAX_BODY_BYTES = 4 << 20
MAX_TOKENS_LIMIT = 1 << 24  # beyond any context length: a bigger value is a client bug
MAX_STOPS = 16
_MISSING = object()
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


async def read_json(request: HttpRequest) -> dict[str, Any]:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is {int(declared):,} bytes; the limit is {MAX_BODY_BYTES:,}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body exceeds the limit of {MAX_BODY_BYTES:,} bytes")
        chunks.append(chunk)
    try:
        text = b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not valid UTF-8 (byte {e.start})") from None
    try:
        body = json.loads(text)
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON: it is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, and integers past Python's digit limit
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    # A \ud800-\udfff escape that is not half of a pair parses to a string no UTF-8 encoder takes
    # (the tokenizer's included); the exact check is a re-encode, paid only when such an escape is there.
    if _SURROGATE_ESCAPE.search(text):
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, "the request body is not valid JSON text: it escapes a lone UTF-16 surrogate "
                           "(\\ud800-\\udfff without its pair)") from None
    return body


def _bad(name: str, expected: str, value: Any) -> ApiError:
    shown = json.dumps(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return ApiError(400, f"'{name}' must be {expected}, got {shown}", param=name, code="invalid_value")


def field(body: dict, name: str, kind: str, default: Any = _MISSING, *, required: bool = False) -> Any:
    """body[name] checked against `kind` (int, number, string, bool, object, array); None counts as absent."""
    value = body.get(name)
    if value is None:
        if required:
            raise ApiError(400, f"'{name}' is required", param=name, code="missing_required_parameter")
        return None if default is _MISSING else default
    ok = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool),
          "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
          "string": lambda v: isinstance(v, str), "bool": lambda v: isinstance(v, bool),
          "object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list)}[kind]
    if not ok(value):
        expected = {"int": "an integer", "number": "a number", "string": "a string", "bool": "true or false",
                    "object": "an object", "array": "an array"}[kind]
        raise _bad(name, expected, value)
    return value


def max_tokens(body: dict, names: tuple[str, ...], *, required: bool = False) -> int | None:
    """The first of `names` present (OpenAI has max_completion_tokens and the older max_tokens)."""
    name = next((n for n in names if body.get(n) is not None), names[0])
    value = field(body, name, "int", required=required)
    if value is not None and not 1 <= value <= MAX_TOKENS_LIMIT:
        raise _bad(name, f"an integer from 1 to {MAX_TOKENS_LIMIT}", value)
    return value


def stops(body: dict, name: str) -> tuple[str, ...]:
    value = body.get(name)
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items) or len(items) > MAX_STOPS:
        raise _bad(name, f"a string or an array of at most {MAX_STOPS} strings", value)
    return tuple(s for s in items if s)


def sampling(body: dict, *, max_temperature: float) -> SamplingParams:
    """Sampling parameters; top_k, min_p and repeat_penalty are llama.cpp extensions both APIs accept."""
    from engine.layers.sampler import SamplingParams  # imports torch: not before the server listens

    values: dict[str, Any] = {}
    for name, kind in (("temperature", "number"), ("top_p", "number"), ("top_k", "int"), ("min_p", "number"),
                       ("repeat_penalty", "number"), ("presence_penalty", "number"),
                       ("frequency_penalty", "number"), ("seed", "int")):
        value = field(body, name, kind)
        if value is not None:
            values[name] = value
    temperature = values.get("temperature", 1.0)
    if not 0.0 <= temperature <= max_temperature:
        raise _bad("temperature", f"a number from 0 to {max_temperature:g}", temperature)
    if values.get("top_k", 0) < 0:
        raise _bad("top_k", "an integer >= 0 (0 = off)", values["top_k"])
    try:
        return SamplingParams(**values)
    except ValueError as e:  # SamplingParams names the field first in its message
        raise ApiError(400, str(e), param=str(e).split()[0], code="invalid_value") from None


def text_content(content: Any, where: str) -> str:
    """A message's content: a string, or an array of text parts/blocks joined (both APIs' shapes)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ApiError(400, f"{where}[{i}]: only text content is supported (got {kind!r})",
                               param=where, code="unsupported_content")
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(where, "a string or an array of text blocks", content)
