"""One telemetry snapshot schema for the API (/v1/stats), the dashboard stream and /metrics.

Counters are cumulative since the engine started; rates are of the last finished request
and of a sliding window of recent decode steps. Engines fill what applies to them: the
llama.cpp engine has no expert cache, so its snapshot carries `"cache": null` rather than
zeros that would pretend to be measurements.
"""
from __future__ import annotations

import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import psutil

from engine.errors import printable

SCHEMA_VERSION = 1
PROMPT_ROUTES = ("streamed", "resident", "read back")


@dataclass
class CacheCounters:
    """Expert-cache counters, one row per MoE layer (index into `layers`)."""

    layers: list[int]
    n_expert: int
    slots_per_layer: int
    gpu_hit: np.ndarray = field(init=False)
    gpu_mapped: np.ndarray = field(init=False)  # decode misses the GPU read from pinned host memory
    uploaded: np.ndarray = field(init=False)
    cpu_computed: np.ndarray = field(init=False)
    swaps: np.ndarray = field(init=False)
    heat: np.ndarray = field(init=False)  # decayed access counts [layers, experts]
    residency: np.ndarray = field(init=False)  # slot index or -1 [layers, experts]
    bytes_uploaded: int = 0
    cpu_busy_s: float = 0.0
    load_mode: str = "mmap"  # where uploads and the CPU pool read experts: the map, or RAM copies ("none")
    miss_fraction: float = 0.0  # the share of misses uploaded (measured when auto)
    miss_fraction_tuning: dict | None = None  # upload_s, cpu_s per expert, when measured
    # A decode token's misses, as measured at load: the CPU pool's one-row call (cpu_s, and
    # cpu_expert_s per further expert), the mapped route's read (mapped_s; 0: none), and of m
    # misses how many the mapped route takes (mapped_of_misses[m]; [] while it is off)
    miss_routes: dict | None = None
    decode_path: str = "per layer"  # "graph": a decode token is one CUDA graph, its misses on the CPU pool
    # The decode graph's expert step per kind of layer (engine/moe/step_form.py): one launch or three,
    # and the µs per step it was chosen by; None until a decode graph was made
    decode_expert_step: dict | None = None
    # A prompt's MoE layer steps by route: its missing experts streamed, every expert resident
    # (neither reads its routing back), or the routing read back and the misses routed by cost.
    prompt_steps: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PROMPT_ROUTES, 0))
    prompt_graph_chunks: int = 0  # prompt chunks replayed as one CUDA graph (engine/runtime/prompt_runner.py)

    def __post_init__(self) -> None:
        n = len(self.layers)
        self.gpu_hit = np.zeros(n, np.int64)
        self.gpu_mapped = np.zeros(n, np.int64)
        self.uploaded = np.zeros(n, np.int64)
        self.cpu_computed = np.zeros(n, np.int64)
        self.swaps = np.zeros(n, np.int64)
        self.heat = np.zeros((n, self.n_expert), np.float32)
        self.residency = np.full((n, self.n_expert), -1, np.int32)


class Telemetry:
    HEAT_DECAY = 0.98  # per MoE step: heat follows the last ~50 tokens

    def __init__(self, engine: str, model: str):
        self.engine, self.model = engine, printable(model)
        self.lock = threading.Lock()
        self.cache: CacheCounters | None = None
        self.requests = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.last: dict[str, float] = {}
        self._decode_times: deque[float] = deque(maxlen=64)
        self.started = time.time()
        self.gpu_memory_used: int | None = None  # set by engines that own a GPU
        self._prefill: tuple[int, int] | None = None  # (prompt tokens processed, total) while a prompt runs

    def token_generated(self) -> None:
        with self.lock:
            self._decode_times.append(time.perf_counter())

    def prefill_progress(self, processed: int, total: int) -> None:
        """A prompt is being evaluated: `processed` of its `total` tokens are in the KV cache
        (tokens reused from the previous request count as processed)."""
        with self.lock:
            self._prefill = (processed, total)

    def prefill_done(self) -> None:
        with self.lock:
            self._prefill = None

    def request_done(self, prompt_tokens: int, completion_tokens: int, ttft_s: float,
                     prefill_tokens_per_s: float, decode_tokens_per_s: float) -> None:
        with self.lock:
            self.requests += 1
            self.prompt_tokens += prompt_tokens
            self.completion_tokens += completion_tokens
            self.last = {"ttft_s": ttft_s, "prefill_tokens_per_s": prefill_tokens_per_s,
                         "decode_tokens_per_s": decode_tokens_per_s}

    def _recent_decode_rate(self) -> float:
        t = self._decode_times
        if len(t) < 2 or time.perf_counter() - t[-1] > 2.0:
            return 0.0
        return (len(t) - 1) / (t[-1] - t[0]) if t[-1] > t[0] else 0.0

    def snapshot(self) -> dict:
        proc = psutil.Process(os.getpid())
        with self.lock:
            snap = {
                "schema": SCHEMA_VERSION,
                "time": time.time(),
                "engine": self.engine,
                "model": self.model,
                "requests": self.requests,
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "decode_tokens_per_s_now": self._recent_decode_rate(),
                "last_request": dict(self.last),
                "ram_used_bytes": proc.memory_info().rss,
                "gpu_memory_used_bytes": self.gpu_memory_used,
                "prefill": ({"processed": self._prefill[0], "total": self._prefill[1]}
                            if self._prefill is not None else None),
                "cache": None,
            }
            c = self.cache
            if c is not None:
                snap["cache"] = {
                    "layers": list(c.layers),
                    "n_expert": c.n_expert,
                    "slots_per_layer": c.slots_per_layer,
                    "gpu_hit": c.gpu_hit.tolist(),
                    "gpu_mapped": c.gpu_mapped.tolist(),
                    "uploaded": c.uploaded.tolist(),
                    "cpu_computed": c.cpu_computed.tolist(),
                    "swaps": c.swaps.tolist(),
                    "bytes_uploaded": c.bytes_uploaded,
                    "cpu_busy_s": c.cpu_busy_s,
                    "load_mode": c.load_mode,
                    "miss_fraction": c.miss_fraction,
                    "miss_fraction_tuning": c.miss_fraction_tuning,
                    "miss_routes": c.miss_routes,
                    "decode_path": c.decode_path,
                    "decode_expert_step": c.decode_expert_step,
                    "prompt_steps": dict(c.prompt_steps),
                    "prompt_graph_chunks": c.prompt_graph_chunks,
                    "residency": c.residency.tolist(),
                    "heat": np.round(c.heat, 3).tolist(),
                }
        return snap
