"""Markdown helpers for chat messages. No Qt."""
from __future__ import annotations

import re

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^\n`]*)\n(?P<body>.*?)(?:^ {0,3}(?P=fence)[`~]*[ \t]*$|\Z)",
                    re.S | re.M)


def code_blocks(text: str) -> list[str]:
    """The fenced code blocks of a Markdown text, in order (an unclosed last fence counts: it streams)."""
    return [m.group("body").rstrip("\n") for m in _FENCE.finditer(text)]


def last_code_block(text: str) -> str | None:
    blocks = code_blocks(text)
    return blocks[-1] if blocks else None


def display_markdown(text: str, streaming: bool = False) -> str:
    """What to hand to the Markdown renderer: a reply cut off inside a fence gets its fence
    closed, so the half-written code still renders as code instead of swallowing the page."""
    fences = re.findall(r"^ {0,3}(`{3,}|~{3,})", text, re.M)
    if len(fences) % 2 == 1:
        text = text.rstrip("\n") + "\n" + fences[-1] + "\n"
    if streaming:
        text += " \u258d"  # a cursor while the reply grows
    return text
