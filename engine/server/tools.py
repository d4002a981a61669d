"""Tool calling for both APIs: tool definitions, the model's template, forced calls, parsing calls.

Tools reach the model through its own chat template (the GGUF's Jinja template receives `tools`
in OpenAI's shape); a template that does not render them is refused with a 400. Calls are read
from the reply in the format the template teaches: Hermes/Qwen `<tool_call>{json}</tool_call>`
blocks when the template uses them, otherwise a bare JSON object `{"name", "arguments"}` (or a
list of them) as the whole reply. A forced call (OpenAI "required" or a named function,
Anthropic "any" or "tool") is a grammar (engine/layers/grammar.py) that admits exactly one call in
that format, to one of the allowed tools, with arguments matching its schema.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from engine.errors import UserError
from engine.server.errors import ApiError

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(re.escape(HERMES_OPEN) + r"\s*(.*?)\s*" + re.escape(HERMES_CLOSE), re.S)
_PROBE = "moestudio_tool_probe"  # a tool name no template prints unless it renders the tools it gets


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments
    given: dict[str, Any] | None = None  # the definition as an OpenAI client sent it

    def for_template(self) -> dict[str, Any]:
        """OpenAI's shape, the one chat templates are written for (as the client sent it, when it did)."""
        return self.given or {"type": "function", "function": {"name": self.name, "description": self.description,
                                                               "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolUse:
    tools: tuple[Tool, ...]
    forced: tuple[str, ...] | None  # the names one of which must be called; None: the model may answer in text


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]


def _tool(name: Any, description: Any, parameters: Any, where: str, given: dict | None = None) -> Tool:
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
        raise ApiError(400, f"{where}: a tool name must be 1-64 letters, digits, '_', '.' or '-', got {name!r}",
                       param="tools", code="invalid_value")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise ApiError(400, f"{where}: the parameters schema must be a JSON object", param="tools",
                       code="invalid_value")
    return Tool(name, description if isinstance(description, str) else "", parameters, given)


def _named(tools: list[Tool], name: Any, where: str) -> tuple[str, ...]:
    if name not in {t.name for t in tools}:
        raise ApiError(400, f"{where}: no tool named {name!r} in 'tools'", param="tool_choice", code="invalid_value")
    return (name,)


def openai_tool_use(body: dict) -> ToolUse | None:
    """`tools` and `tool_choice` of a chat request ("none" leaves the tools out)."""
    raw, choice = body.get("tools"), body.get("tool_choice", "auto")
    if raw is None or raw == []:  # clients send an empty list for "no tools"
        if choice not in ("auto", "none", None):
            raise ApiError(400, "'tool_choice' needs 'tools'", param="tool_choice", code="invalid_value")
        return None
    if not isinstance(raw, list):
        raise ApiError(400, "'tools' must be an array of {\"type\": \"function\", \"function\": {...}}",
                       param="tools", code="invalid_value")
    tools = []
    for i, t in enumerate(raw):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict):
            raise ApiError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\", ...}}}}",
                           param="tools", code="invalid_value")
        tools.append(_tool(f.get("name"), f.get("description"), f.get("parameters"), f"tools[{i}]", t))
    if choice in ("auto", None):
        return ToolUse(tuple(tools), None)
    if choice == "none":
        return None
    if choice == "required":
        return ToolUse(tuple(tools), tuple(t.name for t in tools))
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        return ToolUse(tuple(tools), _named(tools, choice["function"].get("name"), "tool_choice.function.name"))
    raise ApiError(400, "'tool_choice' must be \"none\", \"auto\", \"required\" or "
                   "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice", code="invalid_value")


def anthropic_tool_use(body: dict) -> ToolUse | None:
    """`tools` and `tool_choice` of a Messages request."""
    raw, choice = body.get("tools"), body.get("tool_choice") or {"type": "auto"}
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise ApiError(400, "tools: must be an array of {\"name\", \"input_schema\", ...}")
    tools = []
    for i, t in enumerate(raw):
        if not isinstance(t, dict) or not isinstance(t.get("input_schema"), dict):
            raise ApiError(400, f"tools.{i}.input_schema: Field required")
        tools.append(_tool(t.get("name"), t.get("description"), t["input_schema"], f"tools.{i}"))
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "auto":
        return ToolUse(tuple(tools), None)
    if kind == "none":
        return None
    if kind == "any":
        return ToolUse(tuple(tools), tuple(t.name for t in tools))
    if kind == "tool":
        return ToolUse(tuple(tools), _named(tools, choice.get("name"), "tool_choice.name"))
    raise ApiError(400, "tool_choice.type: must be 'auto', 'any', 'tool' or 'none'")


def check_template(tokenizer: Any) -> None:
    """400 unless the model's chat template renders the tools it is given."""
    probe = Tool(_PROBE, "", {"type": "object", "properties": {}}).for_template()
    try:
        text = tokenizer.render_chat([{"role": "user", "content": "x"}], tools=[probe])
    except UserError as e:
        raise ApiError(400, f"tools cannot be used with this model: {e}", param="tools") from None
    if _PROBE not in text:
        raise ApiError(400, f"the chat template of {tokenizer.path.name} has no tool support (it does not render "
                       "'tools'): this model cannot be given tools", param="tools", code="unsupported_parameter")


def uses_hermes(tokenizer: Any) -> bool:
    return HERMES_OPEN in (tokenizer.chat_template or "")


def call_grammar(use: ToolUse, tokenizer: Any) -> str:
    """The grammar of one call to one of `use.forced`, in the template's format."""
    from engine.layers.grammar import json_schema_grammar, lark_grammar

    by_name = {t.name: t for t in use.tools}
    options = [{"type": "object", "properties": {"name": {"const": name}, "arguments": by_name[name].parameters},
                "required": ["name", "arguments"], "additionalProperties": False} for name in use.forced]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    try:
        if not uses_hermes(tokenizer):
            return json_schema_grammar(schema)
        json_schema_grammar(schema)  # the same schema, checked on its own for a message that names it
        return lark_grammar(f"start: {json.dumps(HERMES_OPEN + chr(10))} call {json.dumps(chr(10) + HERMES_CLOSE)}\n"
                            f"call: %json {json.dumps(schema)}\n")
    except UserError as e:
        raise ApiError(400, f"a tool's parameters cannot be enforced: {e}", param="tools",
                       code="invalid_value") from None


def _call(obj: Any, names: set[str]) -> ToolCall | None:
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


def parse_calls(text: str, use: ToolUse) -> tuple[str, list[ToolCall]]:
    """(the reply's text outside calls, its calls). Calls to tools not offered stay text."""
    names = {t.name for t in use.tools}
    calls = []
    for match in _HERMES_CALL.finditer(text):
        try:
            call = _call(json.loads(match.group(1)), names)
        except ValueError:
            call = None
        if call is not None:
            calls.append(call)
    if calls:
        return text[:text.index(HERMES_OPEN)].rstrip(), calls
    try:  # the generic format: the whole reply is a call, or a list of calls
        whole = json.loads(text)
    except ValueError:
        return text, []
    found = [_call(obj, names) for obj in (whole if isinstance(whole, list) else [whole])]
    if found and all(found):
        return "", found
    return text, []


class CallFilter:
    """A streamed reply's text, holding back from where a call may start (`<tool_call>`, or a reply
    that begins with `{` or `[`); `finish` parses what was held."""

    def __init__(self, use: ToolUse):
        self.use = use
        self._sent, self._held = "", ""
        self._holding = False

    def feed(self, text: str) -> str:
        """The part of `text` that is surely not a call, to stream now."""
        buffer = self._held + text
        if self._holding:
            self._held = buffer
            return ""
        if not self._sent and buffer.lstrip()[:1] in ("{", "["):
            self._holding, self._held = True, buffer
            return ""
        at = buffer.find(HERMES_OPEN)
        if at >= 0:
            self._holding, self._held = True, buffer[at:]
            out = buffer[:at]
        else:  # keep a tail that may be the start of "<tool_call>"
            keep = next((n for n in range(min(len(buffer), len(HERMES_OPEN) - 1), 0, -1)
                         if HERMES_OPEN.startswith(buffer[-n:])), 0)
            out, self._held = buffer[:len(buffer) - keep], buffer[len(buffer) - keep:]
        if not self._sent and not out.strip():
            self._held = out + self._held  # leading whitespace: wait to see what follows
            return ""
        self._sent += out
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(held text to stream as text, the calls) once the reply is complete."""
        text, calls = parse_calls(self._sent + self._held, self.use)
        if not calls:
            return self._held, []
        return text[len(self._sent):], calls
