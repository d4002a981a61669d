"""The tool-call formats of gpt-oss (harmony), Mistral, DeepSeek, GLM and Qwen3-Coder beside Hermes and
bare JSON (engine/server/tool_formats.py): parsing the real formats (values of the XML formats typed by
the tool's schema), streamed in pieces that split markers, the forced-call grammar of each family, and
each family end to end through the real server with a synthetic model whose tokenizer carries that
family's special tokens and template, with the official `openai` and `anthropic` clients."""
from __future__ import annotations

import json

import pytest

from engine.server.tool_formats import Reply, ToolFormat, family_of
from engine.synth.spec import preset
from engine.synth.tokenizer import CHAT_FAMILIES, SPECIAL_TOKENS
from tests.server.test_tools import CLAUDE_TOOLS, SCHEMAS, TOOLS, USER, claude, oai

# A tool whose parameters cover the JSON types: the XML formats write every value as text.
CONFIGURE = {"type": "object", "properties": {
    "path": {"type": "string"}, "options": {"type": "object"}, "tags": {"type": "array", "items": {"type": "string"}},
    "dry_run": {"type": "boolean"}, "note": {"type": ["string", "null"]}, "count": {"anyOf": [{"type": "integer"},
                                                                                              {"type": "null"}]},
    "level": {"$ref": "#/$defs/Level"}, "ratio": {"type": "number"}}, "$defs": {"Level": {"enum": ["1", "2"]}}}
NAMES = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}},
         "add": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
         "configure": CONFIGURE}
GLM = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<think>", "</think>",
       "<|user|>", "<|observation|>", "<|endoftext|>")
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
    "glm": "{{ '\\n<tool_call>' + tc.name }}\n{% for k, v in _args.items() %}\n<arg_key>{{ k }}</arg_key>\n"
           "<arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}</arg_value>",
    "qwen3-coder": "{{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
                   "{{- '<parameter=' + args_name + '>\\n' }}",
    "json": "{{ '<|im_start|>' + message['role'] }}",
}
FORMATS = {"harmony": ToolFormat(TEMPLATES["harmony"], HARMONY), "mistral": ToolFormat(TEMPLATES["mistral"], MISTRAL),
           "mistral-v3": ToolFormat(TEMPLATES["mistral-v3"], MISTRAL),
           "deepseek": ToolFormat(TEMPLATES["deepseek"], DEEPSEEK),
           "hermes": ToolFormat(TEMPLATES["hermes"], SPECIAL_TOKENS), "json": ToolFormat(None, SPECIAL_TOKENS),
           "glm": ToolFormat(TEMPLATES["glm"], GLM), "qwen3-coder": ToolFormat(TEMPLATES["qwen3-coder"], SPECIAL_TOKENS)}


@pytest.mark.parametrize("name, family", [
    ("harmony", "harmony"), ("mistral", "mistral"), ("mistral-v3", "mistral"), ("deepseek", "deepseek"),
    ("deepseek-v3.1", "deepseek"), ("hermes", "hermes"), ("json", "json"), ("glm", "glm"),
    ("qwen3-coder", "qwen3-coder")])
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
    # GLM-4.5/4.6 (as its template writes calls); reasoning first, then the call
    ("glm", '\n<think>The user wants weather.</think>\nLet me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n'
            '<arg_value>Paris</arg_value>\n</tool_call>', "Let me check.", [W]),
    ("glm", '<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n<arg_key>b</arg_key>\n<arg_value>2'
            '</arg_value>\n</tool_call>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>'
            '\n</tool_call>', "", [A, W]),
    ("glm", '<tool_call>configure\n<arg_key>path</arg_key>\n<arg_value>007</arg_value>\n<arg_key>options</arg_key>\n'
            '<arg_value>{"a": [1, 2]}</arg_value>\n<arg_key>tags</arg_key>\n<arg_value>["x", "y"]</arg_value>\n'
            '<arg_key>dry_run</arg_key>\n<arg_value>true</arg_value>\n<arg_key>note</arg_key>\n<arg_value>null'
            '</arg_value>\n<arg_key>count</arg_key>\n<arg_value>3</arg_value>\n<arg_key>level</arg_key>\n<arg_value>2'
            '</arg_value>\n<arg_key>ratio</arg_key>\n<arg_value>0.5</arg_value>\n</tool_call>', "",
     [("configure", {"path": "007", "options": {"a": [1, 2]}, "tags": ["x", "y"], "dry_run": True, "note": None,
                     "count": 3, "level": "2", "ratio": 0.5})]),
    ("glm", '<tool_call>nope\n<arg_key>x</arg_key>\n<arg_value>1</arg_value>\n</tool_call>', "nope\nx\n1\n", []),
    ("glm", '\n<think></think>\nIt is sunny.', "It is sunny.", []),
    # Qwen3-Coder (as its template writes calls); a multi-line string stays as written, numbers are numbers
    ("qwen3-coder", 'I will add them.\n<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n'
                    '</parameter>\n</function>\n</tool_call>', "I will add them.", [A]),
    ("qwen3-coder", '<tool_call>\n<function=configure>\n<parameter=path>\nline 1\n  line "2"\n</parameter>\n'
                    '<parameter=note>\nnull\n</parameter>\n<parameter=tags>\n["a"]\n</parameter>\n<parameter=level>\n'
                    '1\n</parameter>\n</function>\n</tool_call>', "",
     [("configure", {"path": 'line 1\n  line "2"', "note": None, "tags": ["a"], "level": "1"})]),
    # ...the <tool_call> opener left out (Qwen3-Coder sometimes does; llama.cpp reads it too)
    ("qwen3-coder", '<function=get_weather>\n<parameter=city>\n123\n</parameter>\n</function>\n</tool_call>', "",
     [("get_weather", {"city": "123"})]),
    ("qwen3-coder", '<tool_call>\n<function=get_weather>\n<parameter=city>\nPar', '<tool_call>\n<function=get_weather>'
                    '\n<parameter=city>\nPar', []),  # cut off: text
]


def _markers(fmt: ToolFormat) -> list[str]:
    return [m for m in fmt.specials if len(m) > 2]


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_parse_real_formats(fmt, text, content, calls):
    reply = FORMATS[fmt].split(text, NAMES)
    assert (reply.content, [(c.name, c.arguments) for c in reply.calls]) == (content, calls)


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_streamed_in_any_pieces_no_marker_leaks(fmt, text, content, calls):
    """Fed one character at a time (every marker split at every place), and in two pieces cut at every
    place: the streamed content plus the tail is the content, and no marker text is ever streamed."""
    from engine.server.tools import Reading, ReplyFilter

    reading = Reading(FORMATS[fmt], NAMES)
    cuts = [list(text)] + [[text[:i], text[i:]] for i in range(len(text) + 1)]
    for pieces in cuts:
        f = ReplyFilter(reading)
        streamed = [f.feed(p)[0] for p in pieces]
        last = f.finish()
        assert "".join(streamed) + last.content == content, pieces
        assert [(c.name, c.arguments) for c in last.calls] == calls
        for piece in streamed:
            assert not any(m in piece for m in _markers(FORMATS[fmt])), (pieces, piece)


# (format, tools offered, the reply, its content, its reasoning): gpt-oss's channels with and without
# tools (the form its template and the harmony format write), GLM's <think> opening.
REASONING = [
    ("harmony", {}, '<|channel|>analysis<|message|>User greets. Answer briefly.<|end|><|start|>assistant<|channel|>'
                    'final<|message|>Hello! How can I help?', "Hello! How can I help?", "User greets. Answer briefly."),
    ("harmony", {}, '<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>analysis<|message|> More.'
                    '<|end|><|start|>assistant<|channel|>final <|constrain|>json<|message|>{"a": 1}', '{"a": 1}',
     "Think. More."),
    ("harmony", {}, '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
     "", ""),  # a call without tools: neither content nor a call
    ("harmony", NAMES, '<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary '
                       'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}', "", "Need weather."),
    ("harmony", {}, "plain words", "plain words", ""),
    ("glm", {}, '\n<think>Short answer.</think>\nHi there.', "Hi there.", "Short answer."),
    ("glm", NAMES, '<think>Call it.</think>\n<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n'
                   '</tool_call>', "", "Call it."),
    ("glm", {}, "No thinking here.", "No thinking here.", ""),
]


@pytest.mark.parametrize("fmt, tools, text, content, reasoning", REASONING)
def test_reasoning_is_read_apart_from_content_streamed_or_not(fmt, tools, text, content, reasoning):
    """The reasoning (harmony's analysis channel, GLM's <think>) is never content; streamed in any pieces
    (markers split everywhere), content and reasoning each add up to what the whole reply gives."""
    from engine.server.tools import Reading, ReplyFilter

    reading = Reading(FORMATS[fmt], tools)
    whole = reading.parse(text)
    assert (whole.content, whole.reasoning) == (content, reasoning)
    for pieces in [list(text)] + [[text[:i], text[i:]] for i in range(len(text) + 1)]:
        f = ReplyFilter(reading)
        streamed = [f.feed(p) for p in pieces]
        last = f.finish()
        assert "".join(c for c, _ in streamed) + last.content == content, pieces
        assert "".join(r for _, r in streamed) + last.reasoning in (reasoning, reasoning + "\n"), pieces
        assert not any(m in piece for pair in streamed for piece in pair for m in _markers(FORMATS[fmt]))


@pytest.mark.parametrize("family", ["glm", "qwen3-coder"])
def test_xml_calls_read_back_as_the_model_template_writes_them(family, family_model):
    """Calls rendered by the model's own template (GLM-4.6's and Qwen3-Coder's, as llama.cpp keeps them)
    read back to the same arguments, typed by the schema: a string of digits stays a string."""
    from engine.runtime.tokenizer import Tokenizer
    from engine.server.tools import Reading, template_messages, tool_format

    tokenizer = Tokenizer(family_model(family))
    arguments = [{"path": "007", "options": {"a": [1, "b"]}, "tags": ["x"], "dry_run": False, "note": None,
                  "count": 12, "level": "2", "ratio": 2.5}, {"city": "São Paulo\nBrazil"}]
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
             for i, (name, args) in enumerate(zip(["configure", "get_weather"], arguments))]
    history = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    tools = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in NAMES.items()]
    prompt = tokenizer.render_chat(template_messages(history, tokenizer), add_generation_prompt=False, tools=tools)
    opening = {"glm": "<|assistant|>", "qwen3-coder": "<|im_start|>assistant\n"}[family]
    reply = prompt[prompt.rindex(opening) + len(opening):]  # the assistant turn, as the model writes it
    got = Reading(tool_format(tokenizer), NAMES).parse(reply)
    assert [(c.name, c.arguments) for c in got.calls] == list(zip(["configure", "get_weather"], arguments))
    assert got.content == ""


def test_without_tools_everything_is_content_but_markers():
    fmt = FORMATS["mistral"]
    assert fmt.split('[TOOL_CALLS]add[ARGS]{"a": 1}', {}) == Reply('add{"a": 1}', [])
    assert FORMATS["json"].split('{"name": "add", "arguments": {}}', {}) == Reply('{"name": "add", "arguments": {}}', [])


# ---- end to end: synthetic models of each family ----------------------------------------------

FAMILIES = ["harmony", "mistral", "mistral-v3", "deepseek", "deepseek-v3.1", "glm", "qwen3-coder"]
FIRST_MARKER = {"harmony": "<|channel|>", "mistral": "[TOOL_CALLS]", "mistral-v3": "[TOOL_CALLS]",
                "deepseek": "<｜tool▁calls▁begin｜>", "deepseek-v3.1": "<｜tool▁calls▁begin｜>", "glm": "<tool_call>",
                "qwen3-coder": "<tool_call>"}


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


@pytest.mark.parametrize("family, engine", [(f, "hybrid") for f in FAMILIES] + [
    (f, "llamacpp") for f in ("harmony", "deepseek", "mistral", "glm", "qwen3-coder")])
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
    from engine.server.tools import template_messages

    s = family_server(family)
    tokenizer = Tokenizer(family_model(family))
    r = oai(s).chat.completions.create(model="m", messages=USER, tools=TOOLS, max_tokens=12, temperature=0)
    text = r.choices[0].message.content or ""
    assert not any(m in text for m in tokenizer.special_texts)
    # content "" (the server reads null as "", which GLM's template would otherwise print as None)
    history = [*USER, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "GetWeather",
                                                          "arguments": '{"city": "Paris", "unit": "C"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    r = oai(s).chat.completions.create(model="m", messages=history, tools=TOOLS, max_tokens=2)
    # GLM's and Qwen3-Coder's templates take arguments as an object: the server parses the client's string
    prompt = tokenizer.render_chat(template_messages(history, tokenizer), tools=TOOLS)
    assert "18 degrees, sunny" in prompt and FIRST_MARKER[family] in prompt
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt, parse_special=True))


# ---- gpt-oss without tools: content is the final channel, reasoning the analysis channel -----------

def _text(entries) -> str:
    return b"".join(bytes(e.bytes) for e in entries).decode("utf-8", errors="replace")


@pytest.mark.parametrize("engine", ["hybrid", "llamacpp"])
def test_harmony_reply_without_tools_is_read_by_channel(family_server, engine):
    """A JSON reply from gpt-oss is written in its format (`<|channel|>final<|message|>` first, after an
    analysis message if the model reasons, as llama.cpp's grammar has it): the content is exactly the
    final channel's JSON, the analysis comes back as `reasoning_content`, never as content, streamed
    alike. The logprobs show what the model wrote."""
    s = family_server("harmony", engine)
    client = oai(s)
    reasoned = 0
    for seed in (1, 2, 3, 4, 5):
        r = client.chat.completions.parse(model="m", messages=USER, response_format=SCHEMAS["Add"], max_tokens=80,
                                          temperature=1.0, seed=seed, logprobs=True)
        message, entries = r.choices[0].message, r.choices[0].logprobs.content
        assert isinstance(message.parsed, SCHEMAS["Add"]) and "<|" not in message.content
        assert entries[0].token == "<|channel|>"  # the model wrote a harmony header, the content has none
        bodies = [i + 1 for i, e in enumerate(entries) if e.token == "<|message|>"]  # where each message's text begins
        assert message.content == _text(entries[bodies[-1]:])  # the final channel's text, exactly
        reasoning = (message.model_extra or {}).get("reasoning_content")
        if len(bodies) == 2:  # an analysis message first
            reasoned += 1
            end = [e.token for e in entries].index("<|end|>")
            assert _text(entries[1:bodies[0] - 1]) == "analysis" and reasoning == _text(entries[bodies[0]:end])
        else:
            assert reasoning is None
        # Streamed, the same seed gives the same reply: content and reasoning deltas add up to it.
        contents, thoughts = [], []
        with client.chat.completions.stream(model="m", messages=USER, response_format=SCHEMAS["Add"], max_tokens=80,
                                            temperature=1.0, seed=seed, logprobs=True) as stream:
            for event in stream:
                if event.type == "chunk" and event.chunk.choices:
                    delta = event.chunk.choices[0].delta
                    contents.append(delta.content or "")
                    thoughts.append((delta.model_extra or {}).get("reasoning_content") or "")
        assert "".join(contents) == message.content and "".join(thoughts) == (reasoning or "")
    assert reasoned, "no seed reasoned first: the analysis channel went untested"


def test_harmony_reasoning_in_anthropic_thinking_and_ollama_thinking(family_server):
    """The same sampled reply (one seed) through the three APIs: Anthropic gives the analysis as a thinking
    block only when thinking is enabled (streamed as thinking_delta), Ollama as `thinking`; the text is
    the final channel."""
    import ollama

    s = family_server("harmony")
    schema = SCHEMAS["Add"].model_json_schema()
    sampling = {"temperature": 1.0, "seed": 0}
    for seed in range(1, 9):  # a seed whose reply reasons first
        sampling["seed"] = seed
        r = oai(s).chat.completions.create(model="m", messages=USER, max_tokens=60, **sampling, response_format={
            "type": "json_schema", "json_schema": {"name": "Add", "schema": schema}})
        content, reasoning = r.choices[0].message.content, (r.choices[0].message.model_extra or {}).get(
            "reasoning_content")
        if reasoning:
            break
    assert reasoning, "no seed reasoned first"
    SCHEMAS["Add"].model_validate_json(content)
    # (this anthropic client takes temperature only as an extra field; seed is this server's extension)
    extra = {"output_config": {"format": {"type": "json_schema", "schema": schema}}, **sampling}
    thinking = {"type": "enabled", "budget_tokens": 1024}
    plain = claude(s).messages.create(model="m", max_tokens=60, messages=USER, extra_body=extra)
    assert [(b.type, b.text) for b in plain.content] == [("text", content)]
    shown = claude(s).messages.create(model="m", max_tokens=60, messages=USER, thinking=thinking, extra_body=extra)
    expected = [("thinking", reasoning), ("text", content)]
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in shown.content] == expected
    with claude(s).messages.stream(model="m", max_tokens=60, messages=USER, thinking=thinking,
                                   extra_body=extra) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == expected
    assert "thinking" in events and events.index("thinking") < events.index("text")
    reply = ollama.Client(host=s.url).chat(model="m", messages=USER, format=schema,
                                           options={**sampling, "num_predict": 60})
    assert (reply.message.content, reply.message.thinking) == (content, reasoning)
    streamed = list(ollama.Client(host=s.url).chat(model="m", messages=USER, format=schema, stream=True,
                                                   options={**sampling, "num_predict": 60}))
    assert "".join(p.message.content for p in streamed) == content
    assert "".join(p.message.thinking or "" for p in streamed) == reasoning


@pytest.mark.parametrize("family, engine", [("harmony", "hybrid"), ("harmony", "llamacpp"), ("glm", "hybrid")])
def test_plain_chat_shows_no_markers(family_server, family, engine):
    """Free text from the random gpt-oss- or GLM-format model, streamed and not: never a marker in content."""
    s = family_server(family, engine)
    markers = {"harmony": HARMONY, "glm": GLM}[family]
    for seed in (1, 2, 3):
        r = oai(s).chat.completions.create(model="m", messages=USER, max_tokens=40, temperature=1.5, seed=seed)
        streamed = "".join(c.choices[0].delta.content or "" for c in oai(s).chat.completions.create(
            model="m", messages=USER, max_tokens=40, temperature=1.5, seed=seed, stream=True) if c.choices)
        for text in (r.choices[0].message.content, streamed):
            assert not any(m in text for m in markers)
        assert streamed == r.choices[0].message.content
