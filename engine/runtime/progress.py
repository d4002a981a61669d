"""Load progress in bytes: each stage of a load that reads or copies tensors says how many bytes
it has done of how many, and moves the load's fraction across its share in proportion, so a
load of many seconds moves steadily instead of jumping between fixed points.

`Progress` is the one callback shape, (stage text, fraction of the whole load 0..1), that the
server's /health and the app's progress bar read."""
from __future__ import annotations

from typing import Callable

Progress = Callable[[str, float], None]  # (stage, fraction 0..1)


def fmt_bytes(n: int) -> str:
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    return f"{n / (1 << 20):.1f} MiB"


class ByteProgress:
    """`add(n)` after each n bytes read or copied; reports "STAGE: DONE of TOTAL" with the
    fraction `start + (end - start) * done / total`. Reports at most once per 1/STEPS of the
    total (a model of thousands of tensors would otherwise report thousands of times)."""

    STEPS = 200

    def __init__(self, report: Progress, stage: str, total: int, start: float, end: float):
        self.report, self.stage, self.total = report, stage, max(int(total), 1)
        self.start, self.end = start, end
        self.done = 0
        self._next = 0
        self._emit()

    def add(self, n: int) -> None:
        self.done = min(self.total, self.done + int(n))  # a tensor read twice counts once at most in total
        if self.done >= self._next or self.done == self.total:
            self._emit()

    def _emit(self) -> None:
        self._next = self.done + self.total // self.STEPS
        self.report(f"{self.stage}: {fmt_bytes(self.done)} of {fmt_bytes(self.total)}",
                    self.start + (self.end - self.start) * self.done / self.total)
