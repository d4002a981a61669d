"""Telemetry snapshots turned into plot-ready arrays. No Qt.

Snapshots (engine/runtime/telemetry.py) carry cumulative counters; the dashboard plots rates,
so each snapshot is differenced against the previous one. Time series live in preallocated
ring buffers that always expose their contents as one contiguous view (every sample is
written twice, at i and i + capacity), so a redraw hands pyqtgraph a view, never a copy or an
np.roll. When the engine restarts its counters drop back: the baselines reset instead of
producing negative rates.
"""
from __future__ import annotations

import math
from collections import deque

import numpy as np

GIB = float(1 << 30)


class Ring:
    """A fixed-size time series; `view()` returns (t, y) as contiguous views, oldest first."""

    def __init__(self, capacity: int, n_series: int = 1):
        self.capacity = capacity
        self._t = np.zeros(2 * capacity, np.float64)
        self._y = np.full((n_series, 2 * capacity), np.nan, np.float64)
        self._i = 0  # next write position in [0, capacity)
        self.count = 0

    def append(self, t: float, *values: float) -> None:
        i, c = self._i, self.capacity
        self._t[i] = self._t[i + c] = t
        self._y[:, i] = self._y[:, i + c] = values
        self._i = (i + 1) % c
        self.count = min(self.count + 1, c)

    def view(self, series: int = 0) -> tuple[np.ndarray, np.ndarray]:
        end = self._i + self.capacity
        start = end - self.count
        return self._t[start:end], self._y[series, start:end]

    def clear(self) -> None:
        self._i = self.count = 0
        self._y[:] = np.nan


class StatsSeries:
    """Everything the dashboard draws, updated by `ingest(snapshot)`."""

    HEAT_LEVELS = 128  # non-resident experts use LUT 0..127, resident ones 128..255

    def __init__(self, capacity: int = 1200, bar_window: int = 25):
        self.capacity = capacity
        self.t0: float | None = None
        self.latest_t = 0.0  # seconds since the first snapshot, of the newest one
        self.tokens = Ring(capacity, 1)  # decode tok/s now
        self.prefill = Ring(64, 1)  # one point per finished request
        self.hits = Ring(capacity, 3)  # % gpu_hit, uploaded, cpu_computed of the experts in this interval
        self.pcie = Ring(capacity, 1)  # MB/s host -> device
        self.memory = Ring(capacity, 2)  # GiB RAM, VRAM
        self.cpu = Ring(capacity, 1)  # % of one core
        self.snapshots = 0
        self.last: dict | None = None
        self.has_cache: bool | None = None
        self.layers: list[int] = []
        self.layer_hit_rate = np.zeros(0)
        self.image = np.zeros((0, 0), np.uint8)
        self.residency = np.zeros((0, 0), np.int32)
        self.heat = np.zeros((0, 0), np.float32)
        self._prev: dict | None = None
        self._layer_hist: deque = deque(maxlen=bar_window)

    def reset_counters(self) -> None:
        self._prev = None
        self._layer_hist.clear()

    def ingest(self, snap: dict) -> None:
        if snap.get("schema") is None or "time" not in snap:
            return  # a health event while loading, or something else: nothing to plot
        t_abs = float(snap["time"])
        if self.t0 is None:
            self.t0 = t_abs
        t = t_abs - self.t0
        self.latest_t = t
        prev = self._prev
        if prev is not None and (snap.get("requests", 0) < prev.get("requests", 0) or t_abs <= prev["time"]
                                 or _cache_shrank(prev.get("cache"), snap.get("cache"))):
            self.reset_counters()  # a new engine process: counters started again
            prev = None
        self.snapshots += 1
        self.tokens.append(t, float(snap.get("decode_tokens_per_s_now") or 0.0))
        last = snap.get("last_request") or {}
        if prev is not None and snap.get("requests", 0) > prev.get("requests", 0) and "prefill_tokens_per_s" in last:
            self.prefill.append(t, float(last["prefill_tokens_per_s"]))
        ram = snap.get("ram_used_bytes")
        vram = snap.get("gpu_memory_used_bytes")
        self.memory.append(t, ram / GIB if ram is not None else math.nan, vram / GIB if vram is not None else math.nan)
        cpu = snap.get("cpu_percent")
        self.cpu.append(t, float(cpu) if cpu is not None else math.nan)
        cache = snap.get("cache")
        self.has_cache = cache is not None
        if cache is not None:
            self._ingest_cache(t, cache, prev.get("cache") if prev else None, t_abs - prev["time"] if prev else None)
        self._prev = snap
        self.last = snap

    def _ingest_cache(self, t: float, cache: dict, prev: dict | None, dt: float | None) -> None:
        hit = np.asarray(cache["gpu_hit"], np.int64)
        up = over_pcie(cache)
        cpu = np.asarray(cache["cpu_computed"], np.int64)
        if prev is not None and len(prev["gpu_hit"]) == len(hit):
            d = np.array([hit.sum() - sum(prev["gpu_hit"]), up.sum() - over_pcie(prev).sum(),
                          cpu.sum() - sum(prev["cpu_computed"])], np.float64)
            total = d.sum()
            if total > 0:
                self.hits.append(t, *(100.0 * d / total))
            else:
                self.hits.append(t, math.nan, math.nan, math.nan)  # no expert traffic: a gap, not 0%
            rate = (cache["bytes_uploaded"] - prev["bytes_uploaded"]) / dt / 1e6 if dt and dt > 0 else 0.0
            self.pcie.append(t, max(rate, 0.0))
        else:
            self.hits.append(t, math.nan, math.nan, math.nan)
            self.pcie.append(t, 0.0)
        # per-layer hit rate over the recent window (the whole run until the window has traffic)
        self._layer_hist.append((hit, up, cpu))
        oh, ou, oc = self._layer_hist[0]
        dh, du, dc = hit - oh, up - ou, cpu - oc
        if (dh + du + dc).sum() == 0:
            dh, du, dc = hit, up, cpu
        tot = dh + du + dc
        self.layer_hit_rate = np.where(tot > 0, 100.0 * dh / np.maximum(tot, 1), 0.0)
        self.layers = list(cache["layers"])
        self.residency = np.asarray(cache["residency"], np.int32).reshape(len(self.layers), -1)
        self.heat = np.asarray(cache["heat"], np.float32).reshape(self.residency.shape)
        self.image = heat_image(self.residency, self.heat)


def _cache_shrank(prev: dict | None, cache: dict | None) -> bool:
    if not prev or not cache:
        return False
    return sum(cache["gpu_hit"]) + over_pcie(cache).sum() + sum(cache["cpu_computed"]) < \
        sum(prev["gpu_hit"]) + over_pcie(prev).sum() + sum(prev["cpu_computed"])


def over_pcie(cache: dict) -> np.ndarray:
    """Experts served over PCIe per layer: uploaded on a miss, or read by the GPU straight from
    pinned host memory (`gpu_mapped`, absent from engines before the mapped route)."""
    up = np.asarray(cache["uploaded"], np.int64)
    return up + np.asarray(cache.get("gpu_mapped", np.zeros_like(up)), np.int64)


def heat_image(residency: np.ndarray, heat: np.ndarray) -> np.ndarray:
    """uint8 [layers, experts] for a 256-entry LUT: 0..127 in RAM, 128..255 resident; brighter = hotter."""
    if heat.size == 0:
        return np.zeros(heat.shape, np.uint8)
    top = float(heat.max())
    level = np.zeros(heat.shape, np.float32) if top <= 0 else np.sqrt(np.clip(heat / top, 0, 1))
    idx = np.round(level * 127).astype(np.uint8)
    return np.where(residency >= 0, idx + 128, idx).astype(np.uint8)


def residency_lut() -> np.ndarray:
    """The heatmap's colours: blue-grey for experts in RAM, amber for experts resident on the GPU."""
    ramp = np.linspace(0.0, 1.0, 128)[:, None]
    cold_ram, hot_ram = np.array([46, 52, 64]), np.array([110, 170, 255])
    cold_gpu, hot_gpu = np.array([120, 60, 20]), np.array([255, 214, 60])
    lut = np.vstack([cold_ram + ramp * (hot_ram - cold_ram), cold_gpu + ramp * (hot_gpu - cold_gpu)])
    return np.round(lut).astype(np.uint8)
