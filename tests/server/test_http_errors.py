"""Malformed requests over raw HTTP: each gets a 4xx in its API's error shape, and the server stays up."""
from __future__ import annotations

import pytest

CHAT = "/v1/chat/completions"
MSG = "/v1/messages"
USER = [{"role": "user", "content": "Hi"}]


def openai_error(status: int, body) -> dict:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"]
    return body["error"]


def anthropic_error(body) -> dict:
    assert isinstance(body, dict) and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize("raw, words", [
    (b"{not json", "not valid JSON"),
    (b'{"messages": "\xff\xfe"}', "not valid UTF-8"),
    (b"[1, 2]", "must be a JSON object"),
    (b"", "not valid JSON"),
])
def test_unreadable_bodies(server, raw, words):
    status, body = server.request("POST", CHAT, raw)
    assert status == 400 and words in openai_error(status, body)["message"]
    status, body = server.request("POST", MSG, raw)
    assert status == 400 and words in anthropic_error(body)["message"]


@pytest.mark.parametrize("fields, param", [
    ({"messages": "Hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10 ** 12}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": 7}, "temperature"),
    ({"top_p": 2}, "top_p"),
    ({"seed": 1.5}, "seed"),
    ({"stop": 5}, "stop"),
    ({"stream": "yes"}, "stream"),
    ({"n": 3}, "n"),
])
def test_wrong_types_and_ranges_name_the_field(server, fields, param):
    status, body = server.request("POST", CHAT, {"model": "m", "messages": USER, "max_tokens": 2, **fields})
    assert status == 400 and openai_error(status, body)["param"] == param


@pytest.mark.parametrize("fields, words", [
    ({"max_tokens": None}, "'max_tokens' is required"),
    ({"max_tokens": "2"}, "'max_tokens' must be an integer"),
    ({"messages": [{"role": "system", "content": "x"}]}, "must be 'user' or 'assistant'"),
    ({"system": 3}, "'system' must be a string or an array of text blocks"),
    ({"stop_sequences": "END"}, None),  # a lone string is accepted like OpenAI's stop
])
def test_anthropic_validation(server, fields, words):
    status, body = server.request("POST", MSG, {"model": "m", "messages": USER, "max_tokens": 2, **fields})
    if words is None:
        assert status == 200, body
    else:
        assert status == 400 and words in anthropic_error(body)["message"]


def test_unknown_fields_are_ignored_and_any_model_answers(server):
    status, body = server.request("POST", CHAT, {"model": "gpt-9-ultra", "messages": USER, "max_tokens": 2,
                                                  "frobnicate": {"x": 1}, "user": "me", "tools": []})
    assert status == 200 and body["usage"]["completion_tokens"] <= 2


def test_body_too_large(server):
    big = b'{"messages": "' + b"a" * (5 << 20) + b'"}'
    status, body = server.request("POST", CHAT, big)
    assert status == 413 and "limit" in openai_error(status, body)["message"]
    status, body = server.request("POST", MSG, big)
    assert status == 413 and anthropic_error(body)["type"] == "request_too_large"


def test_over_the_context_length(server):
    long_text = "lorem ipsum " * 2000
    status, body = server.request("POST", CHAT, {"messages": [{"role": "user", "content": long_text}], "max_tokens": 2})
    err = openai_error(status, body)
    assert status == 400 and err["code"] == "context_length_exceeded" and "1024" in err["message"]
    status, body = server.request("POST", MSG, {"messages": [{"role": "user", "content": long_text}], "max_tokens": 2})
    assert status == 400 and "context holds 1024" in anthropic_error(body)["message"]
    assert server.request("GET", "/health")[1]["status"] == "ok"


def test_unknown_paths_and_methods(server):
    status, body = server.request("GET", "/v1/nothing")
    assert status == 404 and openai_error(status, body)["type"] == "not_found_error"
    status, body = server.request("GET", CHAT)
    assert status == 405 and openai_error(status, body)
    status, body = server.request("GET", MSG)
    assert status == 405 and anthropic_error(body)
