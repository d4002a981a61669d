"""Asynchronous host-to-accelerator copies of expert bytes, with completion you can poll.

On CUDA a copy runs on a side stream after the compute stream's work that was enqueued
before it (an evicted slot may still be read by kernels already in flight), and completion is
a CUDA event. When the accelerator role is played by CPU tensors (CI, CPU-only machines),
a copy is done at once, unless `delay_s` is set: then a worker thread does it that much later
and completion is its future, so tests can prove that nothing reads a slot before its copy
has landed.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

Pairs = list[tuple[torch.Tensor, torch.Tensor]]  # (host source, device destination)


class Copy:
    """A copy in flight: `landed()` polls it without blocking."""

    def __init__(self, event: "torch.cuda.Event | None" = None, future: Future | None = None):
        self.event, self.future = event, future

    def landed(self) -> bool:
        return self.event.query() if self.event is not None else self.future.done()


def upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device`, without making the host wait. A copy from pageable memory first
    waits for all work already enqueued on the stream (CUDA's rule), which in a prompt's layer
    step serialises every launch the host makes with the GPU; from pinned memory the copy is
    queued and the host goes on. The pinned buffer comes from torch's caching host allocator,
    which reuses it only once the copy has run."""
    t = torch.from_numpy(array)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


# Triton specializes a kernel on whether each pointer argument is 16-byte aligned: tables packed
# at offsets that follow their lengths would compile new variants (seconds each, seen as a 3-4 s
# stall in a long prompt's chunk) whenever a step's pair or tile count changes its remainder.
TABLE_ALIGN = 4  # int32 elements: 16 bytes


def aligned_offsets(lengths: list[int]) -> tuple[list[int], int]:
    """Where int32 tables of `lengths` start when packed one after another, each on a 16-byte
    boundary, and the packed length."""
    offsets, end = [], 0
    for n in lengths:
        offsets.append(end)
        end += -(-n // TABLE_ALIGN) * TABLE_ALIGN
    return offsets, end


def upload_tables(tables: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Int32 tables on `device` in one copy (upload), each view starting on a 16-byte boundary."""
    offsets, end = aligned_offsets([len(t) for t in tables])
    packed = np.zeros(end, np.int32)
    for t, o in zip(tables, offsets):
        packed[o:o + len(t)] = t
    on_device = upload(packed, device)
    return [on_device[o:o + len(t)] for t, o in zip(tables, offsets)]


_DONE: Future = Future()
_DONE.set_result(None)


class Copier:
    def __init__(self, device: torch.device, delay_s: float = 0.0):
        self.device = device
        self.delay_s = delay_s
        self.bytes_copied = 0
        self.host_copy_s = 0.0  # time spent copying on the host (CPU tensors only)
        self._lock = threading.Lock()
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pool = (ThreadPoolExecutor(1, thread_name_prefix="expert-copy")
                      if delay_s and self._stream is None else None)

    def copy(self, pairs: Pairs) -> Copy:
        """Starts copying each pair and returns (a CPU copy without a delay is done by then)."""
        with self._lock:
            self.bytes_copied += sum(src.numel() * src.element_size() for src, _ in pairs)
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                for src, dst in pairs:
                    dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            return Copy(event=event)
        if self._pool is not None:
            return Copy(future=self._pool.submit(self._copy_on_host, pairs))
        self._copy_on_host(pairs)
        return Copy(future=_DONE)

    def wait(self, handle: Copy) -> None:
        """Orders later compute after `handle` (on CUDA without blocking the host)."""
        if handle.event is not None:
            torch.cuda.current_stream(self.device).wait_event(handle.event)
        else:
            handle.future.result()

    def _copy_on_host(self, pairs: Pairs) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)
        start = time.perf_counter()
        for src, dst in pairs:
            dst.copy_(src)
        self.host_copy_s += time.perf_counter() - start

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
