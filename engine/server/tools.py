"""Tool calling for the APIs: tool definitions, the model's template, forced calls, reading replies.

Tools reach the model through its own chat template (the GGUF's Jinja template receives `tools`
in OpenAI's shape); a template that does not render them is refused with a 400. Calls are read
from the reply in the format the template teaches (engine/server/tool_formats.py: Hermes/Qwen,
gpt-oss harmony, Mistral, DeepSeek, GLM, Qwen3-Coder, or a bare JSON reply). A forced call (OpenAI
"required" or a named function, Anthropic "any" or "tool") is a grammar (engine/layers/grammar.py)
that admits exactly one call in that format, to one of the allowed tools, with arguments matching
its schema. A `Reading` says how a chat reply is read: with tools, or without them for a format whose
replies always carry structure (gpt-oss: content is the final channel, reasoning the analysis channel).
"""
from __future__ import annotations

import dataclasses
import json
import re
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Mapping

from engine.errors import UserError
from engine.server.errors import ApiError
# ToolCall, Reply: the API modules take them from here
from engine.server.tool_formats import Reply, ToolCall, ToolFormat
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
    format: ToolFormat | None = None  # the model's call format (for_model sets it)

    @property
    def schemas(self) -> dict[str, dict[str, Any]]:
        """The tools offered: name -> JSON schema of the arguments."""
        return {t.name: t.parameters for t in self.tools}


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


_formats: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Tokenizer -> ToolFormat
_formats_lock = threading.Lock()


def tool_format(tokenizer: Any) -> ToolFormat:
    """The model's tool-call format, from its chat template and special tokens (built once per tokenizer)."""
    with _formats_lock:
        fmt = _formats.get(tokenizer)
        if fmt is None:
            fmt = _formats[tokenizer] = ToolFormat(tokenizer.chat_template, tokenizer.special_texts)
        return fmt


def for_model(use: ToolUse, tokenizer: Any) -> ToolUse:
    """`use`, checked against the model's template (400 without tool support), with the model's call format."""
    check_template(tokenizer)
    return dataclasses.replace(use, format=tool_format(tokenizer))


def call_grammar(use: ToolUse, tokenizer: Any) -> str:
    """The grammar of exactly one call to one of `use.forced`, in the model's format."""
    by_name = {t.name: t for t in use.tools}
    try:
        return (use.format or tool_format(tokenizer)).call_grammar(
            [(name, by_name[name].parameters) for name in use.forced], tokenizer.special_token)
    except UserError as e:
        raise ApiError(400, f"a tool's parameters cannot be enforced: {e}", param="tools",
                       code="invalid_value") from None


def output_grammar(schema: dict[str, Any] | bool, tokenizer: Any) -> str:
    """The grammar of a chat reply that is one JSON document matching `schema`, in the model's format
    (gpt-oss: as its final message). UserError for a schema that cannot be enforced."""
    return tool_format(tokenizer).output_grammar(schema, tokenizer.special_token)


def template_messages(messages: list[dict], tokenizer: Any) -> list[dict]:
    """`messages` as the model's template takes them: for templates that iterate over a call's arguments
    (GLM, Qwen3-Coder) arguments a client sent as a JSON string become the object (llama.cpp does the same)."""
    if not tool_format(tokenizer).object_arguments:
        return messages
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "tool_calls": [_object_arguments(c) for c in calls]}
        out.append(message)
    return out


def _object_arguments(call: dict) -> dict:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"] or "{}")
    except ValueError:
        raise ApiError(400, f"the arguments of the call to {function.get('name')!r} are not JSON: this model's template "
                       "needs them as an object", param="messages") from None
    if not isinstance(arguments, dict):
        raise ApiError(400, f"the arguments of the call to {function.get('name')!r} must be a JSON object",
                       param="messages")
    return {**call, "function": {**function, "arguments": arguments}}


@dataclass(frozen=True)
class Reading:
    """How a chat reply is read: the model's format and the tools offered (name -> parameters schema;
    empty: none). Content never carries markers or special tokens' text; calls to tools not offered,
    and malformed ones, are not calls."""
    format: ToolFormat
    tools: Mapping[str, Any] = field(default_factory=dict)

    def parse(self, text: str) -> Reply:
        return self.format.split(text, self.tools)


def reading(tokenizer: Any, use: ToolUse | None) -> Reading | None:
    """How this model's reply to a chat request is read; None: it is plain text (no tools, and a format
    whose replies carry no structure). A reply that is read decodes special tokens as text."""
    if use is not None:
        return Reading(use.format or tool_format(tokenizer), use.schemas)
    fmt = tool_format(tokenizer)
    return Reading(fmt) if fmt.structured else None


class ReplyFilter:
    """A streamed reply's content and reasoning as they come, holding back what may be (part of) a call
    or a marker; `finish` reads the whole reply."""

    def __init__(self, reading: Reading):
        self.reading = reading
        self._raw = ""
        self._sent = Reply("", [])

    def _news(self, reply: Reply) -> tuple[str, str]:
        """What `reply` adds to the content and reasoning sent so far (each a prefix of the next)."""
        def new(now: str, sent: str) -> str:
            return now[len(sent):] if now.startswith(sent) else ""
        content, reasoning = new(reply.content, self._sent.content), new(reply.reasoning, self._sent.reasoning)
        self._sent = Reply(self._sent.content + content, [], self._sent.reasoning + reasoning)
        return content, reasoning

    def feed(self, text: str) -> tuple[str, str]:
        """(content, reasoning) that `text` (the next piece of the decoded reply) makes sure of, to stream now."""
        self._raw += text
        return self._news(self.reading.format.split(self._raw, self.reading.tools, final=False))

    def finish(self) -> Reply:
        """The content and reasoning not streamed yet, and the calls, once the reply is complete."""
        whole = self.reading.parse(self._raw)
        content, reasoning = self._news(whole)
        return Reply(content, whole.calls, reasoning)
