"""A full prompt chunk is one CUDA graph replay where every expert is resident (GPU only), and
prefill's chunks end on multiples of the chunk length (CPU too).

The replay runs the eager chunk's kernels on the same shapes: its logits and KV cache equal the
eager chunk's bit for bit, and the expert counts it reports equal the eager chunk's.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from engine.models import build_model
from engine.moe.hybrid import HybridExperts, HybridOptions
from engine.runtime.engine import Engine, EngineConfig

ARCHS = ("qwen3moe", "qwen2moe", "gpt-oss", "deepseek2")
QUANT = {"gpt-oss": QT.MXFP4}
CHUNK = 64  # rows x top-k above the decode kernels' 64 pairs: the grouped GEMM's steps


def _resident(model, n_slots: int | None = None) -> HybridExperts:
    n_expert = model.config.n_expert
    h = HybridExperts(model.expert_weights, "cuda", HybridOptions(
        slots_per_layer=n_slots or n_expert, miss_fraction=0.0, policy="lru", threads=4))
    h.prefill_residency([(layer, e) for layer in model.expert_weights for e in range(n_expert)])
    model.experts = h
    return h


def _chunks(model, cache, tokens: torch.Tensor, graph: bool) -> tuple[list[torch.Tensor], list[np.ndarray]]:
    """Each chunk's logits (every row) and the GPU rows each layer's experts counted for the prompt."""
    h = model.experts
    before = h.counters.gpu_hit.copy()
    logits = [model.forward(tokens[s:s + CHUNK], cache, s, graph=graph) for s in range(0, len(tokens), CHUNK)]
    model.settle()
    return logits, h.counters.gpu_hit - before


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_replayed_chunks_give_the_eager_logits_cache_and_counts(make_model, arch):
    model = build_model(make_model(arch, QUANT.get(arch, QT.Q4_K)), "cuda")
    h = _resident(model)
    tokens = torch.arange(3 * CHUNK) * 7919 % model.config.n_vocab
    eager_cache = model.new_cache(4 * CHUNK)
    eager, eager_counts = _chunks(model, eager_cache, tokens, graph=False)
    assert eager_counts.sum() == len(model.config.moe_layers) * len(tokens) * model.config.n_expert_used
    cache = model.new_cache(4 * CHUNK)
    for run in range(3):  # eager and captured, then twice replayed
        cache.truncate(0)
        logits, counts = _chunks(model, cache, tokens, graph=True)
        runner = model._prompt_runner
        assert runner.replays == 3 * run
        for got, want in zip(logits, eager):
            assert torch.equal(got, want), run
        assert np.array_equal(counts, eager_counts), run
        assert cache.length == len(tokens)
        for layer in range(model.config.n_layer):
            k, v = cache.filled(layer, 0, len(tokens))
            k0, v0 = eager_cache.filled(layer, 0, len(tokens))
            assert torch.equal(k, k0) and torch.equal(v, v0), (run, layer)
    assert h.counters.prompt_steps["read back"] == 0
    assert h.counters.prompt_graph_chunks == 6  # two runs of three chunks replayed
    h.close()


@pytest.mark.gpu
def test_a_chunk_whose_experts_are_not_all_resident_runs_eagerly(make_model):
    model = build_model(make_model("qwen3moe", QT.Q4_K), "cuda")
    h = _resident(model, n_slots=model.config.n_expert // 2)
    tokens = torch.arange(CHUNK) * 7919 % model.config.n_vocab
    cache = model.new_cache(2 * CHUNK)
    for _ in range(2):
        cache.truncate(0)
        model.forward(tokens, cache, 0, graph=True)
    model.settle()
    assert model._prompt_runner is not None and not model._prompt_runner.graphs
    assert h.counters.prompt_graph_chunks == 0
    assert h.counters.prompt_steps["read back"] == 2 * len(model.config.moe_layers)  # each layer read its routing
    h.close()


def test_prefill_chunks_end_on_multiples_of_the_chunk_after_a_reused_prefix(tiny):
    """A chat's second turn reuses the first's tokens: its chunks then end where a fresh prompt's
    do, so the full ones start on the same multiples (and replay the same graphs on CUDA), and the
    logits are those of the whole prompt run afresh."""
    engine = Engine.load(tiny, EngineConfig(n_ctx=256, prefill_chunk=16))
    calls = []
    forward = engine.model.forward

    def recording(tokens, cache, start, **kw):
        calls.append((start, tokens.numel(), kw["graph"]))
        return forward(tokens, cache, start, **kw)

    first = [(i * 37 + 5) % 200 for i in range(21)]
    second = first + [(i * 11 + 3) % 200 for i in range(40)]
    engine.model.forward = recording
    engine.prefill(first)
    logits, reused = engine.prefill(second)
    assert reused == 21
    assert calls == [(0, 16, True), (16, 5, False), (21, 11, False), (32, 16, True), (48, 13, False)]
    engine.model.forward = forward
    engine.forget()
    fresh, _ = engine.prefill(second)
    torch.testing.assert_close(logits, fresh, rtol=1e-4, atol=1e-4)
