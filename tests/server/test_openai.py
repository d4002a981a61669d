"""The OpenAI API through the official `openai` client, against the real engine over loopback."""
from __future__ import annotations

import re

import openai
import pytest

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(tiny_model):
    """The same greedy request run by the engine in this process: what the server must return."""
    from engine.layers.sampler import SamplingParams
    from engine.moe.hybrid import attach_hybrid
    from engine.runtime.engine import Engine, EngineConfig, Request

    engine = Engine.load(tiny_model, EngineConfig(n_ctx=1024), attach_experts=attach_hybrid)
    return list(engine.generate(Request(messages=MESSAGES, max_tokens=24, sampling=SamplingParams(temperature=0))))[-1]


def test_health_reported_loading_then_ok(server):
    first, last = server.health_seen[0], server.health_seen[-1]
    assert first["status"] == "loading" and 0 <= first["progress"] < 100 and first["stage"]
    assert last["status"] == "ok" and last["progress"] == 100
    assert last["engine"] == "hybrid" and last["engine_reason"] == "chosen with --engine hybrid"
    # what it runs with, by setting name: no GPU here, so no expert slots; the context asked for
    eff = last["effective"]
    assert eff["engine"] == "hybrid" and eff["ctx"] == last["n_ctx"] == last["settings"]["ctx"] == 1024
    assert eff["threads"] >= 1 and eff["load_mode"] in ("mmap", "none") and 0 <= eff["moe_gpu_miss_fraction"] <= 1
    if eff["device"] == "cpu":
        assert eff["moe_expert_cache_size"] == 0


def test_models_lists_the_loaded_model(client, tiny_model):
    assert [m.id for m in client.models.list()] == [tiny_model.stem]


def test_chat_matches_the_engine_and_counts_usage(client, count_chat_tokens, reference):
    r = client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=24, temperature=0)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == reference.text
    assert choice.finish_reason == ("length" if reference.finish_reason == "length" else "stop")
    assert r.usage.prompt_tokens == count_chat_tokens(MESSAGES) == reference.prompt_tokens
    assert r.usage.completion_tokens == reference.completion_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_stream_gives_the_same_text_and_usage(client, reference):
    stream = client.chat.completions.create(model="any-name", messages=MESSAGES, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == reference.completion_tokens
    assert chunks[-1].usage.prompt_tokens == reference.prompt_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the KV prefix of the previous request


def test_max_tokens_and_max_completion_tokens(client):
    r = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    r = client.chat.completions.create(model="m", messages=MESSAGES, max_completion_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


def _ascii_stop(text: str) -> str:
    """Three letters from the middle of `text` (random-weight output is full of odd characters)."""
    found = [m.start() for m in re.finditer(r"[A-Za-z]{3}", text) if m.start() >= 4]
    assert found, f"no stop candidate in {text!r}"
    return text[found[len(found) // 2]:found[len(found) // 2] + 3]


def test_stop_sequences_cut_the_text(client, reference):
    stop = _ascii_stop(reference.text)
    expected = reference.text[:reference.text.index(stop)]
    r = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=24, temperature=0, stop=[stop, "\x00never"])
    assert r.choices[0].message.content == expected and r.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=24, temperature=0, stop=stop,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected


def test_sampling_parameters_and_seed(client):
    kwargs = dict(model="m", messages=MESSAGES, max_tokens=8, temperature=0.9, top_p=0.95, seed=7,
                  extra_body={"top_k": 40, "min_p": 0.05, "repeat_penalty": 1.1})
    a = client.chat.completions.create(**kwargs).choices[0].message.content
    b = client.chat.completions.create(**kwargs).choices[0].message.content
    assert a == b  # the same seed samples the same tokens


def test_text_completions(client, tokenizer):
    prompt = "The quick brown fox"
    r = client.completions.create(model="m", prompt=prompt, max_tokens=5, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special=tokenizer.add_bos, parse_special=True))
    assert r.usage.completion_tokens == 5
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="m", prompt=prompt, max_tokens=5, temperature=0, stream=True) if c.choices)
    assert streamed == r.choices[0].text


def test_client_errors_are_the_clients_own_types(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2, extra_body={"top_k": "many"})
    assert e.value.status_code == 400 and e.value.body["param"] == "top_k"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=-1)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "word " * 3000}], max_tokens=2)
    assert e.value.body["code"] == "context_length_exceeded" and "context holds 1024" in e.value.body["message"]
