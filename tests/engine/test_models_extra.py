"""gpt-oss and deepseek2: the engine computes what llama.cpp computes.

48 positions per model: 32 real-text prompt tokens and 16 greedy tokens that llama.cpp
generated. Per position we compare the logits, and per token and MoE layer the routed
expert sets.

Tolerances, and why:
* Experts and dense weights in F32 (no activation rounding anywhere): what is left is
  float32 summation order, so every position agrees to 1e-4 (observed <= 8e-6). This pins
  down the architecture maths (MLA, YaRN scales, sinks, sliding window, gating functions,
  biases, shared experts) with no allowance for ties.
* Quantized experts: activations are rounded to the weight's vec_dot type exactly as ggml
  does, but a value whose scaled magnitude lies within float32 noise of a half step can
  round the other way (one quant step of one value; e.g. token 0 of deepseek2's first MoE
  layer with seed 0 sits 7.6e-6 of a step from the boundary). Such a flip moves a logit by
  up to ~2e-2 (deepseek2 scales routed experts by 2.5) and through MLA's shared latent it
  reaches every later position. Hence the comparison of engine.validate.compare: identical
  expert sets except at router near-ties, identical argmax where llama.cpp's top two logits
  are 1e-3 apart, mean KL < 1e-4, every position within 5e-2.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from engine.baseline.oracle import run_reference
from engine.layers.precision import accumulate_in
from engine.models import build_model
from engine.runtime.tokenizer import tokenize_text
from engine.synth import layout as layout_mod
from engine.synth.routing import routing
from engine.synth.spec import preset
from engine.synth.writer import write_model
from engine.validate import compare, engine_run

N_PROMPT, N_GEN = 32, 16
N = N_PROMPT + N_GEN

V3 = functools.partial(layout_mod.deepseek2, gating="sigmoid")  # sigmoid, exp_probs_b, renormalized


def _v3_grouped(spec, n_vocab):
    """DeepSeek-V3's group-limited routing: 4 groups of 2 experts, top-k from the best 2 groups."""
    lay = V3(spec, n_vocab)
    lay.metadata.update({f"{spec.arch}.expert_group_count": 4, f"{spec.arch}.expert_group_used_count": 2})
    return lay


# (id, arch, expert type, deepseek2 layout builder or None, spec changes)
Q_LORA = {"q_lora_rank": 64}
QUANTIZED = [
    ("gpt-oss-MXFP4", "gpt-oss", QT.MXFP4, None, {}),
    ("gpt-oss-Q8_0", "gpt-oss", QT.Q8_0, None, {}),
    ("deepseek2-Q4_K", "deepseek2", QT.Q4_K, None, {}),
    ("deepseek2-Q8_0", "deepseek2", QT.Q8_0, None, {}),
    ("deepseek2-v3-Q8_0", "deepseek2", QT.Q8_0, V3, Q_LORA),
]
EXACT = [
    ("gpt-oss-F32", "gpt-oss", QT.F32, None, {}),
    ("deepseek2-F32", "deepseek2", QT.F32, None, {}),
    ("deepseek2-v3-F32", "deepseek2", QT.F32, V3, Q_LORA),
    ("deepseek2-v3-groups-F32", "deepseek2", QT.F32, _v3_grouped, {**Q_LORA, "n_expert_used": 3}),
]


def _write(tmp_path, monkeypatch, arch: str, qtype: QT, builder, changes: dict, seed: int = 0):
    if builder is not None:
        monkeypatch.setitem(layout_mod.BUILDERS, arch, builder)
    spec = preset("tiny", arch).with_(expert_qtype=qtype, **changes)
    return spec, write_model(tmp_path / f"{arch}-{qtype.name}.gguf", spec, routing("qwen3-30b"), seed=seed)


def _compare(tmp_path, monkeypatch, prompt_text, case):
    name, arch, qtype, builder, changes = case
    spec, path = _write(tmp_path, monkeypatch, arch, qtype, builder, changes, seed=0)
    prompt = tokenize_text(path, prompt_text)[:N_PROMPT]
    assert len(prompt) == N_PROMPT
    ref = run_reference(path, prompt, generate=N_GEN)
    assert len(ref.tokens) == N and ref.logits.shape[0] == N

    model = build_model(path)
    assert model.config.moe_layers == tuple(ref.moe_layers)
    logits, experts = engine_run(model, ref.tokens)
    assert experts.shape == ref.experts.shape
    v = compare(ref, logits, experts)
    print(f"{name}: {v}")
    assert v.routing_mismatches_outside_ties == 0 and v.top1_agreement == 1.0
    return model, ref, v, np.abs(logits - ref.logits).max(axis=1)


@pytest.mark.parametrize("case", QUANTIZED, ids=[c[0] for c in QUANTIZED])
def test_quantized_models_match_llama_cpp(tmp_path, monkeypatch, prompt_text, case):
    model, ref, v, diff = _compare(tmp_path, monkeypatch, prompt_text, case)
    assert v.mean_kl < 1e-4 and v.max_abs_diff < 5e-2, np.round(diff, 6).tolist()

    # Chunked prefill through one cache computes what one pass computes. In float64
    # accumulation: torch picks other float32 GEMM kernels for 20 rows than for 48 (by CPU
    # and batch size), and their summation orders differ by ~1e-7, which an activation
    # rounding can turn into a whole quant step (2e-3 here on AVX-512 hosts); accumulated
    # exactly both agree to float32 rounding, so a KV or position bug cannot hide in 1e-4.
    tokens = torch.tensor(ref.tokens)
    with accumulate_in(torch.float64):
        whole = model.forward(tokens, model.new_cache(N))
        cache = model.new_cache(N)
        parts = [model.forward(tokens[a:b], cache) for a, b in ((0, 20), (20, 40), (40, N))]
    assert cache.length == N
    assert (torch.cat(parts) - whole).abs().max().item() < 1e-4


@pytest.mark.parametrize("case", EXACT, ids=[c[0] for c in EXACT])
def test_architecture_maths_match_llama_cpp_exactly(tmp_path, monkeypatch, prompt_text, case):
    """F32 weights: no activation rounding, so no ties either."""
    model, ref, v, diff = _compare(tmp_path, monkeypatch, prompt_text, case)
    assert diff.max() < 1e-4, np.round(diff, 7).tolist()
    if case[3] is _v3_grouped:
        # The group limit matters here: a plain top-k over the biased scores would pick other experts.
        k = ref.experts.shape[-1]
        bias = np.stack([model.blocks[layer].ffn.router.selection_bias.numpy() for layer in ref.moe_layers])
        plain = np.argsort(-(ref.probs + bias), axis=-1, kind="stable")[..., :k]
        assert not (np.sort(plain, axis=-1) == np.sort(ref.experts, axis=-1)).all()


def test_gpt_oss_windows_even_layers_and_deepseek2_caches_the_latent(tmp_path, monkeypatch):
    spec, path = _write(tmp_path, monkeypatch, "gpt-oss", QT.Q8_0, None, {}, 0)
    model = build_model(path)
    assert [b.attention.window for b in model.blocks] == [spec.sliding_window if i % 2 == 0 else 0
                                                          for i in range(spec.n_layer)]
    assert all(b.attention.sinks is not None for b in model.blocks)

    spec, path = _write(tmp_path, monkeypatch, "deepseek2", QT.Q8_0, None, {}, 0)
    model = build_model(path)
    c = model.config
    assert (c.n_head_kv, c.head_dim_k, c.head_dim_v) == (1, spec.kv_lora_rank + spec.rope_dim, spec.kv_lora_rank)
    assert c.moe_layers == tuple(range(spec.n_dense_lead, spec.n_layer))
    cache = model.new_cache(8)
    model.forward(torch.arange(5), cache)
    # V is the latent: the first kv_lora_rank values of each cached key.
    assert torch.equal(cache.v[0][:5, 0], cache.k[0][:5, 0, :spec.kv_lora_rank])
