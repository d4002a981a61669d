"""`moestudio validate`: the demo model validates at the app's lengths, bugs do not, and
`--engine auto` checks a file once and falls back to llama.cpp where the engine does not match.

The verdict compares the distance to llama.cpp with the engine's own noise floor (its float32
run against a float64-accumulated one, engine/validate.py); these tests show both sides of
that line: a correct engine passes on the model the app ships, and two plausible bugs, each
smaller than a typo in a formula, fail.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from engine.baseline.oracle import run_reference
from engine.gguf.fingerprint import file_fingerprint
from engine.models import build_model
from engine.runtime.tokenizer import tokenize_text
from engine.synth.demo import demo_model_path
from engine.validate import (DEFAULT_GENERATED_TOKENS, DEFAULT_PROMPT_TOKENS, compare, engine_run, first_load_check,
                             judge, noise_floor, prompt_text, validate)


@pytest.fixture(scope="module")
def demo():
    return demo_model_path()


def test_the_demo_model_validates_at_the_apps_lengths(demo):
    v = validate(demo, prompt_text(None, DEFAULT_PROMPT_TOKENS))
    assert v.against_llama.tokens == DEFAULT_PROMPT_TOKENS + DEFAULT_GENERATED_TOKENS
    assert v.passed, v.failures
    # The floor is real on this model (Q8_0 dense, Q4_K experts): rounding flips happen.
    assert v.noise.max_abs_diff > 1e-4


@pytest.fixture
def q8_model(make_model):
    from engine.synth.spec import preset

    return make_model(preset("tiny", "qwen3moe").with_(dense_qtype=QT.Q8_0), QT.Q4_K)


def _verdict(path, text):
    tokens = tokenize_text(path, text)[:64]
    ref = run_reference(path, tokens, generate=32)
    model = build_model(path)
    logits, experts = engine_run(model, ref.tokens)
    against = compare(ref, logits, experts)
    return against, judge(against, noise_floor(model, ref, logits, experts))


def test_a_correct_engine_passes_and_a_skipped_rounding_fails(q8_model, prompt_text, monkeypatch):
    assert _verdict(q8_model, prompt_text)[1] == []
    # The bug: dense products forget ggml's 8-bit activation rounding. Its own float64 run has
    # the same bug, so the floor stays at summation noise and llama.cpp lands far outside it.
    import engine.layers.linear as linear

    monkeypatch.setattr(linear, "round_activation", lambda x, qtype: x.float())
    against, failures = _verdict(q8_model, prompt_text)
    assert failures and any("mean KL" in f or "max |diff|" in f for f in failures), (against, failures)


def test_a_router_that_scales_its_logits_fails(q8_model, prompt_text, monkeypatch):
    from engine.layers import moe

    original = moe.Router.__call__

    def hotter(self, x):  # a softmax temperature slip: ids mostly the same, weights not
        ids, weights = original(self, x)
        return ids, torch.softmax(2.0 * torch.log(weights), dim=-1)

    monkeypatch.setattr(moe.Router, "__call__", hotter)
    _, failures = _verdict(q8_model, prompt_text)
    assert failures


def test_first_load_check_is_cached_per_file(q8_model):
    model = build_model(q8_model)
    assert first_load_check(q8_model, model, "cpu") is None
    cached = list((__import__("engine.validate", fromlist=["_verdict_cache"])._verdict_cache()).glob(
        f"{file_fingerprint(q8_model)}-*-cpu.json"))
    assert len(cached) == 1 and json.loads(cached[0].read_text())["failure"] is None
    # The cache is what a second start reads: a verdict written there is the answer.
    cached[0].write_text(json.dumps({"failure": "recorded earlier"}))
    assert first_load_check(q8_model, model, "cpu") == "recorded earlier"


def test_the_fingerprint_sees_contents_not_names(tmp_path, q8_model):
    copy = tmp_path / "renamed.gguf"
    copy.write_bytes(q8_model.read_bytes())
    assert file_fingerprint(copy) == file_fingerprint(q8_model)
    data = bytearray(copy.read_bytes())
    data[-100] ^= 0xFF  # one weight byte near the end (in the last sampled block's reach)
    copy.write_bytes(bytes(data))
    assert file_fingerprint(copy) != file_fingerprint(q8_model)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["default", "avx2"])
def test_the_demo_validates_on_other_cpu_kernel_paths(demo, variant):
    """torch picks its CPU kernels by instruction set at run time; these variables make it take
    an older CPU's (ATEN_CPU_CAPABILITY for its own kernels, MKL and oneDNN for the GEMMs), so CI
    checks the paths of AVX2-only and pre-AVX2 hosts whatever CPU it runs on. ggml is compiled
    for the host (docs/VALIDATION.md says what that leaves uncovered)."""
    if variant == "avx2" and "avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("this CPU has no AVX2")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": variant,
           "MKL_ENABLE_INSTRUCTIONS": "AVX2" if variant == "avx2" else "SSE4_2",
           "ONEDNN_MAX_CPU_ISA": "AVX2" if variant == "avx2" else "SSE41"}
    out = subprocess.run([sys.executable, "-m", "engine.cli", "validate", str(demo), "--tokens", "256",
                          "--generate", "64", "--json"], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["kernels"].startswith(f"torch {variant.upper()};") and result["passed"], result


def test_the_engine_run_goes_in_forwards_of_the_reserved_logit_rows(make_model, prompt_text, monkeypatch):
    """engine_run's logits come from forwards of at most LOGIT_ROWS tokens (the rows the planner
    reserves logits for), none of one token, over one cache: the same logits as one forward of
    every token, up to float32 summation order."""
    from engine.plan import sizing

    path = make_model("qwen3moe")
    tokens = tokenize_text(path, prompt_text)[:41]
    model = build_model(path)
    whole = model.forward(torch.tensor(tokens), model.new_cache(len(tokens)))
    sizes = []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda t, *a, **k: (sizes.append(t.numel()), forward(t, *a, **k))[1])
    monkeypatch.setattr(sizing, "LOGIT_ROWS", 8)
    logits, experts = engine_run(model, tokens)
    assert sizes == [7, 7, 7, 7, 7, 6] and logits.shape == tuple(whole.shape) and experts.shape[0] == len(tokens)
    assert np.abs(logits - whole.numpy()).max() <= 1e-5 * np.abs(logits).max()
