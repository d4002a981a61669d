"""Bad requests against a real server on loopback: each gets a 4xx with a message, and the server keeps serving.

tests/server/test_http_errors.py covers the common cases (unreadable bodies, wrong types and ranges
of the OpenAI fields, a body over the limit with a Content-Length, a prompt over the context). This
module adds what a hostile or broken client can also send: a body over the limit without a length
(chunked), JSON that Python's parser rejects with something other than a JSONDecodeError (nesting
too deep, an integer of 5000 digits), an escaped lone surrogate that parses but cannot be encoded,
NaN and Infinity, the Anthropic fields' types and ranges, a huge but legal max_tokens (clamped to
what the context leaves, as llama.cpp's server does), thousands of tiny messages, and streamed
requests over the context. The last test sends ordinary requests to both APIs and checks that the
server never logged an internal error on the way.

Unknown fields are ignored, as local OpenAI-compatible servers (llama.cpp's) do; the hosted OpenAI
and Anthropic APIs refuse them, docs/RELIABILITY.md says why this server does not.
"""
from __future__ import annotations

import http.client
import json

import pytest

from engine.server.parse import MAX_BODY_BYTES
from tests.server.conftest import start_server

CTX = 128
CHAT = "/v1/chat/completions"
MSG = "/v1/messages"
USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(make_model):
    s = start_server(make_model("qwen3moe"), "--engine", "hybrid", "-c", str(CTX))
    assert s.health_seen[-1]["status"] == "ok", "".join(s.log)
    yield s
    assert s.stop() == 0, "".join(s.log)


def message_of(path: str, body) -> str:
    """The error message, checking the API's error shape on the way."""
    assert isinstance(body, dict), body
    if path == MSG:
        assert body["type"] == "error" and body["error"]["type"], body
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    return body["error"]["message"]


BOTH = pytest.mark.parametrize("path", [CHAT, MSG])


def payload(**fields) -> dict:
    return {"model": "m", "messages": USER, "max_tokens": 2, **fields}


@BOTH
def test_chunked_body_over_the_limit(server, path):
    """No Content-Length to refuse early: the limit is counted while the body streams in."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    chunk = b"a" * (1 << 20)
    body = [b'{"messages": "'] + [chunk] * (MAX_BODY_BYTES // len(chunk) + 1) + [b'"}']
    try:
        conn.request("POST", path, body=iter(body), encode_chunked=True,
                     headers={"content-type": "application/json", "transfer-encoding": "chunked"})
        resp = conn.getresponse()
        status, data = resp.status, json.loads(resp.read())
    finally:
        conn.close()
    assert status == 413 and f"exceeds the limit of {MAX_BODY_BYTES:,} bytes" in message_of(path, data)


@BOTH
@pytest.mark.parametrize("raw, words", [
    (b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    (b'{"max_tokens": 1' + b"0" * 5000 + b"}", "not valid JSON"),
    (b'{"messages": [{"role": "user", "content": "a \\ud800 b"}], "max_tokens": 2}', "lone UTF-16 surrogate"),
    (b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}', "lone UTF-16 surrogate"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "temperature": NaN}', "temperature"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": Infinity}', "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 2.0}', "max_tokens"),
], ids=["nested 100000 deep", "5000-digit integer", "lone high surrogate", "lone low surrogate", "NaN", "Infinity",
        "float max_tokens"])
def test_json_that_parses_badly_or_into_something_unusable(server, path, raw, words):
    status, body = server.request("POST", path, raw)
    assert status == 400 and words in message_of(path, body), body


@BOTH
def test_an_escaped_surrogate_pair_is_fine(server, path):
    raw = b'{"messages": [{"role": "user", "content": "smile \\ud83d\\ude00"}], "max_tokens": 2}'
    status, body = server.request("POST", path, raw)
    assert status == 200, body


@pytest.mark.parametrize("fields, words", [
    ({"max_tokens": -1}, "'max_tokens' must be an integer from 1 to"),
    ({"max_tokens": 0}, "'max_tokens' must be an integer from 1 to"),
    ({"max_tokens": 1 << 40}, "'max_tokens' must be an integer from 1 to"),
    ({"max_tokens": 2.5}, "'max_tokens' must be an integer"),
    ({"temperature": "hot"}, "'temperature' must be a number"),
    ({"temperature": -0.5}, "'temperature' must be a number from 0 to"),
    ({"top_k": -1}, "'top_k' must be an integer >= 0"),
    ({"top_p": "all"}, "'top_p' must be a number"),
    ({"stream": "yes"}, "'stream' must be true or false"),
    ({"stop_sequences": [1, 2]}, "'stop_sequences' must be a string or an array"),
    ({"messages": "Hi"}, "'messages' must be an array"),
    ({"messages": []}, "at least one message is required"),
    ({"messages": ["Hi"]}, "messages.0"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "only text content"),
    ({"messages": [{"role": "user", "content": None}]}, "content"),
    ({"system": [{"type": "text", "text": 5}]}, "system"),
])
def test_anthropic_fields_of_the_wrong_type_or_range(server, fields, words):
    status, body = server.request("POST", MSG, payload(**fields))
    assert status == 400 and words in message_of(MSG, body), body


@pytest.mark.parametrize("fields, words", [
    ({"messages": ["Hi"]}, "messages"),
    ({"messages": [{"content": "Hi"}]}, "role"),
    ({"messages": [{"role": "user", "content": None}]}, "content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "only text content"),
    ({"max_completion_tokens": -3}, "max_completion_tokens"),
    ({"stream": True, "stream_options": "usage"}, "stream_options"),
])
def test_openai_message_shapes(server, fields, words):
    status, body = server.request("POST", CHAT, payload(**fields))
    assert status == 400 and words in message_of(CHAT, body), body


def test_anthropic_ignores_unknown_fields(server):
    status, body = server.request("POST", MSG, payload(metadata={"user_id": "u"}, tool_choice={"type": "auto"},
                                                      frobnicate=[1, {"x": None}]))
    assert status == 200 and body["usage"]["output_tokens"] <= 2, body


@BOTH
def test_a_huge_legal_max_tokens_is_clamped_to_the_context(server, path):
    status, body = server.request("POST", path, payload(max_tokens=1 << 24, temperature=0))
    assert status == 200, body
    if path == CHAT:
        usage, finish = body["usage"], body["choices"][0]["finish_reason"]
        used = usage["prompt_tokens"] + usage["completion_tokens"]
    else:
        usage, finish = body["usage"], body["stop_reason"]
        used = usage["input_tokens"] + usage["output_tokens"]
    # It ran until the context was full (or the model ended it), never past it.
    assert used <= CTX and (used == CTX or finish in ("stop", "end_turn")), body


@BOTH
def test_thousands_of_tiny_messages_are_refused_for_the_context(server, path):
    many = [{"role": ("user", "assistant")[i % 2], "content": "x"} for i in range(5_001)]
    status, body = server.request("POST", path, payload(messages=many), timeout=60)
    assert status == 400 and f"the context holds {CTX}" in message_of(path, body), body


@BOTH
def test_a_streamed_request_over_the_context_is_a_plain_400(server, path):
    """The status line is not sent before the prompt is checked: the client gets an error body, not a stream."""
    long = [{"role": "user", "content": "lorem ipsum " * 400}]
    status, body = server.request("POST", path, payload(messages=long, stream=True))
    assert status == 400 and f"the context holds {CTX}" in message_of(path, body), body


def test_after_all_of_it_the_server_still_serves_and_logged_no_internal_error(server):
    """Runs last in this module: every request above got its 4xx without an internal error."""
    status, body = server.request("POST", CHAT, payload(temperature=0))
    assert status == 200 and body["choices"][0]["message"]["content"] is not None, body
    status, body = server.request("POST", MSG, payload(temperature=0))
    assert status == 200 and body["content"][0]["type"] == "text", body
    assert server.request("GET", "/health")[1]["status"] == "ok"
    assert server.proc.poll() is None
    log = "".join(server.log)
    assert "Traceback" not in log and "failed" not in log, log[-3000:]
