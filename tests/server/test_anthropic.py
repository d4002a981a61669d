"""The Anthropic Messages API through the official `anthropic` client, against the real engine."""
from __future__ import annotations

import re

import anthropic
import pytest

SYSTEM = "You are terse."
MESSAGES = [{"role": "user", "content": "Name three colours."}]
# Current clients no longer send sampling parameters; the server still reads them (older clients do).
GREEDY = {"extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def greedy(client):
    return client.messages.create(model="whatever-the-agent-sends", system=SYSTEM, messages=MESSAGES, max_tokens=24,
                                  **GREEDY)


def test_message_shape_and_usage(greedy, count_chat_tokens):
    assert greedy.type == "message" and greedy.role == "assistant"
    assert [b.type for b in greedy.content] == ["text"] and greedy.content[0].text
    assert greedy.stop_reason in ("max_tokens", "end_turn")
    assert greedy.usage.input_tokens == count_chat_tokens([{"role": "system", "content": SYSTEM}, *MESSAGES])
    if greedy.stop_reason == "max_tokens":
        assert greedy.usage.output_tokens == 24


def test_system_blocks_and_content_blocks_mean_the_same_as_strings(client, greedy):
    r = client.messages.create(model="m", system=[{"type": "text", "text": SYSTEM}], max_tokens=24, **GREEDY,
                               messages=[{"role": "user", "content": [{"type": "text", "text": MESSAGES[0]["content"]}]}])
    assert r.content[0].text == greedy.content[0].text and r.usage.input_tokens == greedy.usage.input_tokens


def test_stream_event_sequence(client, greedy):
    with client.messages.stream(model="m", system=SYSTEM, messages=MESSAGES, max_tokens=24, **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events if not e.type.startswith(("text", "ping"))]
    # The client adds its own "text" convenience events; the wire events are in the documented order.
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) <= {"content_block_delta"}
    assert events[0].message.usage.input_tokens == greedy.usage.input_tokens
    assert final.content[0].text == greedy.content[0].text
    assert final.stop_reason == greedy.stop_reason and final.usage.output_tokens == greedy.usage.output_tokens


def test_stop_sequences(client, greedy):
    text = greedy.content[0].text
    found = [m.start() for m in re.finditer(r"[A-Za-z]{3}", text) if m.start() >= 4]
    stop = text[found[len(found) // 2]:found[len(found) // 2] + 3]
    r = client.messages.create(model="m", system=SYSTEM, messages=MESSAGES, max_tokens=24, **GREEDY,
                               stop_sequences=["\x00never", stop])
    assert r.content[0].text == text[:text.index(stop)]
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    with client.messages.stream(model="m", system=SYSTEM, messages=MESSAGES, max_tokens=24, **GREEDY,
                                stop_sequences=[stop]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_max_tokens(client):
    r = client.messages.create(model="m", messages=MESSAGES, max_tokens=2, **GREEDY)
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 2


def test_errors_in_anthropic_shape(client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="m", messages=MESSAGES, max_tokens=0)
    assert e.value.status_code == 400 and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error" and "max_tokens" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert "only text content" in e.value.body["error"]["message"]


def test_models_in_anthropic_shape(client, tiny_model):
    assert [m.id for m in client.models.list()] == [tiny_model.stem]
