"""What a chat turn sends and how its reply is measured. No Qt.

`build_payload` turns a conversation (system prompt, messages, sampling settings) into an
OpenAI chat request. `ReplyMeter` follows a streaming reply: the text, the token count, the
time to first token and the decode rate.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from app.store import Conversation, Message
from engine.server.parse import MAX_STOPS

# top_k 0, min_p 0 and repeat_penalty 1 are "off" (the server's llama.cpp-style extensions).
DEFAULT_SETTINGS: dict[str, Any] = {"temperature": 0.7, "top_p": 0.95, "top_k": 0, "min_p": 0.0,
                                    "repeat_penalty": 1.0, "max_tokens": 512, "seed": -1, "stop": []}


def sampling(settings: dict[str, Any]) -> dict[str, Any]:
    s = {**DEFAULT_SETTINGS, **(settings or {})}
    out = {"temperature": float(s["temperature"]), "top_p": float(s["top_p"]), "top_k": int(s["top_k"]),
           "min_p": float(s["min_p"]), "repeat_penalty": float(s["repeat_penalty"]), "max_tokens": int(s["max_tokens"])}
    if s.get("seed") is not None and int(s["seed"]) >= 0:
        out["seed"] = int(s["seed"])
    if s["stop"]:
        out["stop"] = list(s["stop"])
    return out


def parse_stops(text: str) -> list[str]:
    """Stop strings typed one per line, with \\n and \\t for a newline and a tab."""
    stops = [line.replace("\\n", "\n").replace("\\t", "\t") for line in text.split("\n") if line]
    if len(stops) > MAX_STOPS:
        raise ValueError(f"at most {MAX_STOPS} stop strings (got {len(stops)})")
    return stops


def format_stops(stops: list[str]) -> str:
    return "\n".join(s.replace("\n", "\\n").replace("\t", "\\t") for s in stops)


def context_used(history: list[Message]) -> int | None:
    """Tokens the conversation's last finished turn occupied (its prompt and reply), or None if unknown."""
    for m in reversed(history):
        stats = m.stats or {}
        if m.role == "assistant" and "prompt_tokens" in stats:
            return int(stats["prompt_tokens"]) + int(stats.get("completion_tokens", 0))
    return None


def chat_markdown(conv: Conversation, history: list[Message]) -> str:
    """The conversation as Markdown: title, system prompt, then each turn (the versions shown)."""
    out = [f"# {conv.title}", ""]
    if conv.system_prompt.strip():
        out += ["**System prompt:**", "", conv.system_prompt.strip(), ""]
    for m in history:
        out += [f"## {'You' if m.role == 'user' else 'Assistant'}", "", m.content or "*(no text)*", ""]
    return "\n".join(out)


def chat_json(conv: Conversation, history: list[Message], earlier: dict[int, list[Message]]) -> str:
    """The conversation as JSON, with every version of regenerated replies (`earlier`: message id -> others)."""
    def version(m: Message) -> dict[str, Any]:
        return {"version": m.version, "content": m.content, "status": m.status, "stats": m.stats}
    messages = []
    for m in history:
        e = {"role": m.role, "created": m.created, **version(m)}
        if earlier.get(m.id):
            e["other_versions"] = [version(v) for v in earlier[m.id]]
        messages.append(e)
    return json.dumps({"format": "moestudio-chat", "version": 1, "title": conv.title,
                       "system_prompt": conv.system_prompt, "settings": conv.settings, "created": conv.created,
                       "messages": messages}, ensure_ascii=False, indent=2) + "\n"


def build_payload(system_prompt: str, history: list[Message], settings: dict[str, Any]) -> dict[str, Any]:
    messages: list[dict[str, str]] = []
    if system_prompt.strip():
        messages.append({"role": "system", "content": system_prompt})
    for m in history:
        if m.role == "assistant" and not m.content:
            continue  # a reply that never produced text says nothing to the model
        messages.append({"role": m.role, "content": m.content})
    return {"model": "moestudio", "messages": messages, **sampling(settings)}


def title_from(text: str, limit: int = 48) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1].rstrip() + "\u2026"


@dataclass
class ReplyMeter:
    clock: Any = time.perf_counter
    text: str = ""
    chunks: int = 0
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    started: float = field(default=0.0)
    first_at: float | None = None
    last_at: float | None = None

    def __post_init__(self) -> None:
        self.started = self.clock()

    def feed(self, chunk: dict[str, Any]) -> str:
        """One parsed SSE chunk; returns the text it adds."""
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        added = ""
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            piece = delta.get("content") or ""
            if piece:
                now = self.clock()
                if self.first_at is None:
                    self.first_at = now
                self.last_at = now
                self.chunks += 1
                added += piece
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        self.text += added
        return added

    @property
    def tokens(self) -> int:
        if self.usage and self.usage.get("completion_tokens") is not None:
            return int(self.usage["completion_tokens"])
        return self.chunks

    def stats(self) -> dict[str, Any]:
        s: dict[str, Any] = {"completion_tokens": self.tokens}
        if self.usage and self.usage.get("prompt_tokens") is not None:
            s["prompt_tokens"] = int(self.usage["prompt_tokens"])
        if self.first_at is not None:
            s["ttft_s"] = round(self.first_at - self.started, 4)
            span = (self.last_at or self.first_at) - self.first_at
            if self.tokens > 1 and span > 0:
                s["tokens_per_s"] = round((self.tokens - 1) / span, 2)
        if self.finish_reason:
            s["finish_reason"] = self.finish_reason
        s["elapsed_s"] = round(self.clock() - self.started, 3)
        return s


def format_prompt_progress(processed: int, total: int) -> str:
    """The note of a reply whose prompt the engine is still reading (/v1/stats' `prefill`)."""
    return f"processing prompt {processed:,} / {total:,}"


def format_stats(stats: dict[str, Any] | None) -> str:
    if not stats:
        return ""
    parts = []
    if "completion_tokens" in stats:
        parts.append(f"{stats['completion_tokens']} tokens")
    if "tokens_per_s" in stats:
        parts.append(f"{stats['tokens_per_s']:.1f} tok/s")
    if "ttft_s" in stats:
        parts.append(f"TTFT {stats['ttft_s'] * 1000:.0f} ms")
    if stats.get("finish_reason") == "length":
        parts.append("hit max tokens")
    if stats.get("error"):
        parts.append(stats["error"])
    return " \u00b7 ".join(parts)
