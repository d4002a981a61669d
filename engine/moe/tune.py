"""`--moe-gpu-miss-fraction auto`: the share of misses to upload, measured on this machine.

A miss can be uploaded (host -> GPU over PCIe, then computed there in microseconds) or
computed by the CPU pool from RAM; the two run at the same time, so a layer step with m misses
takes max(u * t_upload, (m - u) * t_cpu) for u uploads, which is least at
u / m = t_cpu / (t_upload + t_cpu). On a desktop (PCIe 4.0 ~25 GB/s, dual-channel RAM) the
two are close; on the H200 machine uploads win (pinned copies at ~50 GB/s). Both times are
taken on real experts of the model, from the memory the engine will read at run time.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from engine.layers.moe import ExpertWeights
from engine.moe.cpu_pool import CpuExpertPool

SAMPLES = 4  # experts timed each way (distinct ones: first-touch costs included, as in decode)


def measure_miss_fraction(layer: int, w: ExpertWeights, device: torch.device, pool: CpuExpertPool) -> dict[str, float]:
    """Times uploads and CPU computations of single experts of `w` (from the memory the engine
    reads: the map, or the pinned copies of --load-mode none); returns the times and the fraction."""
    tensors = [t.raw for t in (w.gate, w.up, w.down)]
    experts = np.linspace(0, w.n_expert - 1, 2 * SAMPLES).astype(np.int64)
    dst = [torch.empty(t.shape[1:], dtype=torch.uint8, device=device) for t in tensors]
    sources = [[t[e] for t in tensors] for e in experts[:SAMPLES]]
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for src in sources:
        for s, d in zip(src, dst):
            d.copy_(s, non_blocking=True)
    torch.cuda.synchronize(device)
    t_upload = (time.perf_counter() - start) / SAMPLES

    x = np.random.default_rng(0).standard_normal((1, w.gate.shape[2])).astype(np.float32)
    pool.compute(layer, x, np.zeros(1, np.int32), experts[-1:].astype(np.int32))  # builds the graph
    start = time.perf_counter()
    for e in experts[SAMPLES:]:
        pool.compute(layer, x, np.zeros(1, np.int32), np.array([e], np.int32))
    t_cpu = (time.perf_counter() - start) / SAMPLES
    return {"upload_s": t_upload, "cpu_s": t_cpu, "fraction": t_cpu / (t_upload + t_cpu)}
