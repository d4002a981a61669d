"""`--moe-gpu-miss-fraction auto`: the share of misses to upload, measured on this machine.

A miss can be uploaded (host -> GPU over PCIe, then computed there in microseconds) or
computed by the CPU pool from RAM; the two run at the same time, so a layer step with m misses
takes max(u * t_upload, (m - u) * t_cpu) for u uploads, which is least at
u / m = t_cpu / (t_upload + t_cpu) (engine/plan/sizing.balanced_fraction, which the planner
feeds with bandwidths instead). On a desktop (PCIe 4.0 ~25 GB/s, dual-channel RAM) the
two are close; on the H200 machine uploads win (pinned copies at ~50 GB/s). Both times are
taken on real experts of the model, from the memory the engine will read at run time.

A decode token's misses have a third route: the GPU reads the expert straight from pinned host
memory (UVA) inside the token's graph, over PCIe, while the CPU pool computes the others
(`mapped_misses`: how many of a step's m misses to read so, the first in top-k order, so that
both finish soonest). Measured on the H200's host (PCIe 5): the kernels read mapped memory at
17-27 GB/s, a Q4_K expert of Qwen3-30B-A3B in ~137 µs, against the pool's ~89 µs for one expert
and ~50 µs for each further one in the same call: the route pays from two or three misses a
layer on, beside the pool, never instead of it. It needs the experts in pinned RAM
(`--load-mode none`, or auto where it copies them) and is timed (and checked against the pool's
result) at load; a failed check leaves it off, as does MOESTUDIO_MAPPED_MISSES=0.

A step of many rows (prefill) routes expert by expert instead (`balanced_uploads`): an upload
costs the same whatever the rows, while the CPU pool's cost grows with them, so the misses
with the most rows go to the GPU until the two sides would finish together, the GPU's side
counting its hits and, per streamed miss, the slower of its copy and its compute (the copy of
the next overlaps the compute of this one). A step large enough may stream every expert its
layer lacks without reading its routing back (`streams_all`); once a prompt's chunk shows that
the text keeps to the resident experts, the next reads back instead (`streaming_pays`).
"""
from __future__ import annotations

import os
import time
import warnings

import numpy as np
import torch

from dataclasses import dataclass

from engine.layers.moe import ExpertWeights, expert_ffn
from engine.moe.cpu_pool import CpuExpertPool
from engine.plan.sizing import balanced_fraction
from engine.quant.dequant import dequantize
from engine.runtime.device_time import accelerator_seconds

SAMPLES = 4  # experts timed each way (distinct ones: first-touch costs included, as in decode)
TIMINGS = 4  # uploads one by one and streamed, the CPU pool at one row and at MANY_ROWS: SAMPLES experts each
MANY_ROWS = 64  # rows of one expert in the CPU pool's second timing: its cost per extra row
GROUPED_EXPERTS = 8  # experts of MANY_ROWS rows in the timed grouped launch (its fixed costs shared)
# The mapped route's check at load: the GPU's result against the CPU pool's, relative to its
# largest value (float32 summation order apart they agree to ~1e-6; a wrong read is off by O(1)).
MAPPED_CHECK_TOL = 1e-3
# A many-row step streams every expert its layer lacks (no read-back of its routing) from this
# many pairs per expert on: each expert then goes unchosen with probability (1 - k/E)^T < e^-4.
STREAM_ALL_PAIRS_PER_EXPERT = 4


@dataclass(frozen=True)
class RouteCosts:
    """Seconds per expert: one upload among a many-row step's stream of them; the CPU pool's FFN
    at one row, plus each extra row; the accelerator's FFN on a staged expert in a many-row step;
    each further expert of a one-row pool call; the GPU's FFN read from mapped host memory at
    one row (0: no such route)."""
    upload_s: float
    cpu_s: float
    cpu_row_s: float
    gpu_s: float
    cpu_expert_s: float = 0.0
    mapped_s: float = 0.0

    def cpu(self, rows: np.ndarray) -> np.ndarray:
        return self.cpu_s + self.cpu_row_s * (rows - 1)

    def cpu_experts(self, n: int) -> float:
        """The pool's one-row call over n experts (a decode token's misses in one layer)."""
        return self.cpu_s + self.cpu_expert_s * (n - 1) if n else 0.0


def mapped_misses(k: int, costs: RouteCosts | None) -> np.ndarray:
    """For m = 0 .. k misses of a one-token layer step: how many the GPU reads from mapped host
    memory (the first in top-k order) while the pool computes the rest, so that the two, side
    by side, finish soonest (ties: fewer mapped). All zeros without the route."""
    out = np.zeros(k + 1, np.int32)
    if costs is None or costs.mapped_s <= 0:
        return out
    for m in range(1, k + 1):
        out[m] = min(range(m + 1), key=lambda j: (max(j * costs.mapped_s, costs.cpu_experts(m - j)), j))
    return out


def balanced_uploads(rows: np.ndarray, n_hits: int, costs: RouteCosts) -> int:
    """How many of a step's misses, ordered by rows (most first), to upload so that the GPU
    (its hits, then the uploads) and the CPU pool, running at the same time, finish soonest;
    the rest go to the CPU."""
    cpu_left = float(costs.cpu(rows).sum())
    gpu, n = n_hits * costs.gpu_s, 0
    per_upload = max(costs.upload_s, costs.gpu_s)
    for cost in costs.cpu(rows):
        if max(gpu + per_upload, cpu_left - cost) >= max(gpu, cpu_left):
            break
        gpu, cpu_left, n = gpu + per_upload, cpu_left - cost, n + 1
    return n


def many_pairs(n_pairs: int, n_expert: int) -> bool:
    """Whether a step of `n_pairs` (row, top-k) pairs all but certainly chooses every expert of a
    uniform router: the steps that may stream their layer's missing experts."""
    return n_pairs >= STREAM_ALL_PAIRS_PER_EXPERT * n_expert


def streams_all(n_rows: int, k: int, n_expert: int, costs: RouteCosts) -> bool:
    """Whether a step of `n_rows` rows and top-k `k` may stream every missing expert of its layer
    without reading its routing back: all but certain to be chosen, and each cheaper to stream
    than the CPU pool's FFN over the rows it gets on average."""
    if not many_pairs(n_rows * k, n_expert):
        return False
    return costs.upload_s <= float(costs.cpu(np.array([n_rows * k / n_expert]))[0])


def read_back_seconds(rows: np.ndarray, n_hits: int, costs: RouteCosts) -> float:
    """The experts' time of a step that read its routing back, with misses of `rows` rows: the
    GPU (its `n_hits` hit experts, then the misses balanced_uploads sends up) and the CPU pool
    (the other misses) side by side."""
    rows = np.sort(rows)[::-1]
    n_up = balanced_uploads(rows, n_hits, costs)
    gpu = n_hits * costs.gpu_s + n_up * max(costs.upload_s, costs.gpu_s)
    return max(gpu, float(costs.cpu(rows[n_up:]).sum()))


def streaming_pays(n_missing: int, expected_rows: np.ndarray, n_hits: int, costs: RouteCosts,
                   read_back_s: float) -> bool:
    """Whether streaming a layer's `n_missing` missing experts beats reading its routing back,
    when the step is expected to give them `expected_rows` and to use `n_hits` resident experts
    (the layer's last many-row step, scaled: a text's prompt keeps to the experts its residency
    adapts to, so most streamed experts can go unused). Streamed, the copies of every missing
    expert run beside the GPU's compute of the used ones; read back, the GPU idles while the
    host waits (`read_back_s`, measured), then the step splits its misses (read_back_seconds)."""
    used = expected_rows[expected_rows > 0]
    streamed = max(n_missing * costs.upload_s, (n_hits + len(used)) * costs.gpu_s)
    return streamed <= read_back_s + read_back_seconds(used, n_hits, costs)


def measure_costs(layer: int, w: ExpertWeights, device: torch.device, pool: CpuExpertPool) -> dict[str, float]:
    """Times single experts of `w`: uploads (from the memory the engine reads: the map, or the
    pinned copies of --load-mode none) one by one as decode waits for them (`upload_s`, behind
    the one-token miss fraction) and back to back as a prompt's turn streams them (`stream_s`:
    their device time, the copy engine's and not the host's waits), the CPU pool's FFN at one
    row and at MANY_ROWS (medians: one call stalled by another process must not set the
    routing for the session), and the accelerator's FFN on a staged expert at MANY_ROWS rows,
    through the path a many-row step takes (the grouped GEMM where it applies, per expert of a
    launch of GROUPED_EXPERTS; else dequantize + matmul), its device time
    (`accelerator_seconds`); the pool's one-row call over SAMPLES experts (`cpu_expert_s`: each
    one past the first) and, where the experts are in pinned RAM on CUDA, the mapped route's
    FFN per expert (`mapped_s`, mapped_seconds; else 0); returns the times and the one-token
    miss fraction they imply (`route_costs` makes the RouteCosts of them)."""
    tensors = [t.raw for t in (w.gate, w.up, w.down)]
    experts = np.linspace(0, w.n_expert - 1, TIMINGS * SAMPLES).astype(np.int64).reshape(TIMINGS, SAMPLES)
    dst = [torch.empty(t.shape[1:], dtype=torch.uint8, device=device) for t in tensors]

    def upload(sample: np.ndarray) -> None:
        for e in sample:
            for t, d in zip(tensors, dst):
                d.copy_(t[e], non_blocking=True)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda _: None)
    sync(device)
    start = time.perf_counter()
    upload(experts[0])
    sync(device)
    t_upload = (time.perf_counter() - start) / SAMPLES
    t_stream = accelerator_seconds(lambda: upload(experts[1]), 1, device) / SAMPLES
    staged = int(experts[1, -1])  # what dst holds now

    x = np.random.default_rng(0).standard_normal((MANY_ROWS, w.gate.shape[2])).astype(np.float32)

    def cpu_seconds(rows: int, sample: np.ndarray) -> float:
        pool.compute(layer, x, np.arange(rows, dtype=np.int32), np.zeros(rows, np.int32))  # builds the graph
        times = []
        for e in sample:
            start = time.perf_counter()
            pool.compute(layer, x, np.arange(rows, dtype=np.int32), np.full(rows, e, np.int32))
            times.append(time.perf_counter() - start)
        return float(np.median(times))

    t_cpu = cpu_seconds(1, experts[2])
    t_row = max(0.0, (cpu_seconds(MANY_ROWS, experts[3]) - t_cpu) / (MANY_ROWS - 1))

    def cpu_call(sample: np.ndarray) -> float:  # one row through each expert: a decode layer's misses
        start = time.perf_counter()
        pool.compute(layer, x[:1], np.zeros(len(sample), np.int32), sample.astype(np.int32))
        return time.perf_counter() - start
    t_expert = max(0.0, (float(np.median([cpu_call(experts[0]), cpu_call(experts[1])])) - t_cpu) / (SAMPLES - 1))
    t_mapped = 0.0
    if device.type == "cuda" and mapped_route_enabled() and all(t.is_pinned() for t in tensors):
        t_mapped = mapped_seconds(layer, w, device, pool, x[:1], experts[2])

    x_dev = torch.from_numpy(x).to(device)
    from engine.moe.hybrid import TRITON_MAX_PAIRS, _use_grouped  # hybrid imports this module

    if _use_grouped(w, x_dev, max(TRITON_MAX_PAIRS + 1, GROUPED_EXPERTS * MANY_ROWS)):
        # The executor's many-row path on CUDA: the grouped GEMM, timed on GROUPED_EXPERTS experts
        # of MANY_ROWS rows each (all read from the staged copy: one slot) per launch, laid out
        # once: a step lays its pairs out once for all its experts.
        from engine.quant import grouped_gemm as gg

        rows = np.arange(GROUPED_EXPERTS * MANY_ROWS)
        x_many = x_dev[rows % MANY_ROWS]
        ids = (rows // MANY_ROWS).reshape(-1, 1) % w.n_expert
        slot_of = np.where(np.arange(w.n_expert) < GROUPED_EXPERTS, 0, -1).astype(np.int32)
        groups = gg.Groups.build(ids, slot_of, gg.GATE_UP_CONFIG[w.gate.qtype].block_m, device)
        slot_buffers = [d.unsqueeze(0) for d in dst]
        out = torch.empty((1, len(rows), x.shape[1]), device=device)

        def staged_ffn() -> None:
            gg.groups_forward(x_many, slot_buffers, w, groups, None, out)
        per_call = GROUPED_EXPERTS
    else:
        def staged_ffn() -> None:
            expert_ffn(x_dev, *(dequantize(d, t.qtype, t.shape[1:]) for d, t in zip(dst, (w.gate, w.up, w.down))),
                       w, staged)
        per_call = 1

    staged_ffn()
    t_gpu = accelerator_seconds(staged_ffn, SAMPLES, device) / SAMPLES / per_call
    return {"upload_s": t_upload, "stream_s": t_stream, "cpu_s": t_cpu, "cpu_row_s": t_row, "gpu_s": t_gpu,
            "cpu_expert_s": t_expert, "mapped_s": t_mapped, "fraction": balanced_fraction(t_upload, t_cpu)}


def mapped_route_enabled() -> bool:
    """The mapped route is measured at load, and taken where it pays, unless MOESTUDIO_MAPPED_MISSES=0
    (the decode benchmarks' A/B; a way out should a platform misread pinned memory)."""
    return os.environ.get("MOESTUDIO_MAPPED_MISSES", "1") != "0"


def mapped_seconds(layer: int, w: ExpertWeights, device: torch.device, pool: CpuExpertPool, x: np.ndarray,
                   sample: np.ndarray) -> float:
    """The GPU's FFN of one row x [1, D] through each expert of `sample`, read from the experts'
    pinned host rows (the mapped miss route), per expert in device time; 0.0, with a warning,
    where the kernels cannot read them so or their result is not the CPU pool's."""
    from engine.quant import triton_kernels as tk

    if not tk.supports(w):
        return 0.0
    rows = [tk.HostTensor(t.raw) for t in (w.gate, w.up, w.down)]
    x_dev = torch.from_numpy(x).to(device)
    zero = torch.zeros(1, dtype=torch.int32, device=device)
    weight = torch.ones(1, 1, device=device)
    pairs = [torch.tensor([int(e)], dtype=torch.int32, device=device) for e in sample]
    out = torch.zeros(len(sample), 1, 1, x.shape[1], device=device)

    def read_mapped() -> None:
        for pair, o in zip(pairs, out):
            tk.experts_forward(x_dev, rows, w, zero, zero, pair, pair, weight, o)
    try:
        read_mapped()
        got = out[:, 0, 0].cpu().numpy()
    except Exception as e:  # a driver or platform without mapped host memory for kernels
        warnings.warn(f"the GPU cannot read experts from pinned host memory here ({type(e).__name__}: {e}); "
                      "decode misses all go to the CPU pool", RuntimeWarning, stacklevel=2)
        return 0.0
    want = pool.compute(layer, x, np.zeros(len(sample), np.int32), sample.astype(np.int32))
    err = float(np.abs(got - want).max()) / max(float(np.abs(want).max()), 1e-30)
    if not np.isfinite(err) or err > MAPPED_CHECK_TOL:
        warnings.warn(f"experts read from pinned host memory differ from the CPU pool's by {err:.1e} of their "
                      "largest value; decode misses all go to the CPU pool", RuntimeWarning, stacklevel=2)
        return 0.0
    return accelerator_seconds(read_mapped, 1, device) / len(sample)


def route_costs(measured: dict[str, float]) -> RouteCosts:
    """The costs a step routes its misses by, from measure_costs' times."""
    return RouteCosts(measured["stream_s"], measured["cpu_s"], measured["cpu_row_s"], measured["gpu_s"],
                      measured["cpu_expert_s"], measured["mapped_s"])
