"""How each chat-template family writes tool calls: which family a model's template is (decided here,
in one place), how calls are read from a reply, what of a reply still being streamed is surely
content, and the grammar of exactly one forced call.

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
- json: a template with none of these markers: a reply that is one JSON object {"name", "arguments"}
  (or an array of them). Every family also reads such a bare-JSON reply.

The markers are special tokens. A request with tools decodes special tokens as text
(Request.special_tokens) so they reach this parser; content never carries them: the text of every
special token (`specials`, the tokenizer's control tokens) and of the family's markers is removed from it.
Calls to tools that were not offered and malformed calls are not calls (in the marker families their
text stays content; in harmony, a message to a function is never content).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Iterable

FAMILIES = ("hermes", "harmony", "mistral", "deepseek", "json")

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

# Where the calls of a reply begin, per marker family (json: nowhere; harmony has its own structure).
CALL_START = {"hermes": HERMES_OPEN, "mistral": M_CALLS, "deepseek": D_CALLS}
# Structure markers removed from content (hermes keeps its tags: they are plain text in most vocabularies).
MARKERS = {"harmony": (H_START, H_CHANNEL, H_MESSAGE, H_CONSTRAIN, *H_ENDS), "mistral": (M_CALLS, M_ARGS, M_CALL_ID),
           "deepseek": (D_CALLS, D_CALLS_END, D_CALL, D_SEP, D_CALL_END), "hermes": (), "json": ()}


def family_of(template: str | None) -> str:
    """The tool-call family a chat template teaches (the one place it is decided)."""
    text = template or ""
    if H_CHANNEL in text:
        return "harmony"
    if M_CALLS in text:
        return "mistral"
    if D_CALLS in text:
        return "deepseek"
    if HERMES_OPEN in text:
        return "hermes"
    return "json"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]


def _call(obj: Any, names: frozenset[str]) -> ToolCall | None:
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


def _hermes_calls(region: str, names: frozenset[str]) -> list[ToolCall]:
    calls = []
    for match in _HERMES_CALL.finditer(region):
        try:
            call = _call(json.loads(match.group(1)), names)
        except ValueError:
            call = None
        if call is not None:
            calls.append(call)
    return calls


def _mistral_calls(region: str, names: frozenset[str]) -> list[ToolCall]:
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


def _deepseek_calls(region: str, names: frozenset[str]) -> list[ToolCall]:
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


_REGION_PARSERS: dict[str, Callable[[str, frozenset[str]], list[ToolCall]]] = {
    "hermes": _hermes_calls, "mistral": _mistral_calls, "deepseek": _deepseek_calls}


def _bare_json_calls(text: str, names: frozenset[str]) -> list[ToolCall]:
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
        marks = {*self.specials, CALL_START.get(self.family, "")} - {""}
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

    def split(self, text: str, names: frozenset[str], final: bool = True) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a complete reply; with final=False, the content that is surely content
        in a reply still being generated (always a prefix of the final content), and no calls.
        Without `names` (no tools) the reply is all content."""
        if self.family == "harmony":
            return self._harmony(text, names, final)
        start = CALL_START.get(self.family) if names else None
        at = text.find(start) if start else -1
        if not final:
            head = self.clean(self._unheld(text) if at < 0 else text[:at])
            if names and head.lstrip()[:1] in ("{", "["):
                return "", []  # a bare JSON call may be coming: held to the end
            return head.rstrip() if names else head, []
        if at >= 0:
            calls = _REGION_PARSERS[self.family](text[at:], names)
            if calls:
                return self.clean(text[:at]).rstrip(), calls
        content = self.clean(text)
        calls = _bare_json_calls(content, names) if names else []
        return ("", calls) if calls else (content, [])

    def _harmony(self, text: str, names: frozenset[str], final: bool) -> tuple[str, list[ToolCall]]:
        content: list[str] = []
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
            if channel and channel.group(1) == "analysis":
                continue
            content.append(body if complete else self._unheld(body))
        return self.clean("".join(content)), calls

    # ---- the grammar of one forced call ---------------------------------------------------------

    def call_grammar(self, options: list[tuple[str, dict[str, Any]]], token: Callable[[str], int | None]) -> str:
        """The llguidance grammar of exactly one call to one of `options` (name, parameters schema) in
        this family's format; it ends with the call, so generation stops there. `token(text)` is the
        id of the special token spelled `text`, if the vocabulary has one: markers are forced as that
        token, as the model writes them, not spelled out in plain text."""
        from engine.layers.grammar import json_schema_grammar, lark_grammar

        marks = self.specials | {HERMES_OPEN, HERMES_CLOSE}

        def lit(*parts: str) -> str:
            """Grammar items for `parts`: a marker as its token where it is one, other text as a literal."""
            out = []
            for part in parts:
                for piece in _special_split(part, marks):
                    tid = token(piece) if piece in marks else None
                    out.append(f"<[{tid}]>" if tid is not None else json.dumps(piece))
            return " ".join(out)

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
                body = f"{lit(H_CHANNEL, f'commentary to=functions.{name} ', H_CONSTRAIN, 'json', H_MESSAGE)} {args(schema)}"
            elif self.family == "mistral":
                call_id = f" {lit(M_CALL_ID)} /[a-zA-Z0-9]{{9}}/" if M_CALL_ID in self.template else ""
                body = f"{lit(M_CALLS, name)}{call_id} {lit(M_ARGS)} {args(schema)}"
            elif "```json" in self.template:  # deepseek V3/R1
                body = (f"{lit(D_CALLS, D_CALL, 'function', D_SEP, name + chr(10) + '```json' + chr(10))} {args(schema)} "
                        f"{lit(chr(10) + '```', D_CALL_END, D_CALLS_END)}")
            else:  # deepseek V3.1
                body = f"{lit(D_CALLS, D_CALL, name, D_SEP)} {args(schema)} {lit(D_CALL_END, D_CALLS_END)}"
            rules.append(f"call{i}: {body}")
        return lark_grammar("start: " + " | ".join(f"call{i}" for i in range(len(rules))) + "\n" + "\n".join(rules) + "\n")


def _special_split(text: str, specials: Iterable[str]) -> list[str]:
    """`text` cut into special texts and the plain text between them."""
    found = sorted({s for s in specials if s and s in text}, key=len, reverse=True)
    if not found:
        return [text] if text else []
    return [p for p in re.split("(" + "|".join(map(re.escape, found)) + ")", text) if p]
