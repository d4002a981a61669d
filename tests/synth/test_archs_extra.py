"""gpt-oss and deepseek2 synthetic models: stock llama.cpp loads them, runs them and routes."""
from __future__ import annotations

import functools

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader

from engine.baseline.llama_load import open_llama
from engine.baseline.oracle import run_reference
from engine.runtime.tokenizer import tokenize_text
from engine.synth import layout as layout_mod
from engine.synth.routing import routing
from engine.synth.spec import preset
from engine.synth.writer import write_model

N_PROMPT, N_GEN = 32, 16


def _write(tmp_path, arch: str, qtype: QT, **changes):
    spec = preset("tiny", arch).with_(expert_qtype=qtype, **changes)
    path = write_model(tmp_path / f"{arch}-{qtype.name}.gguf", spec, routing("qwen3-30b"))
    return spec, path


def _check_reference(path, spec, text: str, moe_layers: list[int]) -> None:
    tokens = tokenize_text(path, text)[:N_PROMPT]
    assert len(tokens) == N_PROMPT
    ref = run_reference(path, tokens, generate=N_GEN)
    n = N_PROMPT + N_GEN
    assert len(ref.tokens) == n
    assert ref.logits.shape[0] == n and np.isfinite(ref.logits).all()
    assert ref.moe_layers == moe_layers
    assert ref.experts.shape == (n, len(moe_layers), spec.n_expert_used)
    assert ref.experts.min() >= 0 and ref.experts.max() < spec.n_expert
    rows = ref.experts.reshape(-1, spec.n_expert_used)
    assert all(len(set(r.tolist())) == spec.n_expert_used for r in rows)
    assert ref.probs.shape == (n, len(moe_layers), spec.n_expert)


def _check_completion(path, text: str) -> None:
    llm = open_llama(path, n_ctx=256)
    try:
        out = llm.create_completion(text[:200], max_tokens=8, temperature=0.0)
        assert isinstance(out["choices"][0]["text"], str)
        assert 0 < out["usage"]["completion_tokens"] <= 8
    finally:
        llm.close()


def _metadata(path) -> dict:
    r = GGUFReader(path)
    return {f.name: f.contents() for f in r.fields.values() if not f.name.startswith("tokenizer.")}


@pytest.mark.parametrize("qtype", [QT.MXFP4, QT.Q8_0], ids=lambda q: q.name)
def test_gpt_oss_runs_in_llama_cpp(tmp_path, prompt_text, qtype):
    spec, path = _write(tmp_path, "gpt-oss", qtype)
    assert N_PROMPT + N_GEN > spec.sliding_window  # the sliding-window mask is exercised
    _check_reference(path, spec, prompt_text, list(range(spec.n_layer)))
    _check_completion(path, prompt_text)


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q8_0], ids=lambda q: q.name)
def test_deepseek2_runs_in_llama_cpp(tmp_path, prompt_text, qtype):
    spec, path = _write(tmp_path, "deepseek2", qtype)
    assert spec.n_dense_lead >= 1
    _check_reference(path, spec, prompt_text, list(range(spec.n_dense_lead, spec.n_layer)))
    _check_completion(path, prompt_text)


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.F16], ids=lambda q: q.name)
def test_gpt_oss_other_expert_types_load(tmp_path, prompt_text, qtype):
    spec, path = _write(tmp_path, "gpt-oss", qtype)
    tokens = tokenize_text(path, prompt_text)[:8]
    ref = run_reference(path, tokens)
    assert np.isfinite(ref.logits).all() and ref.experts.shape == (8, spec.n_layer, spec.n_expert_used)


def test_deepseek2_variants_load(tmp_path, prompt_text, monkeypatch):
    """q compression (q_lora_rank > 0) and DeepSeek-V3 gating (sigmoid, exp_probs_b, renormalized)."""
    monkeypatch.setitem(layout_mod.BUILDERS, "deepseek2", functools.partial(layout_mod.deepseek2, gating="sigmoid"))
    spec, path = _write(tmp_path, "deepseek2", QT.Q8_0, q_lora_rank=64)
    meta = _metadata(path)
    assert meta["deepseek2.expert_gating_func"] == 2 and meta["deepseek2.expert_weights_norm"] is True
    names = {t.name for t in GGUFReader(path).tensors}
    assert "blk.1.exp_probs_b.bias" in names and "blk.0.attn_q_a.weight" in names and "blk.0.attn_q.weight" not in names
    tokens = tokenize_text(path, prompt_text)[:8]
    ref = run_reference(path, tokens)
    assert np.isfinite(ref.logits).all() and ref.moe_layers == [1, 2]


def test_layouts_carry_what_llama_cpp_reads(tmp_path):
    gpt = layout_mod.layout(preset("tiny", "gpt-oss"), 300)
    m = gpt.metadata
    assert m["gpt-oss.attention.sliding_window"] > 0 and m["gpt-oss.rope.scaling.type"] == "yarn"
    assert m["gpt-oss.rope.scaling.factor"] == 32.0 and m["gpt-oss.rope.scaling.original_context_length"] == 4096
    names = {t.name for t in gpt.tensors}
    for n in ("attn_sinks.weight", "post_attention_norm.weight", "attn_q.bias", "attn_output.bias",
              "ffn_gate_inp.bias", "ffn_gate_exps.bias", "ffn_up_exps.bias", "ffn_down_exps.bias"):
        assert f"blk.1.{n}" in names

    spec = preset("tiny", "deepseek2")
    ds = layout_mod.layout(spec, 300)
    m = ds.metadata
    assert m["deepseek2.attention.head_count_kv"] == 1
    assert m["deepseek2.attention.key_length"] == spec.kv_lora_rank + spec.rope_dim
    assert m["deepseek2.attention.value_length"] == spec.kv_lora_rank
    assert m["deepseek2.attention.key_length_mla"] == spec.head_dim
    assert m["deepseek2.attention.q_lora_rank"] == 0
    assert m["deepseek2.expert_weights_scale"] == 2.5 and m["deepseek2.expert_gating_func"] == 1
    assert m["deepseek2.leading_dense_block_count"] == spec.n_dense_lead
    names = {t.name for t in ds.tensors}
    assert "blk.0.ffn_gate.weight" in names and "blk.0.ffn_gate_inp.weight" not in names
    assert {"blk.1.attn_k_b.weight", "blk.1.attn_v_b.weight", "blk.1.ffn_up_shexp.weight"} <= names
    assert "blk.1.attn_kv_b.weight" not in names and "blk.1.exp_probs_b.bias" not in names
