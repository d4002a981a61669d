"""Streaming text output: stop strings that may span token pieces, and UTF-8 split across tokens."""
from __future__ import annotations

import codecs
from typing import Sequence


class StopMatcher:
    """Cuts generated text at the first stop string, never emitting it or anything after it.

    Text that could still turn out to be the start of a stop string is held back until the
    next piece decides it. Like llama-server, generation stops as soon as any stop string is
    complete; if several are complete at once, the one that starts earliest wins.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped = False

    def feed(self, text_piece: str) -> tuple[str, bool]:
        """Returns (text safe to emit now, whether a stop string was hit)."""
        if self.stopped:
            return "", True
        text = self.held + text_piece
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held, self.stopped = "", True
            return text[: min(hits)], True
        keep = self._partial_len(text)
        self.held = text[len(text) - keep:]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """The held-back text, once generation has ended without hitting a stop string."""
        text, self.held = self.held, ""
        return text

    def _partial_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best


class Utf8Decoder:
    """Turns token byte pieces into text, holding back a multi-byte character until it is complete."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, b: bytes) -> str:
        return self._decoder.decode(b)

    def flush(self) -> str:
        """What is left at the end, an unfinished character becoming U+FFFD."""
        return self._decoder.decode(b"", final=True)
