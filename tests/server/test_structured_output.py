"""response_format json_object and json_schema through the official `openai` client, on both engines:
the random-weight test model's output always parses and matches the schema (engine/layers/grammar.py)."""
from __future__ import annotations

import json
from typing import Annotated, Literal

import openai
import pytest
from pydantic import BaseModel, Field

USER = [{"role": "user", "content": "Describe a palette as JSON."}]


class Colour(BaseModel):
    name: str
    hex: Annotated[str, Field(pattern=r"^#[0-9a-f]{6}$")]
    rank: Annotated[int, Field(ge=1, le=10)]
    primary: bool
    kind: Literal["warm", "cool"]


class Palette(BaseModel):
    title: str
    colours: list[Colour]
    weights: list[float]


@pytest.fixture(scope="module")
def clients(server, serve, tiny_model) -> dict[str, openai.OpenAI]:
    llama = serve(tiny_model, "--engine", "llamacpp", "-c", "1024")
    return {name: openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)
            for name, s in (("hybrid", server), ("llamacpp", llama))}


ENGINES = pytest.mark.parametrize("engine", ["hybrid", "llamacpp"])


@ENGINES
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_schema_output_parses_and_matches(clients, engine, seed):
    r = clients[engine].chat.completions.parse(model="m", messages=USER, response_format=Palette, max_tokens=160,
                                               temperature=1.0, seed=seed)
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, Palette)  # the client validated it against the model (strictly)
    assert Palette.model_validate_json(choice.message.content) == choice.message.parsed


@ENGINES
def test_json_schema_streamed(clients, engine):
    with clients[engine].chat.completions.stream(model="m", messages=USER, response_format=Palette, max_tokens=160,
                                                 temperature=0) as stream:
        final = stream.get_final_completion()
    parsed = final.choices[0].message.parsed
    assert isinstance(parsed, Palette)
    whole = clients[engine].chat.completions.parse(model="m", messages=USER, response_format=Palette,
                                                   max_tokens=160, temperature=0)
    assert whole.choices[0].message.parsed == parsed  # greedy: streaming changes nothing


@ENGINES
def test_json_object_mode(clients, engine):
    for seed in (1, 2):
        r = clients[engine].chat.completions.create(model="m", messages=USER, max_tokens=80, temperature=1.0, seed=seed,
                                                    response_format={"type": "json_object"})
        assert isinstance(json.loads(r.choices[0].message.content), dict), r.choices[0].message.content


@pytest.mark.parametrize("max_tokens", [30, 45, 70])
def test_a_tight_budget_still_closes_the_document(clients, max_tokens):
    """Near the end of max_tokens the grammar steers to the quickest close (strings, arrays, objects)."""
    schema = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "array", "items": {
        "type": "object", "properties": {"c": {"type": "string"}}, "required": ["c"]}}}, "required": ["a", "b"]}
    r = clients["hybrid"].chat.completions.create(
        model="m", messages=USER, max_tokens=max_tokens, temperature=1.0, seed=max_tokens,
        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}})
    doc = json.loads(r.choices[0].message.content)
    assert isinstance(doc["a"], str) and all(isinstance(item["c"], str) for item in doc["b"])
    assert r.usage.completion_tokens <= max_tokens


@pytest.mark.parametrize("fmt, words", [
    ({"type": "xml"}, "must be text, json_object or json_schema"),
    ({"type": "json_schema"}, "'response_format.json_schema' is required"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}, "JSON schema cannot be used"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "must be a JSON schema object"),
])
def test_bad_response_formats_are_refused(clients, fmt, words):
    with pytest.raises(openai.BadRequestError) as e:
        clients["hybrid"].chat.completions.create(model="m", messages=USER, max_tokens=4, response_format=fmt)
    assert words in e.value.body["message"] and e.value.body["param"] == "response_format"


def test_text_format_is_free_text(clients):
    r = clients["hybrid"].chat.completions.create(model="m", messages=USER, max_tokens=4, temperature=0,
                                                  response_format={"type": "text"})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4


@pytest.fixture(scope="module")
def claude(server):
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120)


def test_anthropic_structured_output(claude):
    import anthropic

    for seed in (1, 2):
        r = claude.messages.parse(model="m", max_tokens=160, messages=USER, output_format=Palette,
                                  extra_body={"temperature": 1.0, "seed": seed})
        assert r.stop_reason == "end_turn" and isinstance(r.parsed_output, Palette)
    with claude.messages.stream(model="m", max_tokens=160, messages=USER, output_format=Palette,
                                extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    assert isinstance(final.parsed_output, Palette)
    with pytest.raises(anthropic.BadRequestError, match="output_config.format"):
        claude.messages.create(model="m", max_tokens=4, messages=USER,
                               output_config={"format": {"type": "json_schema", "schema": {"type": "nonsense"}}})
