"""The CPU expert pool computes what the reference expert FFN computes, with ggml's kernels.

The reference (`expert_ffn`) rounds activations to the weight's vec_dot type as ggml does.
Given ggml's own activation, the two agree to float32 summation noise (<= 5e-7 of a pair's
largest output, every quant type). End to end, the activation between the up/gate and the
down projection differs by ~1e-6 (summation order, ggml's SIMD expf), and where a value sits
that close to a rounding boundary of the down projection's input type (f16 ulp, Q8 step) the
two round it apart: one step of one value, up to a few 1e-3 of the output on these models.
So each output must lie within RTOL of the reference plus what such near-tie values can move
it, and the typical pair must agree to float noise.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from engine.layers.moe import ExpertTensor, ExpertWeights, activate
from engine.models import build_model
from engine.moe.cpu_pool import CpuExpertPool
from engine.quant.activation import activation_type, round_activation

RTOL = 1e-5
NEAR_TIE = 4e-6  # of the activation's largest value: 5x the CPU/reference difference observed (8e-7)

CASES = [("qwen3moe", qt) for qt in (QT.F16, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K)] + [("gpt-oss", QT.MXFP4)]


def _patterns(n_expert: int, rng: np.random.Generator) -> list[tuple[np.ndarray, np.ndarray]]:
    """(rows, experts) over 5 rows: a single pair, one row's top-k, repeats, every pair, and one
    expert with 10 pairs (from 8 pairs an expert, K-quants take ggml's tiled kernel)."""
    everything = np.array([(r, e) for r in range(5) for e in range(n_expert)], dtype=np.int32).T
    return [
        (np.array([2], np.int32), np.array([n_expert - 1], np.int32)),
        (np.zeros(4, np.int32), rng.choice(n_expert, 4, replace=False).astype(np.int32)),
        (np.array([0, 1, 2, 3, 4, 0, 2, 4, 4], np.int32), np.array([1, 1, 3, 0, 7, 7, 1, 2, 2], np.int32) % n_expert),
        (everything[0], everything[1]),
        (np.tile(np.arange(5, dtype=np.int32), 2), np.full(10, 3, np.int32)),
    ]


def _near_tie_slack(a: torch.Tensor, weight_qtype: QT) -> torch.Tensor:
    """Per value of `a` [1, F]: how far its rounded value can move when `a` moves by NEAR_TIE."""
    eps = NEAR_TIE * float(a.abs().max())
    if activation_type(weight_qtype) == QT.F16:
        return ((a + eps).half().float() - (a - eps).half().float()).abs()
    block = 32 if activation_type(weight_qtype) == QT.Q8_0 else 256  # Q8_0 / Q8_K
    b = a.reshape(-1, block)
    d = b.abs().amax(dim=1, keepdim=True) / 127
    steps = (torch.round((b + eps) / d) - torch.round((b - eps) / d)).abs()
    return (steps * d + eps).reshape(a.shape)  # + eps: the block scale moves too


def _reference(w: ExpertWeights, x: np.ndarray, rows: np.ndarray, experts: np.ndarray):
    """expert_ffn per pair, and per output the tolerance that near-tie roundings allow."""
    ref, bound = np.empty((2, len(rows), x.shape[1]), np.float32)
    for p, (r, e) in enumerate(zip(rows.tolist(), experts.tolist())):
        xr = round_activation(torch.from_numpy(x[r:r + 1]), w.gate.qtype)
        gate, up, down = w.gate.expert(e, "cpu"), w.up.expert(e, "cpu"), w.down.expert(e, "cpu")
        g = xr @ gate.T + (w.gate.bias[e] if w.gate.bias is not None else 0)
        u = xr @ up.T + (w.up.bias[e] if w.up.bias is not None else 0)
        a = activate(w.activation, g, u)
        d = round_activation(a, w.down.qtype) @ down.T + (w.down.bias[e] if w.down.bias is not None else 0)
        ref[p] = d[0].numpy()
        bound[p] = RTOL * float(d.abs().max()) + (_near_tie_slack(a, w.down.qtype) @ down.abs().T)[0].numpy()
    return ref, bound


@pytest.mark.parametrize("arch,qtype", CASES, ids=[qt.name for _, qt in CASES])
def test_matches_the_reference_expert_ffn(make_model, arch, qtype):
    experts_by_layer = build_model(make_model(arch, qtype)).expert_weights
    if arch == "gpt-oss":  # the case that exercises ggml_add_id and ggml_swiglu_oai
        assert all(t.bias is not None for w in experts_by_layer.values() for t in (w.gate, w.up, w.down))
    rng = np.random.default_rng(0)
    relative = []
    with CpuExpertPool(experts_by_layer, n_threads=1) as pool:
        for layer, w in experts_by_layer.items():
            assert w.gate.qtype == qtype
            x = rng.standard_normal((5, w.gate.shape[2]), dtype=np.float32)
            for rows, experts in _patterns(w.n_expert, rng):
                out = pool.compute(layer, x, rows, experts)
                assert out.shape == (len(rows), x.shape[1]) and out.dtype == np.float32
                ref, bound = _reference(w, x, rows, experts)
                assert (np.abs(out - ref) <= bound).all()
                relative.extend(np.abs(out - ref).max(axis=1) / np.abs(ref).max(axis=1))
    assert np.median(relative) < 1e-6


def test_one_and_two_threads_give_the_same_outputs(make_model):
    experts_by_layer = build_model(make_model("qwen3moe", QT.Q4_K)).expert_weights
    rng = np.random.default_rng(1)
    x = rng.standard_normal((7, 256), dtype=np.float32)
    rows = rng.integers(0, 7, 40).astype(np.int32)
    experts = rng.integers(0, 8, 40).astype(np.int32)
    with CpuExpertPool(experts_by_layer, n_threads=1) as one, CpuExpertPool(experts_by_layer, n_threads=2) as two:
        for layer in experts_by_layer:
            expected = one.compute(layer, x, rows, experts)
            # Each output row is one thread's dot products in the same order: identical bits.
            np.testing.assert_array_equal(two.compute(layer, x, rows, experts), expected)


def test_graphs_are_reused_across_calls_and_layers_of_one_shape(make_model):
    experts_by_layer = build_model(make_model("qwen3moe", QT.Q4_K)).expert_weights
    assert len(experts_by_layer) == 2
    x = np.ones((1, 256), np.float32)
    with CpuExpertPool(experts_by_layer, n_threads=1) as pool:
        first = [pool.compute(layer, x, np.zeros(3, np.int32), np.array([0, 5, 5], np.int32)) for layer in (0, 1)]
        busy = pool.busy_seconds
        again = [pool.compute(layer, x, np.zeros(3, np.int32), np.array([0, 5, 5], np.int32)) for layer in (0, 1)]
        assert pool.n_graphs == 1  # the second layer re-points the first layer's graph at its own bytes
        assert pool.busy_seconds > busy > 0
        pool.compute(0, x, np.zeros(2, np.int32), np.array([1, 2], np.int32))
        assert pool.n_graphs == 2
    assert not np.array_equal(first[0], first[1])
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)


def test_refuses_what_it_cannot_compute(make_model):
    experts_by_layer = build_model(make_model("qwen3moe", QT.Q4_K)).expert_weights
    x = np.zeros((2, 256), np.float32)
    pool = CpuExpertPool(experts_by_layer, n_threads=1, max_rows=4)
    with pytest.raises(ValueError, match="max_rows=4"):
        pool.compute(0, x, np.zeros(5, np.int32), np.zeros(5, np.int32))
    with pytest.raises(ValueError, match=r"expert ids must lie in \[0, 8\)"):
        pool.compute(0, x, np.zeros(1, np.int32), np.array([8], np.int32))
    with pytest.raises(ValueError, match="x \\[n_rows, 256\\]"):
        pool.compute(0, np.zeros((2, 128), np.float32), np.zeros(1, np.int32), np.zeros(1, np.int32))
    assert pool.compute(0, x, np.zeros(0, np.int32), np.zeros(0, np.int32)).shape == (0, 256)
    pool.close()
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.compute(0, x, np.zeros(1, np.int32), np.zeros(1, np.int32))


@pytest.fixture(scope="module")
def big_f16_layer() -> dict[int, ExpertWeights]:
    """Random F16 experts built in memory, big enough for a job that takes tens of milliseconds."""
    rng = np.random.default_rng(2)
    n_expert, n_embd, n_ff = 4, 1024, 1024

    def tensor(rows: int, cols: int) -> ExpertTensor:
        values = (rng.standard_normal((n_expert, rows, cols), dtype=np.float32) / np.sqrt(cols)).astype(np.float16)
        return ExpertTensor(torch.from_numpy(values.view(np.uint8)), QT.F16, (n_expert, rows, cols), None)

    return {0: ExpertWeights(tensor(n_ff, n_embd), tensor(n_ff, n_embd), tensor(n_embd, n_ff))}


def _big_job() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x = np.random.default_rng(3).standard_normal((64, 1024), dtype=np.float32)
    return x, np.repeat(np.arange(64, dtype=np.int32), 4), np.tile(np.arange(4, dtype=np.int32), 64)


def test_compute_lets_other_threads_run_python(big_f16_layer):
    """ctypes drops the GIL inside ggml_graph_compute: while the engine's thread computes, the
    server's threads keep running Python (had the job held the GIL, they would stall for all of it)."""
    x, rows, experts = _big_job()
    with CpuExpertPool(big_f16_layer, n_threads=1) as pool:
        pool.compute(0, x, rows, experts)  # builds the graph, so the job below is all compute
        busy = pool.busy_seconds
        stamps = [time.perf_counter()]
        job = threading.Thread(target=pool.compute, args=(0, x, rows, experts))
        job.start()
        while job.is_alive():
            stamps.append(time.perf_counter())
        job.join()
        took = pool.busy_seconds - busy
    assert took > 0.02, f"the job took {took * 1e3:.1f} ms: too short to tell"
    assert len(stamps) > 100
    assert np.diff(stamps).max() < 0.5 * took
