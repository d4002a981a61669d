"""The device time of GPU work, two ways: eager calls queued behind a sleep kernel
(`accelerator_seconds`: what a step's kernels cost while its host work overlaps earlier ones), and
a CUDA graph of calls replayed (`graph_us`: kernels back to back, as the decode graph runs them).
Off CUDA both are the wall time. torch is imported on first use, so that the benchmark
commands that time with these start without it."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch

HOLD_CYCLES = 40_000_000  # the sleep that holds the GPU while a timed loop is queued: 20 ms at 2 GHz


def accelerator_seconds(fn: Callable[[], None], calls: int, device: torch.device,
                        hold_cycles: int = HOLD_CYCLES) -> float:
    """The device time of `calls` calls of `fn`. On CUDA the stream is first held by a sleep
    kernel of `hold_cycles` (longer than the host takes to launch the calls), so all the calls
    are queued before the first runs and the events between them time the GPU's work alone: a
    prompt step's host work runs while the GPU computes the layers before it, so what an extra
    expert costs the step is its kernels' time, not its launches'. Elsewhere the wall time."""
    import torch

    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return time.perf_counter() - start
    torch.cuda.synchronize(device)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(hold_cycles)
    begin.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3


def graph_us(calls: list[Callable[[], None]], replays: int, device: torch.device | None = None) -> float:
    """Microseconds per call: on CUDA (the default) one CUDA graph of all `calls` (argument-less
    functions, already run once so that every kernel is compiled), replayed; the best replay.
    On another `device` the best wall time of running them."""
    import torch

    if device is not None and device.type != "cuda":
        return min(accelerator_seconds(lambda: [fn() for fn in calls], 1, device) for _ in range(replays)) \
            * 1e6 / len(calls)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # once on the capture stream (its own semaphores), outside the capture
        calls[0]()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / len(calls))
    return best
