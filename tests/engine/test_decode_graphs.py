"""One-token decode steps replayed as CUDA graphs agree with the eager forward (GPU only).

The graphs attend over the whole (masked) cache instead of its filled prefix, so logits may
differ by float32 reduction order; the greedy tokens must not.
"""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from engine.models import build_model
from engine.moe.hybrid import HybridExperts, HybridOptions
from engine.runtime.tokenizer import tokenize_text

ARCHS = ("qwen3moe", "qwen2moe", "gpt-oss", "deepseek2")
QUANT = {"gpt-oss": QT.MXFP4}
N_PROMPT, N_GEN = 16, 48


def greedy(model, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    cache = model.new_cache(N_PROMPT + N_GEN + 1)
    logits = model.forward(torch.tensor(prompt), cache)[-1]
    tokens, rows = [], []
    for _ in range(N_GEN):
        tokens.append(int(logits.argmax()))
        logits = model.forward(torch.tensor(tokens[-1:]), cache)[-1]
        rows.append(logits)
    return tokens, torch.stack(rows)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("executor", ["reference", "hybrid"])
def test_graph_decode_matches_eager(make_model, prompt_text, monkeypatch, arch, executor):
    path = make_model(arch, QUANT.get(arch, QT.Q4_K))
    model = build_model(path, "cuda")
    if executor == "hybrid":  # half the experts resident, some uploads, some on the CPU pool
        model.experts = HybridExperts(model.expert_weights, "cuda", HybridOptions(
            slots_per_layer=model.config.n_expert // 2, miss_fraction=0.5, threads=4))
    prompt = tokenize_text(path, prompt_text)[:N_PROMPT]
    monkeypatch.setenv("MOESTUDIO_CUDA_GRAPHS", "0")
    eager_tokens, eager_logits = greedy(model, prompt)
    monkeypatch.setenv("MOESTUDIO_CUDA_GRAPHS", "1")
    graph_tokens, graph_logits = greedy(model, prompt)
    assert model._graphs is not None and model._graphs.captured and not model._graphs.broken
    assert graph_tokens == eager_tokens
    diff = (graph_logits - eager_logits).abs().max().item()
    assert diff < 1e-3 * max(1.0, eager_logits.abs().max().item()), diff
    if executor == "hybrid":
        assert any(L.step_graph is not None for L in model.experts.layers.values())
        model.experts.close()
