"""Ollama's API through the official `ollama` client: version, tags, show, chat and generate, streamed
as NDJSON, options mapped to ours, format and tools, errors in Ollama's shape."""
from __future__ import annotations

import json

import ollama
import openai
import pytest

USER = [{"role": "user", "content": "Name three colours."}]
GREEDY = {"temperature": 0, "num_predict": 8}


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url, timeout=120)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


def test_version_tags_show(client, server, tiny_model):
    assert server.request("GET", "/api/version")[1]["version"]
    models = client.list().models
    assert [m.model for m in models] == [f"{tiny_model.stem}:latest"]
    assert models[0].size == tiny_model.stat().st_size and models[0].details.family == "qwen3moe"
    shown = client.show(models[0].model)
    assert shown.details.format == "gguf" and "tools" in shown.capabilities and "<|im_start|>" in shown.template


def test_chat_is_the_same_generation_as_openai(client, oai, count_chat_tokens):
    r = client.chat(model="any", messages=USER, options=GREEDY)
    same = oai.chat.completions.create(model="m", messages=USER, max_tokens=8, temperature=0)
    assert r.message.role == "assistant" and r.message.content == same.choices[0].message.content
    assert r.done and r.done_reason == "length" and r.eval_count == 8
    assert r.prompt_eval_count == count_chat_tokens(USER) and r.total_duration > 0
    parts = list(client.chat(model="any", messages=USER, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == r.message.content
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True] and parts[-1].eval_count == 8


def test_generate_renders_the_template_unless_raw(client, oai):
    r = client.generate(model="m", prompt="Name three colours.", options=GREEDY)
    chat = client.chat(model="m", messages=USER, options=GREEDY)
    assert r.response == chat.message.content and r.done_reason == "length"
    raw = client.generate(model="m", prompt="The colours are", raw=True, options=GREEDY)
    plain = oai.completions.create(model="m", prompt="The colours are", max_tokens=8, temperature=0)
    assert raw.response == plain.choices[0].text
    streamed = "".join(p.response for p in client.generate(model="m", prompt="The colours are", raw=True,
                                                            options=GREEDY, stream=True))
    assert streamed == raw.response
    assert client.generate(model="m", prompt="").done_reason == "load"  # Ollama's "load the model"


def test_options_stop_and_system(client, oai):
    base = client.chat(model="m", messages=USER, options={"temperature": 0, "num_predict": 24}).message.content
    stop = base[len(base) // 2:len(base) // 2 + 3]
    r = client.chat(model="m", messages=USER, options={"temperature": 0, "num_predict": 24, "stop": [stop]})
    assert r.message.content == base[:base.index(stop)] and r.done_reason == "stop"
    system = client.generate(model="m", prompt=USER[0]["content"], system="Be brief.", options=GREEDY).response
    assert system == oai.chat.completions.create(model="m", max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, *USER]).choices[0].message.content


def test_format_schema_and_json(client):
    schema = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "blue"]},
                                               "count": {"type": "integer"}}, "required": ["colour", "count"]}
    for stream in (False, True):
        for fmt in ("json", schema):
            parts = client.chat(model="m", messages=USER, format=fmt, options={"num_predict": 40, "seed": 3},
                                stream=stream)
            text = "".join(p.message.content for p in parts) if stream else parts.message.content
            doc = json.loads(text)
            assert isinstance(doc, dict)
            if fmt is schema:
                assert doc["colour"] in ("red", "blue") and isinstance(doc["count"], int)


def test_tools(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                              "required": ["city"]}}}]
    r = client.chat(model="m", messages=USER, tools=tools, options=GREEDY)
    assert r.message.tool_calls is None  # the random model answers in text; nothing is forced here
    history = [*USER, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}, {"role": "tool", "content": "sunny"}]
    assert client.chat(model="m", messages=history, tools=tools, options=GREEDY).prompt_eval_count > \
        client.chat(model="m", messages=USER, tools=tools, options=GREEDY).prompt_eval_count


def test_errors_in_ollama_shape(client, server):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="m", messages=[{"role": "robot", "content": "x"}])
    assert e.value.status_code == 400 and "role" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="m", messages=USER, options={"temperature": "hot"})
    assert e.value.status_code == 400 and "temperature" in e.value.error
    status, body = server.request("POST", "/api/chat", {"model": "m", "messages": USER, "format": "yaml"})
    assert status == 400 and body["error"].startswith("'format' must be \"json\" or a JSON schema object")
    status, body = server.request("POST", "/api/nowhere", {})
    assert status == 404 and body == {"error": "no endpoint POST /api/nowhere"}
