"""The factory's models load and run in stock llama.cpp, deterministically, with a real tokenizer."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader
from gguf.quants import dequantize

from engine.baseline.oracle import run_reference
from engine.runtime.tokenizer import tokenize_text, tokenizer
from engine.synth import tokenizer as synth_tokenizer
from engine.synth.corpus import stdlib_text
from engine.synth.randblocks import random_blocks
from engine.synth.spec import preset

STANDARD_ARCHS = ("qwen3moe", "qwen2moe", "llama", "olmoe")
EXPERT_QUANTS = (QT.F16, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K)


@pytest.mark.parametrize("qtype", EXPERT_QUANTS, ids=lambda q: q.name)
@pytest.mark.parametrize("arch", STANDARD_ARCHS)
def test_tiny_model_runs_in_llama_cpp(make_model, prompt_text, arch, qtype):
    path = make_model(arch, qtype)
    spec = preset("tiny", arch)
    prompt = tokenize_text(path, prompt_text)[:32]
    ref = run_reference(path, prompt, generate=16)

    assert len(ref.tokens) == 48 and ref.tokens[:32] == prompt
    assert ref.logits.shape == (48, synth_tokenizer.vocab_size())
    assert np.isfinite(ref.logits).all()
    # Greedy continuation: each generated token is the argmax of the previous position's logits.
    assert ref.tokens[32:] == [int(i) for i in np.argmax(ref.logits[31:47], axis=1)]
    assert ref.experts.shape == (48, spec.n_layer, spec.n_expert_used)
    assert ((ref.experts >= 0) & (ref.experts < spec.n_expert)).all()
    assert all(len(set(row)) == spec.n_expert_used for row in ref.experts.reshape(-1, spec.n_expert_used))


def test_expert_tensors_have_the_requested_type(make_model):
    reader = GGUFReader(make_model("qwen3moe", QT.Q5_K))
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == QT.Q5_K
    assert types["blk.1.ffn_down_exps.weight"] == QT.Q5_K
    assert types["blk.0.attn_norm.weight"] == QT.F32


def test_same_seed_same_file_other_seed_other_weights(make_model, model_dir):
    a = make_model("qwen3moe", QT.Q4_K, seed=3)
    digest = hashlib.sha256(a.read_bytes()).hexdigest()
    from engine.synth.routing import routing
    from engine.synth.writer import write_model

    again = write_model(model_dir / "again.gguf", preset("tiny", "qwen3moe").with_(expert_qtype=QT.Q4_K),
                        routing("qwen3-30b"), seed=3)
    assert hashlib.sha256(again.read_bytes()).hexdigest() == digest
    other = make_model("qwen3moe", QT.Q4_K, seed=4)
    assert hashlib.sha256(other.read_bytes()).hexdigest() != digest


def test_tokenizer_merges_real_text(make_model):
    path = make_model("qwen3moe", QT.Q8_0)
    text = stdlib_text(max_chars=4000)
    ids = tokenize_text(path, text)
    assert len(text) / len(ids) > 3.0  # byte-per-token would be 1.0
    assert tokenizer(str(path)).decode(ids) == text


def test_chat_template_renders(make_model):
    tok = tokenizer(str(make_model("qwen3moe", QT.Q8_0)))
    prompt = tok.render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(prompt, parse_special=True)
    assert ids[0] == tok.encode("<|im_start|>", parse_special=True)[0] and len(tok.encode("<|im_start|>", parse_special=True)) == 1
    assert tok.is_eog(tok.encode("<|im_end|>", parse_special=True)[0])


@pytest.mark.parametrize("qtype", (QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.MXFP4), ids=lambda q: q.name)
def test_random_blocks_have_sane_scale(qtype):
    blocks = random_blocks(np.random.default_rng(0), qtype, (64, 512), std=0.02)
    values = dequantize(blocks, qtype)
    assert values.shape == (64, 512) and np.isfinite(values).all()
    tolerance = 0.45 if qtype == QT.MXFP4 else 0.1  # MXFP4 scales are powers of two
    assert abs(values.std() / 0.02 - 1) < tolerance
    assert abs(values.mean()) < 0.1 * values.std()
