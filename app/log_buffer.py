"""The engine's output kept in memory for the logs panel (bounded), and for crash reports. No Qt."""
from __future__ import annotations

import re
import time
from collections import deque
from dataclasses import dataclass

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_LEVEL = re.compile(r"\b(DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|Traceback)\b")
# The engine prints a refused setting or file as one "moestudio: error: ..." line (engine/cli.py).
_USER_ERROR = re.compile(r"^moestudio(?: \w+)?: error: ")


@dataclass(frozen=True)
class LogLine:
    time: float
    source: str  # "stdout", "stderr" or "app"
    text: str

    @property
    def level(self) -> str:
        if _USER_ERROR.match(self.text):
            return "ERROR"
        m = _LEVEL.search(self.text)
        if not m:
            return "INFO"
        word = m.group(1)
        return {"WARN": "WARNING", "Traceback": "ERROR"}.get(word, word)

    def format(self) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(self.time))
        return f"{stamp} [{self.source}] {self.text}"


class LogBuffer:
    def __init__(self, max_lines: int = 20000):
        self.lines: deque[LogLine] = deque(maxlen=max_lines)
        self._partial: dict[str, str] = {}

    def feed(self, source: str, data: str) -> list[LogLine]:
        """Adds process output (any chunking); returns the complete lines it finished."""
        text = self._partial.pop(source, "") + data.replace("\r\n", "\n")
        *complete, rest = text.split("\n")
        if rest:
            self._partial[source] = rest
        now = time.time()
        out = [LogLine(now, source, ln) for ln in complete]
        self.lines.extend(out)
        return out

    def flush(self) -> list[LogLine]:
        out = [LogLine(time.time(), s, t) for s, t in self._partial.items() if t]
        self._partial.clear()
        self.lines.extend(out)
        return out

    def add(self, source: str, text: str) -> LogLine:
        line = LogLine(time.time(), source, text)
        self.lines.append(line)
        return line

    def tail(self, n: int = 40, sources: tuple[str, ...] = ("stderr", "stdout")) -> str:
        picked = [ln.text for ln in self.lines if ln.source in sources]
        return "\n".join(picked[-n:])

    def filtered(self, needle: str = "", min_level: str = "DEBUG") -> list[LogLine]:
        return [ln for ln in self.lines if matches(ln, needle, min_level)]


def matches(line: LogLine, needle: str, min_level: str = "DEBUG") -> bool:
    if needle and needle.lower() not in line.text.lower():
        return False
    return LEVELS.index(line.level) >= LEVELS.index(min_level)
