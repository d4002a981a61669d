"""Kernel compiles inside a timed region.

Triton compiles a kernel variant the first time a process launches it with a new specialization
(argument types, constexprs, whether each pointer is 16-byte aligned, whether each integer is
divisible by 16): seconds with an empty cache, milliseconds from its disk cache. A benchmark's
warm-up should have launched every variant its timed runs use; a compile inside them is time
that a figure should not hold. Session 14 found one that three sessions' figures held: tables
packed at count-dependent offsets compiled new variants in the middle of a long prompt (3-4 s).
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class Compiles:
    """What the JIT compiled (or loaded from its disk cache) while a block ran."""

    counted: bool = False  # False: this Triton has no compile hooks (nothing could be counted)
    count: int = 0
    seconds: float = 0.0
    kernels: list[str] = field(default_factory=list)  # the kernels' names, in order, with repeats

    def as_dict(self) -> dict:
        return {"counted": self.counted, "count": self.count, "seconds": round(self.seconds, 3),
                "kernels": sorted(set(self.kernels))}


@contextmanager
def counting_compiles() -> Iterator[Compiles]:
    """Counts the Triton JIT's compiles and their seconds while the block runs, through
    triton.knobs' compile hooks; hooks already set are called as before and put back after."""
    seen = Compiles()
    try:
        from triton import knobs
        runtime = knobs.runtime
        before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook
    except (ImportError, AttributeError):  # no Triton, or one without the hooks
        yield seen
        return
    started: list[float] = []

    def on_start(**kwargs) -> bool | None:
        started.append(time.perf_counter())
        return before(**kwargs) if before is not None else None  # True there skips the compile

    def on_end(**kwargs) -> None:
        if started:
            seen.seconds += time.perf_counter() - started.pop()
        seen.count += 1
        seen.kernels.append(kwargs["fn"].name)
        if after is not None:
            after(**kwargs)

    seen.counted = True
    runtime.jit_cache_hook, runtime.jit_post_compile_hook = on_start, on_end
    try:
        yield seen
    finally:
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = before, after
