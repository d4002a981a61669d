"""How each chat-template family writes tool calls: which family a model's template is (decided here,
in one place), how calls (and reasoning) are read from a reply, what of a reply still being streamed
is surely content, and the grammars of exactly one forced call and of a JSON reply.

The families, as the models' own templates write calls (and llama.cpp's common/chat.cpp parses them):
- hermes (Qwen2.5/Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.
- harmony (gpt-oss): messages `<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json
  <|message|>{...}<|call|>`; the recipient may also stand in the role header (`<|start|>assistant
  to=functions.NAME<|channel|>commentary json<|message|>`). The reply's content is the text of `final`
  messages and of commentary without a recipient; the `analysis` channel (reasoning) is not content.
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (v3 templates: Mixtral 8x22B, Nemo), or
  `[TOOL_CALLS]NAME[ARGS]{...}` per call (Devstral, Ministral 3; Mistral Small 3.2 puts `[CALL_ID]id`
  before `[ARGS]`).
- deepseek: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```
  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>` (V3, R1), or `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}
  <｜tool▁call▁end｜>` (V3.1).
- glm (GLM-4.5, 4.6, 4.7): `<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n...
  </tool_call>`; the reply opens with the model's reasoning, `<think>...</think>`.
- qwen3-coder (Qwen3-Coder, Qwen3.5, Nemotron Nano 3): `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE
  \\n</parameter>\\n...</function>\\n</tool_call>`; the `<tool_call>` opener may be missing.
  In both XML families a value is text, typed by the tool's JSON schema as llama.cpp types it: a
  parameter that can only be a string keeps the text; otherwise the text is read as JSON when it parses
  to a type the schema admits (Python's True/False/None too: Qwen3-Coder's template writes those).
- json: a template with none of these markers: a reply that is one JSON object {"name", "arguments"}
  (or an array of them). Every family also reads such a bare-JSON reply.

The markers are special tokens. A request with tools decodes special tokens as text
(Request.special_tokens) so they reach this parser; content never carries them: the text of every
special token (`specials`, the tokenizer's control tokens) and of the family's markers is removed from it.
Calls to tools that were not offered and malformed calls are not calls (in the marker families their
text stays content; in harmony, a message to a function is never content).

Harmony replies carry their structure with or without tools (llama.cpp always renders `<|channel|>`,
`<|message|>`, `<|start|>` and `<|constrain|>`), and GLM's open with their reasoning, so every chat reply
of those families is read here (`ToolFormat.structured`): `Reply.content` is the final channel (what
follows `</think>`), `Reply.reasoning` the analysis channel (the think block).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Iterable, Mapping

FAMILIES = ("hermes", "harmony", "mistral", "deepseek", "glm", "qwen3-coder", "json")

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(re.escape(HERMES_OPEN) + r"\s*(.*?)\s*" + re.escape(HERMES_CLOSE), re.S)

H_START, H_CHANNEL, H_MESSAGE, H_CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
H_ENDS = ("<|end|>", "<|call|>", "<|return|>")  # what ends a harmony message
_H_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_H_CHANNEL = re.compile(re.escape(H_CHANNEL) + r"\s*(\w+)")

M_CALLS, M_ARGS, M_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_M_NAMED = re.compile(r"\s*([^\s\[\]{}]+)\s*(?:" + re.escape(M_CALL_ID) + r"\s*[^\s\[]*\s*)?" + re.escape(M_ARGS))

D_CALLS, D_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
D_CALL, D_SEP, D_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"

G_KEY, G_KEY_END, G_VALUE, G_VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
_G_ARG = re.compile(re.escape(G_KEY) + r"(.*?)" + re.escape(G_KEY_END) + r"\s*" + re.escape(G_VALUE) + r"(.*?)"
                    + re.escape(G_VALUE_END), re.S)
Q_FUNCTION, Q_PARAMETER, Q_VALUE_END = "<function=", "<parameter=", "\n</parameter>\n"
_Q_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_Q_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)

# Families whose replies open with the model's reasoning between these tags (GLM-4.5: `<think>...</think>`,
# empty when thinking is off), read as Reply.reasoning.
T_OPEN, T_CLOSE = "<think>", "</think>"
THINKING = frozenset({"glm"})
# Where the calls of a reply begin, per marker family (json: nowhere; harmony has its own structure).
CALL_START = {"hermes": (HERMES_OPEN,), "mistral": (M_CALLS,), "deepseek": (D_CALLS,), "glm": (HERMES_OPEN,),
              "qwen3-coder": (HERMES_OPEN, Q_FUNCTION)}
# Structure markers removed from content (hermes and qwen3-coder keep their tags: plain text in most
# vocabularies; GLM's are tokens of their own).
MARKERS = {"harmony": (H_START, H_CHANNEL, H_MESSAGE, H_CONSTRAIN, *H_ENDS), "mistral": (M_CALLS, M_ARGS, M_CALL_ID),
           "deepseek": (D_CALLS, D_CALLS_END, D_CALL, D_SEP, D_CALL_END), "hermes": (), "json": (),
           "glm": (HERMES_OPEN, HERMES_CLOSE, G_KEY, G_KEY_END, G_VALUE, G_VALUE_END, T_OPEN, T_CLOSE),
           "qwen3-coder": ()}
# Families whose templates need a call's arguments as an object (they iterate over them); llama.cpp
# parses a client's JSON-string arguments for such templates too.
OBJECT_ARGUMENTS = frozenset({"glm", "qwen3-coder"})


def family_of(template: str | None) -> str:
    """The tool-call family a chat template teaches (the one place it is decided)."""
    text = template or ""
    if H_CHANNEL in text:
        return "harmony"
    if M_CALLS in text:
        return "mistral"
    if D_CALLS in text:
        return "deepseek"
    if G_KEY in text and HERMES_OPEN in text:
        return "glm"
    if Q_FUNCTION in text and Q_PARAMETER in text and HERMES_OPEN in text:
        return "qwen3-coder"
    if HERMES_OPEN in text:
        return "hermes"
    return "json"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Reply:
    """A reply read in its model's format: what the user sees, the calls, and the model's reasoning
    (gpt-oss's analysis channel, GLM's think block), each without markers."""
    content: str
    calls: list[ToolCall]
    reasoning: str = ""


Tools = Mapping[str, Any]  # the tools offered: name -> JSON schema of the arguments (empty: no tools)


def _call(obj: Any, names: Tools) -> ToolCall | None:
    """A call from {"name", "arguments"} (or "parameters"; arguments may be a JSON string), if it is one."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", obj["name"], arguments)


_decoder = json.JSONDecoder()


def _json_at(text: str, at: int) -> tuple[Any, int] | None:
    """The JSON value starting at `at` (after whitespace) and where it ends, or None."""
    at = len(text) - len(text[at:].lstrip())
    try:
        return _decoder.raw_decode(text, at)
    except ValueError:
        return None


def _hermes_calls(region: str, names: Tools) -> list[ToolCall]:
    calls = []
    for match in _HERMES_CALL.finditer(region):
        try:
            call = _call(json.loads(match.group(1)), names)
        except ValueError:
            call = None
        if call is not None:
            calls.append(call)
    return calls


def _mistral_calls(region: str, names: Tools) -> list[ToolCall]:
    """`region` begins with [TOOL_CALLS]: a JSON array (or object) of calls, or NAME[ARGS]{...} per call."""
    calls, at = [], 0
    while True:
        at = len(region) - len(region[at:].lstrip())
        if region.startswith(M_CALLS, at):
            at += len(M_CALLS)
            continue
        if at >= len(region):
            return calls
        if region[at] in "[{":
            found = _json_at(region, at)
            if found is None:
                return calls
            value, at = found
            calls.extend(c for c in map(lambda o: _call(o, names), value if isinstance(value, list) else [value]) if c)
            continue
        named = _M_NAMED.match(region, at)
        found = _json_at(region, named.end()) if named else None
        if found is None:
            return calls
        call = _call({"name": named.group(1), "arguments": found[0]}, names)
        calls.extend([call] if call else [])
        at = found[1]


def _deepseek_calls(region: str, names: Tools) -> list[ToolCall]:
    calls = []
    for piece in region.split(D_CALL)[1:]:
        body = piece.split(D_CALL_END)[0]
        first, sep, rest = body.partition(D_SEP)
        if not sep:
            continue
        if rest.lstrip().startswith("{"):  # V3.1: NAME<sep>{...}
            name, arguments = first.strip(), rest.strip()
        else:  # V3/R1: function<sep>NAME\n```json\n{...}\n```
            name, _, arguments = rest.partition("\n")
            arguments = arguments.strip().removeprefix("```json").removeprefix("```").removesuffix("```").strip()
        try:
            call = _call({"name": name.strip(), "arguments": json.loads(arguments)}, names)
        except ValueError:
            call = None
        calls.extend([call] if call else [])
    return calls


def _resolve(schema: Any, root: Any) -> Any:
    """`schema` with a local `$ref` ("#/$defs/X", as pydantic writes nested models) followed."""
    seen = 0
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and schema["$ref"].startswith("#/"):
        node = root
        for part in schema["$ref"][2:].split("/"):
            node = node.get(part) if isinstance(node, dict) else None
        schema, seen = node, seen + 1
        if seen > 32:  # a reference cycle: nothing to learn from it
            return None
    return schema


def _schema_types(schema: Any, root: Any) -> frozenset[str] | None:
    """The JSON types a schema admits ("integer" counts as "number" too); None: any, or unknown."""
    schema = _resolve(schema, root)
    if not isinstance(schema, dict):
        return None
    kind = schema.get("type")
    if isinstance(kind, str) or isinstance(kind, list):
        kinds = {kind} if isinstance(kind, str) else set(kind)
        return frozenset(kinds | ({"number"} if "integer" in kinds else set()))
    values = schema["enum"] if isinstance(schema.get("enum"), list) else (
        [schema["const"]] if "const" in schema else None)
    if values is not None:
        return frozenset().union(*(_json_types(v) for v in values)) if values else None
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            subs = [_schema_types(sub, root) for sub in schema[key]]
            return None if any(sub is None for sub in subs) else frozenset().union(*subs)
    if "properties" in schema:
        return frozenset({"object"})
    if "items" in schema:
        return frozenset({"array"})
    return None


def _json_types(value: Any) -> frozenset[str]:
    if value is None:
        return frozenset({"null"})
    if isinstance(value, bool):
        return frozenset({"boolean"})
    if isinstance(value, int):
        return frozenset({"integer", "number"})
    if isinstance(value, float):
        return frozenset({"number"} | ({"integer"} if value.is_integer() else set()))
    kinds = {str: "string", list: "array", dict: "object"}
    return frozenset({kinds[type(value)]}) if type(value) in kinds else frozenset()


def typed_value(text: str, schema: Any, root: Any = None) -> Any:
    """A value written as text (the XML families): the text itself where the schema admits only strings,
    else its JSON reading when that parses to a type the schema admits (any type, without a schema),
    else the text (as llama.cpp's parsers type them)."""
    types = _schema_types(schema, root if root is not None else schema)
    if types == {"string"}:
        return text
    try:
        value = json.loads(text)
    except ValueError:
        value = _PYTHON_LITERALS.get(text.strip(), text)
        # Qwen3-Coder's template writes scalars with Jinja's `string` filter: Python's True, False, None
        return value if value is not text and types is not None and _json_types(value) & types else text
    return value if types is None or _json_types(value) & types else text


_PYTHON_LITERALS: dict[str, Any] = {"True": True, "False": False, "None": None}


def _xml_call(name: str, pairs: list[tuple[str, str]], tools: Tools) -> ToolCall | None:
    """A call of the XML families from its name and (key, value text) pairs, typed by the tool's schema."""
    name = name.strip()
    if name not in tools:
        return None
    schema = tools[name] if isinstance(tools, Mapping) else None
    properties = schema.get("properties", {}) if isinstance(schema, dict) else {}
    arguments = {key.strip(): typed_value(value, properties.get(key.strip()) if isinstance(properties, dict)
                                          else None, schema) for key, value in pairs}
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, arguments)


def _glm_calls(region: str, tools: Tools) -> list[ToolCall]:
    """`<tool_call>NAME\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n...</tool_call>` blocks."""
    calls = []
    for match in _HERMES_CALL.finditer(region):
        name, sep, args = match.group(1).partition(G_KEY)
        call = _xml_call(name, _G_ARG.findall(sep + args), tools)
        calls.extend([call] if call else [])
    return calls


def _qwen3_coder_calls(region: str, tools: Tools) -> list[ToolCall]:
    """`<function=NAME>` blocks (inside `<tool_call>` or not), each `<parameter=k>\\nv\\n</parameter>`."""
    calls = []
    for match in _Q_FUNCTION.finditer(region):
        pairs = [(key, value.removeprefix("\n").removesuffix("\n")) for key, value in _Q_PARAMETER.findall(match.group(2))]
        call = _xml_call(match.group(1), pairs, tools)
        calls.extend([call] if call else [])
    return calls


_REGION_PARSERS: dict[str, Callable[[str, Tools], list[ToolCall]]] = {
    "hermes": _hermes_calls, "mistral": _mistral_calls, "deepseek": _deepseek_calls, "glm": _glm_calls,
    "qwen3-coder": _qwen3_coder_calls}


def _bare_json_calls(text: str, names: Tools) -> list[ToolCall]:
    """The generic format: the whole reply is one call, or a list of calls (all valid, or none)."""
    try:
        whole = json.loads(text)
    except ValueError:
        return []
    found = [_call(obj, names) for obj in (whole if isinstance(whole, list) else [whole])]
    return found if found and all(found) else []


class ToolFormat:
    """One model's tool-call format: its family (from the chat template) and the texts its content omits."""

    def __init__(self, template: str | None, specials: Iterable[str] = ()):
        self.template = template or ""
        self.family = family_of(template)
        self.specials = frozenset(s for s in (*specials, *MARKERS[self.family]) if s)

    @cached_property
    def _strip(self) -> re.Pattern | None:
        if not self.specials:
            return None
        return re.compile("|".join(re.escape(s) for s in sorted(self.specials, key=len, reverse=True)))

    @cached_property
    def _prefixes(self) -> tuple[frozenset[str], int]:
        """Every proper prefix of a special text or call marker (a streamed tail that may still become
        one is held back), and the longest."""
        marks = {*self.specials, *CALL_START.get(self.family, ())}
        prefixes = frozenset(m[:n] for m in marks for n in range(1, len(m)))
        return prefixes, max(map(len, prefixes), default=0)

    def clean(self, text: str) -> str:
        """`text` without special tokens' text."""
        return self._strip.sub("", text) if self._strip is not None else text

    def _unheld(self, text: str) -> str:
        """`text` less a tail that may be the start of a marker."""
        prefixes, longest = self._prefixes
        for n in range(min(len(text), longest), 0, -1):
            if text[-n:] in prefixes:
                return text[:-n]
        return text

    @property
    def structured(self) -> bool:
        """Whether every reply of this format carries structure to read, tools or not (harmony's channels,
        GLM's reasoning)."""
        return self.family == "harmony" or self.family in THINKING

    @property
    def object_arguments(self) -> bool:
        """Whether the template needs a call's arguments as an object, not a JSON string."""
        return self.family in OBJECT_ARGUMENTS

    def split(self, text: str, names: Tools, final: bool = True) -> Reply:
        """The content, calls and reasoning of a complete reply; with final=False, what is surely content
        and reasoning in a reply still being generated (always prefixes of the final ones), and no calls.
        `names`: the tools offered (name -> parameters schema; the XML families type values by it);
        without tools the reply is all content, less markers (harmony: its final channel)."""
        if self.family == "harmony":
            return self._harmony(text, names, final)
        if self.family in THINKING:
            reasoning, text = self._thought(text, final)
            reply = self._calls(text, names, final)
            return Reply(reply.content, reply.calls, self.clean(reasoning))
        return self._calls(text, names, final)

    def _thought(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, the rest) of a reply that may open with `<think>...</think>`; while streaming, a
        start that may still become that opening is held back (reasoning and rest both empty)."""
        lead = text.lstrip()
        if not lead.startswith(T_OPEN):
            return ("", "") if not final and T_OPEN.startswith(lead) else ("", text)
        body = lead[len(T_OPEN):]
        end = body.find(T_CLOSE)
        if end < 0:
            return (body.strip() if final else self._unheld(body).lstrip()), ""
        return (body[:end].strip() if final else body[:end].lstrip()), body[end + len(T_CLOSE):].lstrip()

    def _calls(self, text: str, names: Tools, final: bool) -> Reply:
        """The content and calls of a reply of a marker family (or json)."""
        starts = CALL_START.get(self.family, ()) if names else ()
        at = min((i for i in (text.find(start) for start in starts) if i >= 0), default=-1)
        if not final:
            head = self.clean(self._unheld(text) if at < 0 else text[:at])
            if names and head.lstrip()[:1] in ("{", "["):
                return Reply("", [])  # a bare JSON call may be coming: held to the end
            return Reply(head.rstrip() if names else head, [])
        if at >= 0:
            calls = _REGION_PARSERS[self.family](text[at:], names)
            if calls:
                return Reply(self.clean(text[:at]).rstrip(), calls)
        content = self.clean(text)
        calls = _bare_json_calls(content, names) if names else []
        return Reply("", calls) if calls else Reply(content, [])

    def _harmony(self, text: str, names: Tools, final: bool) -> Reply:
        content: list[str] = []
        reasoning: list[str] = []
        calls: list[ToolCall] = []
        chunks = text.split(H_START)  # the reply starts after the prompt's `<|start|>assistant`
        for i, chunk in enumerate(chunks):
            last = i == len(chunks) - 1
            lead = chunk.lstrip()
            if i == 0 and not lead.startswith((H_CHANNEL, "to=")):
                if not final and last and (H_CHANNEL.startswith(lead) or "to=functions.".startswith(lead)):
                    break  # may be the start of a header: wait
                content.append(chunk if final or not last else self._unheld(chunk))  # no harmony structure
                continue
            header, sep, body = chunk.partition(H_MESSAGE)
            if not sep:
                continue  # a header cut off (or still being generated)
            ends = [at for at in (body.find(e) for e in H_ENDS) if at >= 0]
            complete = bool(ends) or not last or final
            body = body[:min(ends)] if ends else body
            recipient = _H_RECIPIENT.search(header)
            to = recipient.group(1) if recipient and recipient.group(1) != "assistant" else None
            if to is not None:  # a message to a function (or a built-in tool): never content
                if final and to.startswith("functions."):
                    found = _json_at(body, 0)
                    call = _call({"name": to.removeprefix("functions."), "arguments": found[0]}, names) if found else None
                    calls.extend([call] if call else [])
                continue
            channel = _H_CHANNEL.search(header)
            into = reasoning if channel and channel.group(1) == "analysis" else content
            into.append(body if complete else self._unheld(body))
        return Reply(self.clean("".join(content)), calls, self.clean("".join(reasoning)))

    # ---- grammars: one forced call, one JSON reply ------------------------------------------------

    def _literal(self, token: Callable[[str], int | None]) -> Callable[..., str]:
        """lit(*parts): grammar items for `parts`: a marker as its token where it is one (as the model
        writes it, not spelled out in plain text), other text as a literal."""
        marks = self.specials | {HERMES_OPEN, HERMES_CLOSE}

        def lit(*parts: str) -> str:
            out = []
            for part in parts:
                for piece in _special_split(part, marks):
                    tid = token(piece) if piece in marks else None
                    out.append(f"<[{tid}]>" if tid is not None else json.dumps(piece))
            return " ".join(out)
        return lit

    def _analysis(self, lit: Callable[..., str]) -> str:
        """gpt-oss's reasoning before a constrained message, as llama.cpp's grammars allow it: at most one
        analysis message (free text up to `<|end|>`, a special token that also closes it in the closing
        policy of engine/layers/grammar.py), then the next message's `<|start|>assistant`. Rule HTEXT."""
        return f"({lit(H_CHANNEL, 'analysis', H_MESSAGE)} HTEXT {lit(H_ENDS[0], H_START, 'assistant')})?"

    def output_grammar(self, schema: dict[str, Any] | bool, token: Callable[[str], int | None]) -> str:
        """The grammar of a reply that is one JSON document matching `schema` (response formats). gpt-oss
        writes it as its final message, after its reasoning if it reasons, as in llama.cpp's grammar for
        it (the reader finds the document in the final channel); other families, the document alone."""
        from engine.layers.grammar import JSON_OPTIONS, json_schema_grammar, lark_grammar

        grammar = json_schema_grammar(schema)  # checked on its own first, for an error that names the schema
        if self.family != "harmony":
            return grammar
        document = {"x-guidance": JSON_OPTIONS, **(schema if isinstance(schema, dict) else {})}
        if schema is False:
            document["not"] = {}
        lit = self._literal(token)
        return lark_grammar(f"start: {self._analysis(lit)} {lit(H_CHANNEL, 'final', H_MESSAGE)} "
                            f"%json {json.dumps(document)}\nHTEXT: /(.|\\n)*/\n")

    def call_grammar(self, options: list[tuple[str, dict[str, Any]]], token: Callable[[str], int | None]) -> str:
        """The llguidance grammar of exactly one call to one of `options` (name, parameters schema) in
        this family's format; it ends with the call, so generation stops there. `token(text)` is the
        id of the special token spelled `text`, if the vocabulary has one: markers are forced as that
        token. In the XML families the arguments are the schema's required properties in its order, then
        each optional one or not; a string value is free text up to the value's closing marker."""
        from engine.layers.grammar import json_schema_grammar, lark_grammar

        lit = self._literal(token)

        def args(schema: dict[str, Any]) -> str:
            return f"%json {json.dumps(schema)}"

        objects = [{"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
                    "required": ["name", "arguments"], "additionalProperties": False} for name, schema in options]
        whole = objects[0] if len(objects) == 1 else {"anyOf": objects}
        json_schema_grammar(whole)  # checked on its own first, for an error message that names the schema
        if self.family == "json":
            return json_schema_grammar(whole)
        if self.family == "hermes":
            return lark_grammar(f"start: {lit(HERMES_OPEN, chr(10))} {args(whole)} {lit(chr(10), HERMES_CLOSE)}\n")
        if self.family == "mistral" and M_ARGS not in self.template:
            return lark_grammar(f"start: {lit(M_CALLS, '[')} {args(whole)} {lit(']')}\n")
        rules = []
        for i, (name, schema) in enumerate(options):
            if self.family == "harmony":
                body = (f"{self._analysis(lit)} {lit(H_CHANNEL, f'commentary to=functions.{name} ', H_CONSTRAIN, 'json', H_MESSAGE)} "
                        f"{args(schema)}")
            elif self.family == "mistral":
                call_id = f" {lit(M_CALL_ID)} /[a-zA-Z0-9]{{9}}/" if M_CALL_ID in self.template else ""
                body = f"{lit(M_CALLS, name)}{call_id} {lit(M_ARGS)} {args(schema)}"
            elif self.family in ("glm", "qwen3-coder"):
                body = self._xml_call_items(name, schema, lit)
            elif "```json" in self.template:  # deepseek V3/R1
                body = (f"{lit(D_CALLS, D_CALL, 'function', D_SEP, name + chr(10) + '```json' + chr(10))} {args(schema)} "
                        f"{lit(chr(10) + '```', D_CALL_END, D_CALLS_END)}")
            else:  # deepseek V3.1
                body = f"{lit(D_CALLS, D_CALL, name, D_SEP)} {args(schema)} {lit(D_CALL_END, D_CALLS_END)}"
            rules.append(f"call{i}: {body}")
        # Free text of a string value: GLM's ends at the </arg_value> token (never part of text);
        # Qwen3-Coder's at the text "\n</parameter>\n", written as the rule's suffix so the lexeme ends there.
        if self.family == "harmony":
            rules.append("HTEXT: /(.|\\n)*/")
        if self.family == "glm":
            rules.append("GTEXT: /(.|\\n)*/")
        if self.family == "qwen3-coder":
            rules.append(f"qtext[suffix={json.dumps(Q_VALUE_END)}]: /(.|\\n)*/")
        return lark_grammar("start: " + " | ".join(f"call{i}" for i in range(len(options))) + "\n" + "\n".join(rules) + "\n")

    def _xml_call_items(self, name: str, schema: dict[str, Any], lit: Callable[..., str]) -> str:
        """Grammar items of one call in the glm or qwen3-coder format (rules GTEXT and qtext: call_grammar)."""
        properties = schema.get("properties") if isinstance(schema, dict) else None
        properties = properties if isinstance(properties, dict) else {}
        required = [k for k in properties if k in (schema.get("required") or [])]
        items = []
        for key in [*required, *(k for k in properties if k not in required)]:
            prop = _resolve(properties[key], schema)
            types = _schema_types(prop, schema)
            enum = prop.get("enum", [prop["const"]] if "const" in prop else None) if isinstance(prop, dict) else None
            if types == {"string"} and isinstance(enum, list) and all(isinstance(v, str) for v in enum):
                value = "(" + " | ".join(json.dumps(v) for v in enum) + ")"
            elif types is not None and "string" in types:  # text is a string whatever else it may be
                value = "GTEXT" if self.family == "glm" else "qtext"
            else:
                document = {**prop, **({"$defs": schema["$defs"]} if "$defs" in schema else {})} \
                    if isinstance(prop, dict) else {}
                value = f"%json {json.dumps(document)}"
            if self.family == "glm":
                item = f"{lit(G_KEY, key, G_KEY_END, chr(10), G_VALUE)} {value} {lit(G_VALUE_END, chr(10))}"
            else:
                item = f"{lit(f'{Q_PARAMETER}{key}>{chr(10)}')} {value}" + ("" if value == "qtext" else f" {lit(Q_VALUE_END)}")
            items.append(item if key in required else f"({item})?")
        if self.family == "glm":
            return " ".join([lit(HERMES_OPEN, name + "\n"), *items, lit(HERMES_CLOSE)])
        return " ".join([lit(HERMES_OPEN, f"\n{Q_FUNCTION}{name}>\n"), *items, lit("</function>\n", HERMES_CLOSE)])


def _special_split(text: str, specials: Iterable[str]) -> list[str]:
    """`text` cut into special texts and the plain text between them."""
    found = sorted({s for s in specials if s and s in text}, key=len, reverse=True)
    if not found:
        return [text] if text else []
    return [p for p in re.split("(" + "|".join(map(re.escape, found)) + ")", text) if p]
