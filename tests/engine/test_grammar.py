"""Constrained decoding in the engine (engine/layers/grammar.py): every budget that can hold a complete
document gets one that parses and matches, from the random-weight model, whatever the sampling."""
from __future__ import annotations

import json

import pytest

from engine.layers.grammar import json_schema_grammar, lark_grammar
from engine.layers.sampler import SamplingParams
from engine.runtime.engine import Engine, EngineConfig, Request

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
    "point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "number"}},
              "required": ["x", "y"], "additionalProperties": False}},
    "required": ["name", "tags", "point"], "additionalProperties": False}
USER = [{"role": "user", "content": "Give me JSON."}]


@pytest.fixture(scope="module")
def engine(make_model):
    return Engine.load(make_model("qwen3moe"), EngineConfig(n_ctx=512))


def generate(engine, grammar: str, max_tokens: int, temperature: float, seed: int):
    return list(engine.generate(Request(messages=USER, max_tokens=max_tokens, grammar=grammar,
                                        sampling=SamplingParams(temperature=temperature, seed=seed))))[-1]


def check(doc: dict) -> None:
    assert set(doc) == {"name", "tags", "point"} and isinstance(doc["name"], str)
    assert all(isinstance(t, str) for t in doc["tags"])
    assert isinstance(doc["point"]["x"], int) and isinstance(doc["point"]["y"], (int, float))


def test_the_smallest_budget_that_holds_a_document_is_enough(engine):
    grammar = json_schema_grammar(SCHEMA)
    # The shortest document, token by token, with the end token: found by trying budgets upwards.
    smallest = next(n for n in range(10, 60) if generate(engine, grammar, n, 0.0, 0).finish_reason == "stop")
    for budget in (smallest, smallest + 1, smallest + 7, smallest + 30, 200):
        for temperature, seed in ((0.0, 0), (1.0, 1), (1.5, 2)):
            done = generate(engine, grammar, budget, temperature, seed)
            assert done.finish_reason == "stop" and done.completion_tokens <= budget, (budget, done.text)
            check(json.loads(done.text))


def test_below_that_the_reply_is_cut_and_says_so(engine):
    done = generate(engine, json_schema_grammar(SCHEMA), 6, 1.0, 3)
    assert done.finish_reason == "length"


def test_a_lark_grammar(engine):
    grammar = lark_grammar('start: "answer: " NUMBER\nNUMBER: /[0-9]{1,4}/\n')
    for seed in range(3):
        done = generate(engine, grammar, 20, 1.0, seed)
        assert done.text.startswith("answer: ") and done.text[8:].isdigit() and len(done.text) <= 12


@pytest.mark.parametrize("closing", ["special", "suffix"])
def test_free_text_closes_within_the_budget(engine, closing):
    """Free text up to a special token (GLM's </arg_value>, harmony's <|end|>) or up to a rule's suffix
    text (Qwen3-Coder's \\n</parameter>\\n): the closing policy ends it in time, whatever the sampling."""
    marker = engine.tokenizer.special_token("<|im_start|>")  # a special token that does not end generation
    grammar = lark_grammar(f'start: "say: " TEXT <[{marker}]> "done"\nTEXT: /(.|\\n)*/\n' if closing == "special" else
                           'start: "say: " text "done"\ntext[suffix="\\n</end>\\n"]: /(.|\\n)*/\n')
    for budget in (12, 25, 60):
        for temperature, seed in ((0.0, 0), (1.0, 1), (1.5, 2)):
            done = generate(engine, grammar, budget, temperature, seed)
            assert done.finish_reason == "stop" and done.text.startswith("say: ") and done.text.endswith("done"), (
                budget, done.text)
            assert closing == "special" or done.text.endswith("\n</end>\ndone")


def test_bad_grammars_are_user_errors():
    from engine.errors import UserError

    with pytest.raises(UserError, match="cannot be used for constrained decoding"):
        json_schema_grammar({"type": "nonsense"})
    with pytest.raises(UserError, match="cannot be used for constrained decoding"):
        lark_grammar("start: undefined_rule\n")
