"""Real English text built at run time from the docstrings of the installed standard library.

Every machine with Python has it, so statistics, profiles and benchmarks run on real prose
without the project shipping anyone else's text.
"""
from __future__ import annotations

import ast
import sysconfig
from pathlib import Path

# A fixed list keeps the text the same on every machine with the same Python version.
MODULES = (
    "argparse", "asyncio/events", "asyncio/tasks", "calendar", "collections/__init__",
    "configparser", "csv", "dataclasses", "datetime", "decimal", "difflib", "email/message",
    "enum", "fractions", "functools", "gettext", "heapq", "http/client", "http/server",
    "inspect", "ipaddress", "json/__init__", "logging/__init__", "mailbox", "pathlib",
    "pickle", "pprint", "random", "shutil", "smtplib", "socket", "statistics", "string",
    "subprocess", "tarfile", "tempfile", "textwrap", "threading", "typing", "unittest/case",
    "urllib/parse", "urllib/request", "uuid", "warnings", "zipfile",
)


def _docstrings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) > 80:
                out.append(" ".join(doc.split()))
    return out


def stdlib_text(max_chars: int | None = None) -> str:
    """Paragraphs of docstrings from a fixed list of stdlib modules, joined by blank lines."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    total = 0
    for module in MODULES:
        path = root / f"{module}.py"
        if not path.exists():
            continue
        for doc in _docstrings(path):
            parts.append(doc)
            total += len(doc) + 2
            if max_chars is not None and total >= max_chars:
                return "\n\n".join(parts)[:max_chars]
    return "\n\n".join(parts)
