"""The CPU expert pool: expert FFNs computed by ggml's own CPU kernels on the GGUF bytes.

Misses of the expert cache are computed here, from the memory-mapped quantized blocks (no
dequantized copy, no copy at all: ggml tensors point into the map), with the same kernels and
the same activation rounding llama.cpp uses, so an expert gives the same output whether it ran
here or on the accelerator (engine/layers/moe.py `expert_ffn` is the reference).

Every (row, expert) pair is its own ggml "token" with one used expert: x3 [D, 1, n_pairs],
ids [1, n_pairs]. ggml_mul_mat_id groups the tokens by expert, so each expert's bytes are read
once per call however many pairs use it, and the result is unweighted: the caller combines.

Building a graph through ctypes costs 130-400 µs (a dozen calls, plus the plan), several
times the ~20 µs of Python around a cached one, so graphs are built once per (layer shape,
n_pairs) and reused: layers of one shape share a graph whose weight tensors are re-pointed at
the layer's bytes before each compute. All graphs keep their activations in one arena (calls
are serialised), so a cached graph is only metadata: 6.2 KiB, at most max_rows per shape.
"""
from __future__ import annotations

import ctypes as C
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from engine.layers.moe import SILU, SWIGLU_OAI, ExpertTensor, ExpertWeights
from engine.quant import ggml_lib as G

OAI_ALPHA, OAI_LIMIT = 1.702, 7.0  # gpt-oss, as llama.cpp passes them to ggml_swiglu_oai
_GRAPH_SIZE = 16  # 7 nodes (3 mul_mat_id, 3 add_id, 1 glu) and 8 leafs at most
_N_TENSORS = 15  # 3 weights, 3 biases, x3, ids and the 7 nodes
_ALIGN = 64


@dataclass(frozen=True)
class _Shape:
    """What a graph depends on: layers with equal shapes share graphs."""

    qtypes: tuple[int, int, int]  # gate, up, down
    n_embd: int
    n_ff: int
    n_expert: int
    activation: str
    has_bias: tuple[bool, bool, bool]


@dataclass
class _Layer:
    shape: _Shape
    data: tuple[int, ...]  # data pointers of gate, up, down, then the biases present


@dataclass
class _Graph:
    ctx: int
    graph: int
    plan: G.GGMLCPlan
    weights: list[G.GGMLTensor]  # re-pointed per call, in _Layer.data order
    x: np.ndarray  # [n, D] view of x3
    ids: np.ndarray  # [n] view
    out: np.ndarray  # [n, D] view of the result


class CpuExpertPool:
    """Unweighted expert outputs for (row, expert) pairs, on a persistent ggml threadpool.

    `compute` runs on the calling thread, serialised by a lock. This libggml-cpu is an OpenMP
    build: the ggml threadpool only carries per-thread state, and the threads are the calling
    thread's OpenMP team. libgomp gives every calling thread a team of its own and, once its
    teams hold more threads than there are cores, stops spinning between calls (its throttled
    spin count), so each call then wakes sleeping threads. The engine therefore calls from one
    thread only (its own: prompts and decode alike). On the H200 machine a decode token's one-
    or two-expert calls took ~250 µs per missed expert while a second thread held a team,
    against ~90 µs for a one-expert call alone; GOMP_SPINCOUNT changed nothing, as throttling
    predicts (docs/BENCHMARKS.md).
    Memory besides the map: an arena of 4 * max_rows * (3 D + 5 F) bytes (10 MiB for Qwen3-30B).
    """

    def __init__(self, expert_weights: dict[int, ExpertWeights], n_threads: int, max_rows: int = 256):
        if n_threads < 1 or max_rows < 1:
            raise ValueError(f"n_threads and max_rows must be positive, got {n_threads} and {max_rows}")
        self._api = G.cpu()
        self.n_threads, self.max_rows = n_threads, max_rows
        self.busy_seconds = 0.0
        self._lock = threading.Lock()
        self._graphs: dict[tuple[_Shape, int], _Graph] = {}
        self._threadpool = None
        self._keep: list[object] = [expert_weights]  # everything ggml tensors point into
        self._layers = {layer: self._bind_layer(w) for layer, w in expert_weights.items()}
        # Floats per pair: x3, d and its bias sum (3 D); g, u, their bias sums and the activation (5 F); the id.
        widest = max((3 * lw.shape.n_embd + 5 * lw.shape.n_ff + 1 for lw in self._layers.values()), default=0)
        self._arena = np.empty(4 * max_rows * widest + _N_TENSORS * _ALIGN, dtype=np.uint8)
        self._work = np.empty(0, dtype=np.uint8)
        params = self._api.ggml_threadpool_params_default(n_threads)
        self._threadpool = self._api.ggml_threadpool_new(C.byref(params))

    def _bind_layer(self, w: ExpertWeights) -> _Layer:
        if w.activation not in (SILU, SWIGLU_OAI):
            raise ValueError(f"the CPU pool has no ggml op for activation {w.activation!r}")
        mats = (w.gate, w.up, w.down)
        for t in mats:
            n_expert, rows, cols = t.shape
            if t.raw.device.type != "cpu" or not t.raw.is_contiguous():
                raise ValueError("expert tensors must be contiguous host memory (the memory-mapped GGUF)")
            # ggml will read n_expert * rows * row_size bytes from the pointer: they must all be there.
            if n_expert * rows * G.row_size(t.qtype, cols) != t.raw.numel():
                raise ValueError(f"{t.qtype.name} expert tensor {t.shape} holds {t.raw.numel()} bytes, "
                                 f"ggml expects {n_expert * rows * G.row_size(t.qtype, cols)}")
        biases = [self._bias(t) for t in mats if t.bias is not None]
        n_expert, n_ff, n_embd = w.gate.shape
        shape = _Shape(tuple(int(t.qtype) for t in mats), n_embd, n_ff, n_expert, w.activation,
                       tuple(t.bias is not None for t in mats))
        return _Layer(shape, tuple(t.raw.data_ptr() for t in mats) + tuple(b.ctypes.data for b in biases))

    def _bias(self, t: ExpertTensor) -> np.ndarray:
        b = np.ascontiguousarray(t.bias.detach().to("cpu", torch.float32).numpy())
        self._keep.append(b)
        return b

    def compute(self, layer: int, x: np.ndarray, rows: np.ndarray, experts: np.ndarray) -> np.ndarray:
        """Expert experts[p] applied to x[rows[p]] for each pair p: float32 [n_pairs, D], unweighted."""
        lw = self._layers[layer]
        d = lw.shape.n_embd
        rows, experts = np.asarray(rows), np.asarray(experts)
        n = len(rows)
        if x.ndim != 2 or x.shape[1] != d or len(experts) != n:
            raise ValueError(f"want x [n_rows, {d}] and equally long rows/experts, got x {x.shape}, "
                             f"{n} rows, {len(experts)} experts")
        if n > self.max_rows:
            raise ValueError(f"{n} pairs exceed the pool's max_rows={self.max_rows}; split the job")
        if n == 0:
            return np.empty((0, d), dtype=np.float32)
        # ggml only asserts ids in debug builds: an out-of-range id would read past the map.
        if experts.min() < 0 or experts.max() >= lw.shape.n_expert:
            raise ValueError(f"expert ids must lie in [0, {lw.shape.n_expert}), got {experts.min()}..{experts.max()}")
        with self._lock:
            if self._threadpool is None:
                raise RuntimeError("the CPU expert pool is closed")
            t0 = time.perf_counter()
            gr = self._graphs.get((lw.shape, n)) or self._build(lw.shape, n)
            for t, ptr in zip(gr.weights, lw.data):
                t.data = ptr
            np.take(np.asarray(x, dtype=np.float32), rows, axis=0, out=gr.x)
            gr.ids[:] = experts
            gr.plan.work_data = self._work.ctypes.data
            status = self._api.ggml_graph_compute(gr.graph, C.byref(gr.plan))
            if status != G.GGML_STATUS_SUCCESS:
                raise RuntimeError(f"ggml_graph_compute failed with status {status}")
            out = gr.out.copy()
            self.busy_seconds += time.perf_counter() - t0
        return out

    def _build(self, s: _Shape, n: int) -> _Graph:
        api = self._api
        mem = _N_TENSORS * api.ggml_tensor_overhead() + api.ggml_graph_overhead_custom(_GRAPH_SIZE, False)
        ctx = api.ggml_init(G.GGMLInitParams(mem, None, True))  # data: the map, the biases, the arena
        new3, new2, f32 = api.ggml_new_tensor_3d, api.ggml_new_tensor_2d, G.GGML_TYPE_F32
        out_rows = (s.n_ff, s.n_ff, s.n_embd)
        mats = [new3(ctx, q, cols, rows, s.n_expert)
                for q, rows, cols in zip(s.qtypes, out_rows, (s.n_embd, s.n_embd, s.n_ff))]
        biases = [new2(ctx, f32, rows, s.n_expert) if has else None for rows, has in zip(out_rows, s.has_bias)]
        x3 = new3(ctx, f32, s.n_embd, 1, n)
        ids = new2(ctx, G.GGML_TYPE_I32, 1, n)
        acts = [x3, ids]

        def op(ptr: int) -> int:
            acts.append(ptr)
            return ptr

        def project(i: int, inp: int) -> int:
            y = op(api.ggml_mul_mat_id(ctx, mats[i], inp, ids))
            return op(api.ggml_add_id(ctx, y, biases[i], ids)) if biases[i] is not None else y

        g, u = project(0, x3), project(1, x3)
        a = op(api.ggml_swiglu_split(ctx, g, u) if s.activation == SILU
               else api.ggml_swiglu_oai(ctx, g, u, OAI_ALPHA, OAI_LIMIT))
        d = project(2, a)
        graph = api.ggml_new_graph_custom(ctx, _GRAPH_SIZE, False)
        api.ggml_build_forward_expand(graph, d)

        # No memory reuse between activations (ggml-alloc would): at max_rows they still fit the arena.
        offset, base = 0, self._arena.ctypes.data
        for ptr in acts:
            G.tensor(ptr).data = base + offset
            offset += -(-api.ggml_nbytes(ptr) // _ALIGN) * _ALIGN
        assert offset <= self._arena.nbytes, "arena smaller than the activations of max_rows pairs"
        plan = api.ggml_graph_plan(graph, self.n_threads, self._threadpool)
        if plan.work_size > self._work.nbytes:
            self._work = np.empty(plan.work_size, dtype=np.uint8)
        weights = [G.tensor(t) for t in mats + [b for b in biases if b is not None]]
        gr = _Graph(ctx, graph, plan, weights, _view(x3, (n, s.n_embd), np.float32), _view(ids, (n,), np.int32),
                    _view(d, (n, s.n_embd), np.float32))
        self._graphs[(s, n)] = gr
        return gr

    @property
    def n_graphs(self) -> int:
        """Graphs built so far (one per layer shape and pair count seen)."""
        return len(self._graphs)

    def close(self) -> None:
        """Frees the threadpool and the graphs, after a call in progress (idempotent)."""
        if getattr(self, "_threadpool", None) is None:
            return
        with self._lock:
            for gr in self._graphs.values():
                self._api.ggml_free(gr.ctx)
            self._graphs.clear()
            self._api.ggml_threadpool_free(self._threadpool)
            self._threadpool = None

    def __enter__(self) -> "CpuExpertPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


def _view(ptr: int, shape: tuple[int, ...], dtype: type) -> np.ndarray:
    """A numpy array over a ggml tensor's data (no copy; valid while the pool's arena lives)."""
    count = int(np.prod(shape))
    buf = (C.c_byte * (count * np.dtype(dtype).itemsize)).from_address(G.tensor(ptr).data)
    return np.frombuffer(buf, dtype=dtype, count=count).reshape(shape)
