"""Conformance with the official clients where they checked us: logprobs, Anthropic prefill,
count_tokens and empty content; and the load path: any file name, llama.cpp's own reason for a
failed load, a model no engine runs refused before listening, /health always JSON."""
from __future__ import annotations

import math
import os
import shutil

import anthropic
import openai
import pytest

from tests.reliability.test_gguf_fuzz import Gguf

USER = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(tiny_model):
    """The engine in this process, for the log-probabilities the server must report."""
    from engine.runtime.engine import Engine, EngineConfig

    return Engine.load(tiny_model, EngineConfig(n_ctx=1024))


def engine_logprobs(engine, request_tokens: list[int], generated: list[int]) -> list[float]:
    """log p(token) of each generated token under the engine, from its raw logits."""
    import torch

    tokens = request_tokens + generated
    cache = engine.model.new_cache(len(tokens) + 1)
    logits = engine.model.forward(torch.tensor(tokens), cache, 0)
    rows = torch.log_softmax(logits[len(request_tokens) - 1:-1].float(), -1)
    return [float(rows[i, t]) for i, t in enumerate(generated)]


# ---- logprobs --------------------------------------------------------------------------------

def test_chat_logprobs_are_the_models(oai, tokenizer, reference):
    from engine.layers.sampler import SamplingParams
    from engine.runtime.engine import Request

    r = oai.chat.completions.create(model="m", messages=USER, max_tokens=6, temperature=0, logprobs=True,
                                    top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        assert bytes(c.bytes).decode("utf-8", errors="replace") == c.token
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.top_logprobs[-1].logprob
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == c.logprob  # greedy: the best
    events = reference.generate(Request(messages=USER, max_tokens=6, sampling=SamplingParams(temperature=0)))
    generated = [e.token for e in events if getattr(e, "token", None) is not None]
    assert [tokenizer.piece(t) for t in generated] == [bytes(c.bytes) for c in content]
    # Checked against one forward pass over prompt + reply, not the generation loop that produced them.
    prompt = tokenizer.encode(tokenizer.render_chat(USER), parse_special=True)
    expected = engine_logprobs(reference, prompt, generated)
    assert all(math.isclose(c.logprob, e, abs_tol=1e-3) for c, e in zip(content, expected)), (content, expected)


def test_chat_logprobs_stream(oai):
    whole = oai.chat.completions.create(model="m", messages=USER, max_tokens=6, temperature=0, logprobs=True,
                                        top_logprobs=2)
    chunks = list(oai.chat.completions.create(model="m", messages=USER, max_tokens=6, temperature=0,
                                              logprobs=True, top_logprobs=2, stream=True))
    streamed = [c for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for c in chunk.choices[0].logprobs.content]
    expected = whole.choices[0].logprobs.content
    assert [c.token for c in streamed] == [c.token for c in expected]
    # The second request reuses the first one's KV prefix: equal up to float rounding.
    assert all(math.isclose(a.logprob, b.logprob, abs_tol=1e-4) for a, b in zip(streamed, expected))
    assert all(len(c.top_logprobs) == 2 for c in streamed)


def test_logprobs_off_by_default_and_top_zero(oai):
    r = oai.chat.completions.create(model="m", messages=USER, max_tokens=3, temperature=0)
    assert r.choices[0].logprobs is None
    r = oai.chat.completions.create(model="m", messages=USER, max_tokens=3, temperature=0, logprobs=True)
    assert len(r.choices[0].logprobs.content) == 3 and all(c.top_logprobs == [] for c in r.choices[0].logprobs.content)


@pytest.mark.parametrize("fields, words", [
    ({"top_logprobs": 2}, "'top_logprobs' needs 'logprobs' set to true"),
    ({"logprobs": False, "top_logprobs": 2}, "'top_logprobs' needs 'logprobs' set to true"),
    ({"logprobs": True, "top_logprobs": 21}, "from 0 to 20"),
    ({"logprobs": True, "top_logprobs": -1}, "from 0 to 20"),
    ({"logprobs": 3}, "'logprobs' must be true or false"),
])
def test_chat_logprobs_combinations_openai_refuses(oai, fields, words):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="m", messages=USER, max_tokens=2, extra_body=fields)
    assert words in e.value.body["message"]


def test_completion_logprobs_plain_and_streamed(oai):
    r = oai.completions.create(model="m", prompt="The colours are", max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    assert all(max(top.values()) == logprob and len(top) <= 2 for top, logprob in zip(lp.top_logprobs, lp.token_logprobs))
    chunks = list(oai.completions.create(model="m", prompt="The colours are", max_tokens=5, temperature=0,
                                         logprobs=2, stream=True))
    streamed = [(t, p, o) for c in chunks if c.choices[0].logprobs
                for t, p, o in zip(c.choices[0].logprobs.tokens, c.choices[0].logprobs.token_logprobs,
                                   c.choices[0].logprobs.text_offset)]
    assert [(t, o) for t, _, o in streamed] == list(zip(lp.tokens, lp.text_offset))
    # The second request reuses the first one's KV prefix: equal up to float rounding.
    assert all(math.isclose(p, q, abs_tol=1e-4) for (_, p, _), q in zip(streamed, lp.token_logprobs))
    with pytest.raises(openai.BadRequestError, match="from 0 to 5"):
        oai.completions.create(model="m", prompt="x", max_tokens=2, logprobs=6)


def test_llamacpp_engine_reports_the_same_logprobs(serve, tiny_model, oai):
    llama = serve(tiny_model, "--engine", "llamacpp", "-c", "1024")
    theirs = openai.OpenAI(base_url=llama.url + "/v1", api_key="x", max_retries=0, timeout=60)
    kwargs = dict(model="m", messages=USER, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    a = oai.chat.completions.create(**kwargs).choices[0].logprobs.content
    b = theirs.chat.completions.create(**kwargs).choices[0].logprobs.content
    # The first token comes from the same prompt: the same distribution up to rounding. Later texts may part
    # at a near-tie (llama.cpp's KV cache is F16 here, the engine's F32: tests/engine/test_parity.py).
    assert a[0].token == b[0].token and math.isclose(a[0].logprob, b[0].logprob, abs_tol=0.02)
    assert [t.token for t in a[0].top_logprobs] == [t.token for t in b[0].top_logprobs]
    assert len(b) == 4 and all(c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == c.logprob
                               for c in b)  # greedy: each token is the most likely of the row it came from
    chunks = list(theirs.chat.completions.create(**kwargs, stream=True))
    assert [c.token for ch in chunks if ch.choices and ch.choices[0].logprobs
            for c in ch.choices[0].logprobs.content] == [c.token for c in b]


# ---- Anthropic: prefill, count_tokens, empty content ------------------------------------------

def test_prefill_continues_the_assistant_message(claude, tokenizer, reference):
    from engine.layers.sampler import SamplingParams
    from engine.runtime.engine import Request

    prefill = "The first colour is"
    messages = [*USER, {"role": "assistant", "content": prefill}]
    r = claude.messages.create(model="m", messages=messages, max_tokens=6, extra_body={"temperature": 0})
    # The prompt ends inside the assistant turn: the template's opening, then the prefill, no closing.
    prompt = tokenizer.render_chat(messages)
    assert prompt == tokenizer.render_chat(USER) + prefill
    assert r.usage.input_tokens == len(tokenizer.encode(prompt, parse_special=True))
    expected = list(reference.generate(Request(prompt=tokenizer.encode(prompt, parse_special=True), max_tokens=6,
                                               sampling=SamplingParams(temperature=0))))[-1]
    assert r.content[0].text == expected.text  # the continuation only, as Anthropic returns it
    with claude.messages.stream(model="m", messages=messages, max_tokens=6, extra_body={"temperature": 0}) as s:
        assert s.get_final_message().content[0].text == expected.text


def test_prefill_rules(claude):
    with pytest.raises(anthropic.BadRequestError, match="final assistant content cannot end with trailing whitespace"):
        claude.messages.create(model="m", max_tokens=2, messages=[*USER, {"role": "assistant", "content": "Sure "}])
    # An empty final assistant message is allowed: an ordinary reply.
    r = claude.messages.create(model="m", max_tokens=2, messages=[*USER, {"role": "assistant", "content": ""}],
                               extra_body={"temperature": 0})
    assert r.usage.output_tokens == 2


def test_count_tokens_matches_what_messages_runs(claude):
    system = "You are terse."
    counted = claude.messages.count_tokens(model="m", system=system, messages=USER)
    run = claude.messages.create(model="m", system=system, messages=USER, max_tokens=1)
    assert counted.input_tokens == run.usage.input_tokens > 0
    with pytest.raises(anthropic.BadRequestError, match="at least one message"):
        claude.messages.count_tokens(model="m", messages=[])


@pytest.mark.parametrize("content, words", [
    ("", "all messages must have non-empty content except for the optional final assistant message"),
    ([], "all messages must have non-empty content except for the optional final assistant message"),
    ([{"type": "text", "text": ""}], "text content blocks must be non-empty"),
])
def test_empty_content_is_refused_as_anthropic_does(claude, content, words):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": content}])
    assert words in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.count_tokens(model="m", messages=[{"role": "user", "content": content}])


# ---- loading: file names, llama.cpp's reasons, refusals before listening, /health ---------------

@pytest.mark.parametrize("engine", ["hybrid", "llamacpp"])
def test_a_file_name_that_is_not_utf8_loads_and_health_stays_json(serve, tiny_model, tmp_path, engine):
    odd = tmp_path / os.fsdecode(b"mod\xe9l-\xff.gguf")  # Latin-1 bytes: not UTF-8
    shutil.copyfile(tiny_model, odd)
    s = serve(odd, "--engine", engine, "-c", "256")
    status, health = s.request("GET", "/health")
    assert status == 200 and health["status"] == "ok", health
    assert health["model"].endswith("mod\ufffdl-\ufffd.gguf") and health["settings"]["model"] == health["model"]
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list()] == ["mod\ufffdl-\ufffd"]
    assert client.chat.completions.create(model="m", messages=USER, max_tokens=2,
                                          temperature=0).usage.completion_tokens == 2
    assert s.request("GET", "/v1/stats")[0] == 200


@pytest.fixture(scope="module")
def foreign(tiny_model, tmp_path_factory):
    """foomoe: no engine knows it. granitemoe: llama.cpp knows the name, but the file lacks its keys."""
    parts = Gguf.parse(tiny_model)
    folder = tmp_path_factory.mktemp("foreign")
    made = {}
    for arch in ("foomoe", "granitemoe"):
        made[arch] = folder / f"{arch}.gguf"
        made[arch].write_bytes(parts.edit(lambda g, a=arch: g.rename_arch(a)))
    return made


def test_llama_cpp_says_why_a_load_failed(foreign):
    from engine.baseline.llama_load import LlamaLoadError, load_model, open_llama

    with pytest.raises(LlamaLoadError) as e:
        load_model(foreign["foomoe"])
    assert e.value.reason == "unknown model architecture: 'foomoe'"
    with pytest.raises(LlamaLoadError, match="key not found in model: granitemoe.logit_scale"):
        open_llama(foreign["granitemoe"], n_ctx=64)


def test_a_model_no_engine_runs_is_refused_before_listening(run_cli, foreign):
    for args in (("serve", str(foreign["foomoe"]), "--port", "0"),
                 ("serve", str(foreign["foomoe"]), "--port", "0", "--engine", "hybrid"),
                 ("plan", str(foreign["foomoe"]))):
        r = run_cli(*args)
        assert r.returncode == 2 and "serving" not in r.stderr, (args, r.stderr)
        assert r.stderr.strip().splitlines() == [
            "moestudio: error: neither engine can run this model: architecture 'foomoe' is not supported by the "
            "MoE Studio engine (supported: deepseek2, gpt-oss, llama, olmoe, qwen2moe, qwen3moe); "
            "llama.cpp: unknown model architecture: 'foomoe'"], args
        assert "serve with" not in r.stdout
    r = run_cli("serve", str(foreign["foomoe"]), "--port", "0", "--engine", "llamacpp")
    assert r.returncode == 2 and r.stderr.strip() == (
        "moestudio: error: llama.cpp cannot run this model: unknown model architecture: 'foomoe'")


def test_a_failed_llama_cpp_load_says_why_on_health(serve, foreign):
    s = serve(foreign["granitemoe"])  # auto picks llama.cpp, whose full load then fails
    status, health = s.request("GET", "/health")
    assert status == 503 and health["status"] == "error" and health["engine"] is None
    assert health["error"].endswith("error loading model hyperparameters: key not found in model: "
                                    "granitemoe.logit_scale"), health
    assert health["error"] in "".join(s.log)
    status, body = s.request("POST", "/v1/chat/completions", {"messages": USER})
    assert status == 503 and "granitemoe.logit_scale" in body["error"]["message"]

