"""The tool-call formats of gpt-oss (harmony), Mistral and DeepSeek beside Hermes and bare JSON
(engine/server/tool_formats.py): parsing the real formats, streamed in pieces that split markers,
the forced-call grammar of each family, and each family end to end through the real server with a
synthetic model whose tokenizer carries that family's special tokens and template, with the
official `openai` and `anthropic` clients."""
from __future__ import annotations

import pytest

from engine.server.tool_formats import ToolFormat, family_of
from engine.synth.spec import preset
from engine.synth.tokenizer import CHAT_FAMILIES, SPECIAL_TOKENS
from tests.server.test_tools import CLAUDE_TOOLS, SCHEMAS, TOOLS, USER, claude, oai

NAMES = frozenset({"get_weather", "add"})
HARMONY = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|return|>", "<|call|>")
MISTRAL = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "</s>")
DEEPSEEK = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
            "<｜tool▁sep｜>", "<｜end▁of▁sentence｜>")

# The lines of the real templates (llama.cpp's models/templates) that decide the family.
TEMPLATES = {
    "harmony": "{{- \"<|start|>assistant<|channel|>commentary to=functions.\" + tool_call.name }}",
    "mistral": "{{- '[TOOL_CALLS]' + tool_call.function.name }}{{- '[ARGS]' + tool_call['function']['arguments']|tojson }}",
    "mistral-v3": '{{- "[TOOL_CALLS][" }}',
    "deepseek": "{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + "
                "tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] | tojson}}",
    "deepseek-v3.1": "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>' + "
                     "tool['function']['arguments'] | tojson + '<｜tool▁call▁end｜>'}}",
    "hermes": "{{- '<tool_call>\\n{\"name\": \"' }}",
    "json": "{{ '<|im_start|>' + message['role'] }}",
}
FORMATS = {"harmony": ToolFormat(TEMPLATES["harmony"], HARMONY), "mistral": ToolFormat(TEMPLATES["mistral"], MISTRAL),
           "mistral-v3": ToolFormat(TEMPLATES["mistral-v3"], MISTRAL),
           "deepseek": ToolFormat(TEMPLATES["deepseek"], DEEPSEEK),
           "hermes": ToolFormat(TEMPLATES["hermes"], SPECIAL_TOKENS), "json": ToolFormat(None, SPECIAL_TOKENS)}


@pytest.mark.parametrize("name, family", [
    ("harmony", "harmony"), ("mistral", "mistral"), ("mistral-v3", "mistral"), ("deepseek", "deepseek"),
    ("deepseek-v3.1", "deepseek"), ("hermes", "hermes"), ("json", "json")])
def test_the_family_comes_from_the_template(name, family):
    assert family_of(TEMPLATES[name]) == family
    if name in CHAT_FAMILIES:  # the synthetic models' templates are of the family they are named after
        assert family_of(CHAT_FAMILIES[name].template) == family


W = ("get_weather", {"city": "Paris"})
A = ("add", {"a": 1, "b": 2})
# (format, the reply as decoded with special tokens, its content, its calls)
CASES = [
    # gpt-oss: reasoning, then a call with the recipient in the channel header (the form gpt-oss writes)
    ("harmony", '<|channel|>analysis<|message|>User asks weather. Call it.<|end|><|start|>assistant<|channel|>'
                'commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}', "", [W]),
    # ...the recipient in the role header, two calls in a row (<|call|> ends each when the model goes on)
    ("harmony", ' to=functions.add<|channel|>commentary json<|message|>{"a": 1, "b": 2}<|call|><|start|>assistant'
                '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
     "", [A, W]),
    ("harmony", '<|channel|>analysis<|message|>Just answer.<|end|><|start|>assistant<|channel|>final<|message|>'
                'It is sunny in Paris.', "It is sunny in Paris.", []),
    ("harmony", '<|channel|>commentary<|message|>Checking the weather.<|end|><|start|>assistant<|channel|>commentary '
                'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}', "Checking the weather.", [W]),
    ("harmony", '<|channel|>commentary to=functions.nope <|constrain|>json<|message|>{}', "", []),  # not offered
    ("harmony", 'no structure at all', "no structure at all", []),
    # Devstral / Ministral 3: NAME[ARGS]{...} per call
    ("mistral", 'Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "Let me check.", [W]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}', "", [W, A]),
    ("mistral", '[TOOL_CALLS]add[CALL_ID]a1B2c3D4e[ARGS]{"a": 1, "b": 2}', "", [A]),  # Mistral Small 3.2
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": ', 'get_weather{"city": ', []),  # cut off: text
    # v3 (Mixtral 8x22B, Nemo): a JSON array
    ("mistral-v3", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcdefghi"}, '
                   '{"name": "add", "arguments": {"a": 1, "b": 2}}]', "", [W, A]),
    ("mistral-v3", 'Plain answer.', "Plain answer.", []),
    # V3 / R1
    ("deepseek", 'Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
                 '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n'
                 '{"a": 1, "b": 2}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "Sure.", [W, A]),
    # V3.1
    ("deepseek", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{"a": 1, "b": 2}<｜tool▁call▁end｜>'
                 '<｜tool▁calls▁end｜>', "", [A]),
    ("deepseek", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{"a": 1,<｜tool▁call▁end｜>',
     'add{"a": 1,', []),  # malformed: the text without markers
    ("hermes", 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>', "Sure.", [A]),
    ("json", '{"name": "get_weather", "arguments": {"city": "Paris"}}', "", [W]),
    ("json", '[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", "parameters": {"city": "Paris"}}]',
     "", [A, W]),
    ("mistral", '{"name": "add", "arguments": {"a": 1, "b": 2}}', "", [A]),  # every family reads bare JSON
]


def _markers(fmt: ToolFormat) -> list[str]:
    return [m for m in fmt.specials if len(m) > 2]


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_parse_real_formats(fmt, text, content, calls):
    got_content, got = FORMATS[fmt].split(text, NAMES)
    assert (got_content, [(c.name, c.arguments) for c in got]) == (content, calls)


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_streamed_in_any_pieces_no_marker_leaks(fmt, text, content, calls):
    """Fed one character at a time (every marker split at every place), and in two pieces cut at every
    place: the streamed content plus the tail is the content, and no marker text is ever streamed."""
    from engine.server.tools import CallFilter, Tool, ToolUse

    use = ToolUse(tuple(Tool(n, "", {"type": "object"}) for n in NAMES), None, FORMATS[fmt])
    cuts = [list(text)] + [[text[:i], text[i:]] for i in range(len(text) + 1)]
    for pieces in cuts:
        f = CallFilter(use)
        streamed = [f.feed(p) for p in pieces]
        tail, got = f.finish()
        assert "".join(streamed) + tail == content, pieces
        assert [(c.name, c.arguments) for c in got] == calls
        for piece in streamed:
            assert not any(m in piece for m in _markers(FORMATS[fmt])), (pieces, piece)


def test_without_tools_everything_is_content_but_markers():
    fmt = FORMATS["mistral"]
    assert fmt.split('[TOOL_CALLS]add[ARGS]{"a": 1}', frozenset()) == ('add{"a": 1}', [])
    assert FORMATS["json"].split('{"name": "add", "arguments": {}}', frozenset()) == (
        '{"name": "add", "arguments": {}}', [])


# ---- end to end: synthetic models of each family ----------------------------------------------

FAMILIES = ["harmony", "mistral", "mistral-v3", "deepseek", "deepseek-v3.1"]
FIRST_MARKER = {"harmony": "<|channel|>", "mistral": "[TOOL_CALLS]", "mistral-v3": "[TOOL_CALLS]",
                "deepseek": "<｜tool▁calls▁begin｜>", "deepseek-v3.1": "<｜tool▁calls▁begin｜>"}


@pytest.fixture(scope="module")
def family_model(make_model):
    return lambda family: make_model(preset("tiny", "qwen3moe").with_(chat=family, name=f"tiny-{family}"))


@pytest.fixture(scope="module")
def family_server(serve, family_model):
    started = {}

    def get(family: str, engine: str = "hybrid"):
        if (family, engine) not in started:
            started[family, engine] = serve(family_model(family), "--engine", engine, "-c", "1024")
        return started[family, engine]
    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_the_forced_grammar_starts_with_the_family_marker_token(family, family_model):
    """The grammar forces the marker as its special token (as the model writes it), not spelled out."""
    import torch

    from engine.layers.grammar import TokenGrammar
    from engine.runtime.tokenizer import Tokenizer
    from engine.server.tools import Tool, ToolUse, call_grammar, tool_format

    tokenizer = Tokenizer(family_model(family))
    use = ToolUse((Tool("add", "", SCHEMAS["Add"].model_json_schema()),), ("add",), tool_format(tokenizer))
    grammar = TokenGrammar(call_grammar(use, tokenizer), tokenizer, tokenizer.n_vocab)
    allowed = grammar.allowed(1000, torch.zeros(tokenizer.n_vocab))
    marker = tokenizer.special_token(FIRST_MARKER[family])
    assert marker is not None and allowed.nonzero().flatten().tolist() == [marker]


def _check_call(call, names):
    assert call.function.name in names
    assert isinstance(call.function.parsed_arguments, SCHEMAS[call.function.name])


@pytest.mark.parametrize("family, engine", [(f, "hybrid") for f in FAMILIES] + [("harmony", "llamacpp"),
                                                                             ("deepseek", "llamacpp"),
                                                                             ("mistral", "llamacpp")])
def test_forced_calls_end_to_end(family_server, family, engine):
    s = family_server(family, engine)
    client = oai(s)
    r = client.chat.completions.parse(model="m", messages=USER, tools=TOOLS, tool_choice="required", max_tokens=80,
                                      temperature=1.0, seed=3)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    _check_call(choice.message.tool_calls[0], {"GetWeather", "Add"})
    # Streamed: no content delta carries text (no marker leaks), and the SDK assembles the call.
    named = {"type": "function", "function": {"name": "Add"}}
    with client.chat.completions.stream(model="m", messages=USER, tools=TOOLS, tool_choice=named, max_tokens=80,
                                        temperature=0) as stream:
        contents = [e.delta for e in stream if e.type == "content.delta"]
        final = stream.get_final_completion()
    assert "".join(contents) == "" and final.choices[0].finish_reason == "tool_calls"
    assert len(final.choices[0].message.tool_calls) == 1
    _check_call(final.choices[0].message.tool_calls[0], {"Add"})
    # Anthropic `any`, streamed: only a tool_use block.
    with claude(s).messages.stream(model="m", max_tokens=80, messages=USER, tools=CLAUDE_TOOLS,
                                   tool_choice={"type": "any"}) as stream:
        events = [e for e in stream]
        message = stream.get_final_message()
    assert message.stop_reason == "tool_use" and [b.type for b in message.content] == ["tool_use"]
    SCHEMAS[message.content[0].name].model_validate(message.content[0].input)
    assert not [e for e in events if e.type == "text"]


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_text_and_results_rendered_back(family_server, family_model, family):
    """With tool_choice auto the random model answers in text: content free of marker text. A call and
    its result are rendered back by the family's template (the prompt counts match)."""
    from engine.runtime.tokenizer import Tokenizer

    s = family_server(family)
    tokenizer = Tokenizer(family_model(family))
    r = oai(s).chat.completions.create(model="m", messages=USER, tools=TOOLS, max_tokens=12, temperature=0)
    text = r.choices[0].message.content or ""
    assert not any(m in text for m in tokenizer.special_texts)
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "GetWeather",
                                                          "arguments": '{"city": "Paris", "unit": "C"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    r = oai(s).chat.completions.create(model="m", messages=history, tools=TOOLS, max_tokens=2)
    prompt = tokenizer.render_chat(history, tools=TOOLS)
    assert "18 degrees, sunny" in prompt and FIRST_MARKER[family] in prompt
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt, parse_special=True))
