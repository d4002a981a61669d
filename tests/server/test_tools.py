"""Tool calling through the official `openai` and `anthropic` clients on both engines: tools rendered by
the model's template, forced calls valid against their schema even from the random-weight model,
calls parsed and streamed as the clients accumulate them, results rendered back."""
from __future__ import annotations

import json
from typing import Literal

import anthropic
import openai
import pytest
from pydantic import BaseModel

from engine.server.tools import Reading, ReplyFilter, Tool, ToolFormat
from engine.synth.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS
from tests.reliability.test_gguf_fuzz import Gguf, string

USER = [{"role": "user", "content": "What is the weather in Paris?"}]


class GetWeather(BaseModel):
    """The weather of a city."""
    city: str
    unit: Literal["C", "F"]


class Add(BaseModel):
    a: int
    b: int


TOOLS = [openai.pydantic_function_tool(GetWeather), openai.pydantic_function_tool(Add)]
CLAUDE_TOOLS = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
                 "input_schema": t["function"]["parameters"]} for t in TOOLS]
SCHEMAS = {"GetWeather": GetWeather, "Add": Add}


@pytest.fixture(scope="module")
def servers(server, serve, tiny_model):
    return {"hybrid": server, "llamacpp": serve(tiny_model, "--engine", "llamacpp", "-c", "1024")}


def oai(s) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)


def claude(s) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=s.url, api_key="x", max_retries=0, timeout=120)


ENGINES = pytest.mark.parametrize("engine", ["hybrid", "llamacpp"])
CHOICES = pytest.mark.parametrize("choice, names", [
    ("required", {"GetWeather", "Add"}), ({"type": "function", "function": {"name": "Add"}}, {"Add"})])


@ENGINES
@CHOICES
def test_openai_forced_call_is_valid(servers, engine, choice, names):
    for seed in (1, 2):
        r = oai(servers[engine]).chat.completions.parse(model="m", messages=USER, tools=TOOLS, tool_choice=choice,
                                                        max_tokens=80, temperature=1.0, seed=seed)
        choice_ = r.choices[0]
        assert choice_.finish_reason == "tool_calls" and len(choice_.message.tool_calls) == 1
        call = choice_.message.tool_calls[0]
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        # The client validated the arguments against the strict schema (pydantic_function_tool).
        assert isinstance(call.function.parsed_arguments, SCHEMAS[call.function.name])
        assert SCHEMAS[call.function.name].model_validate_json(call.function.arguments) == call.function.parsed_arguments


@ENGINES
@CHOICES
def test_openai_forced_call_streamed(servers, engine, choice, names):
    client = oai(servers[engine])
    with client.chat.completions.stream(model="m", messages=USER, tools=TOOLS, tool_choice=choice, max_tokens=80,
                                        temperature=0) as stream:
        final = stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert final.choices[0].finish_reason == "tool_calls" and call.function.name in names
    assert isinstance(call.function.parsed_arguments, SCHEMAS[call.function.name])
    whole = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, tool_choice=choice, max_tokens=80,
                                           temperature=0)
    assert json.loads(whole.choices[0].message.tool_calls[0].function.arguments) == json.loads(call.function.arguments)


def test_openai_auto_lets_the_model_answer_in_text(servers, tokenizer):
    r = oai(servers["hybrid"]).chat.completions.create(model="m", messages=USER, tools=TOOLS, max_tokens=6,
                                                       temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"
    # The tools reached the model through its template.
    prompt = tokenizer.render_chat(USER, tools=TOOLS)
    assert "<tools>" in prompt and '"name": "GetWeather"' in prompt
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt, parse_special=True))


def test_openai_tool_results_are_rendered_back(servers, tokenizer):
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "GetWeather",
                                                          "arguments": '{"city": "Paris", "unit": "C"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    r = oai(servers["hybrid"]).chat.completions.create(model="m", messages=history, tools=TOOLS, max_tokens=2)
    prompt = tokenizer.render_chat(history, tools=TOOLS)
    assert ('<tool_call>\n{"name": "GetWeather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>' in prompt
            and "<tool_response>\n18 degrees, sunny\n</tool_response>" in prompt)
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt, parse_special=True))


@ENGINES
@pytest.mark.parametrize("choice, names", [({"type": "any"}, {"GetWeather", "Add"}),
                                           ({"type": "tool", "name": "GetWeather"}, {"GetWeather"})])
def test_anthropic_forced_tool_use(servers, engine, choice, names):
    client = claude(servers[engine])
    r = client.messages.create(model="m", max_tokens=80, messages=USER, tools=CLAUDE_TOOLS, tool_choice=choice)
    assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["tool_use"]
    block = r.content[0]
    assert block.name in names and block.id.startswith("toolu_")
    SCHEMAS[block.name].model_validate(block.input)
    with client.messages.stream(model="m", max_tokens=80, messages=USER, tools=CLAUDE_TOOLS, tool_choice=choice,
                                extra_body={"temperature": 0}) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[-1].type == "tool_use"
    assert final.content[-1].name in names
    SCHEMAS[final.content[-1].name].model_validate(final.content[-1].input)
    assert events[0] == "message_start" and events[-1] == "message_stop" and "input_json" in events


def test_anthropic_tool_result_round_trip(servers, tokenizer):
    client = claude(servers["hybrid"])
    first = client.messages.create(model="m", max_tokens=80, messages=USER, tools=CLAUDE_TOOLS,
                                   tool_choice={"type": "tool", "name": "GetWeather"})
    call = first.content[0]
    history = [*USER, {"role": "assistant", "content": [call.model_dump(include={"type", "id", "name", "input"})]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}]}]
    counted = client.messages.count_tokens(model="m", messages=history, tools=CLAUDE_TOOLS).input_tokens
    r = client.messages.create(model="m", max_tokens=3, messages=history, tools=CLAUDE_TOOLS)
    assert r.usage.input_tokens == counted
    prompt = tokenizer.render_chat([*USER, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.input}}]},
        {"role": "tool", "content": "sunny"}], tools=[{"type": "function", "function": {
            "name": t["name"], "description": t["description"], "parameters": t["input_schema"]}} for t in CLAUDE_TOOLS])
    assert "<tool_response>\nsunny\n</tool_response>" in prompt
    assert len(tokenizer.encode(prompt, parse_special=True)) == counted


def test_bad_tool_requests(servers):
    client, c2 = oai(servers["hybrid"]), claude(servers["hybrid"])
    with pytest.raises(openai.BadRequestError, match="no tool named 'Nope'"):
        client.chat.completions.create(model="m", messages=USER, tools=TOOLS, max_tokens=2,
                                       tool_choice={"type": "function", "function": {"name": "Nope"}})
    with pytest.raises(openai.BadRequestError, match="'tool_choice' needs 'tools'"):
        client.chat.completions.create(model="m", messages=USER, max_tokens=2, tool_choice="required")
    with pytest.raises(openai.BadRequestError, match="cannot both constrain one reply"):
        client.chat.completions.create(model="m", messages=USER, max_tokens=2, tools=TOOLS, tool_choice="required",
                                       response_format={"type": "json_object"})
    with pytest.raises(anthropic.BadRequestError, match="no tool named 'Nope'"):
        c2.messages.create(model="m", messages=USER, max_tokens=2, tools=CLAUDE_TOOLS,
                           tool_choice={"type": "tool", "name": "Nope"})


@pytest.fixture(scope="module")
def no_tools_model(tiny_model, tmp_path_factory):
    from engine.runtime.tokenizer import CHATML

    path = tmp_path_factory.mktemp("notools") / "chatml-only.gguf"
    path.write_bytes(Gguf.parse(tiny_model).edit(lambda g: g.set("tokenizer.chat_template", string(CHATML))))
    return path


def test_a_template_without_tool_support_answers_400(serve, no_tools_model):
    s = serve(no_tools_model, "--engine", "hybrid", "-c", "256")
    with pytest.raises(openai.BadRequestError, match="chat-only.gguf has no tool support|has no tool support"):
        oai(s).chat.completions.create(model="m", messages=USER, tools=TOOLS, max_tokens=2)
    with pytest.raises(anthropic.BadRequestError, match="has no tool support"):
        claude(s).messages.create(model="m", messages=USER, max_tokens=2, tools=CLAUDE_TOOLS)
    assert oai(s).chat.completions.create(model="m", messages=USER, max_tokens=2,
                                         temperature=0).usage.completion_tokens == 2


# ---- parsing and the stream filter, on their own ------------------------------------------------

USE = Reading(ToolFormat(CHAT_TEMPLATE, SPECIAL_TOKENS), {"f": {"type": "object"}, "g": {"type": "object"}})


@pytest.mark.parametrize("text, content, calls", [
    ('Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>', "Sure.", [("f", {"x": 1})]),
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>\n<tool_call>{"name": "g", "arguments": {}}'
     '</tool_call>', "", [("f", {"x": 2}), ("g", {})]),
    ('{"name": "g", "arguments": {"y": [1]}}', "", [("g", {"y": [1]})]),  # the generic JSON format
    ('[{"name": "f", "parameters": {}}, {"name": "g", "arguments": {}}]', "", [("f", {}), ("g", {})]),
    ('<tool_call>{"name": "h", "arguments": {}}</tool_call>', '<tool_call>{"name": "h", "arguments": {}}</tool_call>',
     []),  # not an offered tool: text
    ('<tool_call>{"name": "f", "arguments": {</tool_call>', '<tool_call>{"name": "f", "arguments": {</tool_call>', []),
    ('{"name": "f"', '{"name": "f"', []), ("plain text", "plain text", []),
])
def test_parse_calls(text, content, calls):
    reply = USE.parse(text)
    got_content, got = reply.content, reply.calls
    assert got_content == content and [(c.name, c.arguments) for c in got] == calls


@pytest.mark.parametrize("pieces, streamed, tail, names", [
    (["Hel", "lo <tool", "_call>", '{"name": "f", "arguments": {}}', "</tool_call>"], "Hello", "", ["f"]),
    (["Hel", "lo <to", "ol time"], "Hello <tool time", "", []),
    (["Hi<|im_", "end|> there"], "Hi there", "", []),  # a control token's text never reaches the content
    (["  ", '{"name"', ': "g", "arguments": {}}'], "", "", ["g"]),
    (["{ not", " a call"], "", "{ not a call", []),
    (["a < b"], "a < b", "", []),
])
def test_call_filter_streams_text_and_holds_calls(pieces, streamed, tail, names):
    f = ReplyFilter(USE)
    sent = "".join(f.feed(p)[0] for p in pieces)
    last = f.finish()
    assert (sent, last.content, [c.name for c in last.calls]) == (streamed, tail, names)


def test_a_last_assistant_turn_of_calls_is_kept_not_continued(tokenizer):
    """Only a text turn is a prefill; a turn of calls is rendered whole, then a new assistant turn."""
    calls = [{"id": "c", "type": "function", "function": {"name": "Add", "arguments": {"a": 1, "b": 2}}}]
    prompt = tokenizer.render_chat([*USER, {"role": "assistant", "content": "", "tool_calls": calls}], tools=TOOLS)
    assert prompt.endswith('{"name": "Add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>\n'
                           "<|im_start|>assistant\n")
