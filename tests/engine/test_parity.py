"""The engine computes what llama.cpp computes, on every architecture x expert quant type.

Tolerance, and why: the engine rounds activations exactly as ggml's CPU matmul does before
each quantized weight and keeps a float32 KV cache like the oracle, so what remains is
float32 summation order (~1e-5 on logits of unit scale) plus rare activation values whose
8-bit rounding lands on the other side of a half step in ggml's SIMD code than in torch
(one quant step of one value: up to ~1e-2 on some logits). Those differences can flip the
router where two experts score within ~1e-4 of each other. Hence: identical expert sets
except at near-ties (k-th and k+1-th router scores closer than 1e-3); at positions without
such a flip, 99% of positions within 1e-2 and all within 5e-2; mean KL < 1e-5; identical
argmax wherever llama.cpp's two best logits are 1e-3 apart.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from engine.baseline.oracle import run_reference
from engine.layers.sampler import SamplingParams
from engine.layers.precision import accumulate_in
from engine.models import build_model
from engine.runtime.engine import DoneEvent, Engine, EngineConfig, Request, TokenEvent
from engine.runtime.tokenizer import tokenize_text
from engine.validate import compare, engine_run

ARCHS = ("qwen3moe", "qwen2moe", "llama", "olmoe")
QUANTS = (QT.F16, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K)


@pytest.mark.parametrize("qtype", QUANTS, ids=lambda q: q.name)
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_routing_and_greedy_tokens_match_llama_cpp(make_model, prompt_text, arch, qtype):
    path = make_model(arch, qtype)
    prompt = tokenize_text(path, prompt_text)[:32]
    ref = run_reference(path, prompt, generate=64)

    model = build_model(path)
    logits, experts = engine_run(model, ref.tokens)
    v = compare(ref, logits, experts)
    print(f"{arch} {qtype.name}: max|diff| {v.max_abs_diff:.2e} p99 {v.p99_abs_diff:.2e} mean KL {v.mean_kl:.1e}")
    assert v.p99_abs_diff < 1e-2 and v.max_abs_diff < 5e-2
    assert v.mean_kl < 1e-5
    assert v.top1_agreement == 1.0
    assert v.routing_mismatches_outside_ties == 0

    # 64 greedy tokens through the generation loop (prefill, then one decode step per token).
    engine = Engine(model, __import__("engine.runtime.tokenizer", fromlist=["tokenizer"]).tokenizer(str(path)),
                    EngineConfig(n_ctx=256))
    events = list(engine.generate(Request(prompt=prompt, max_tokens=64, ignore_eos=True,
                                          sampling=SamplingParams(temperature=0.0))))
    generated = [e.token for e in events if isinstance(e, TokenEvent) and e.token is not None]
    assert generated == ref.tokens[32:]
    assert isinstance(events[-1], DoneEvent) and events[-1].completion_tokens == 64


def test_chunked_prefill_equals_one_shot(make_model, prompt_text):
    path = make_model("qwen3moe", QT.Q4_K)
    tokens = torch.tensor(tokenize_text(path, prompt_text)[:40])
    model = build_model(path)
    # Accumulated in float64, so torch's choice of float32 kernels per batch size (see
    # tests/engine/test_models_extra.py) cannot flip an activation rounding between the two.
    with accumulate_in(torch.float64):
        whole = model.forward(tokens, model.new_cache(64))
        cache = model.new_cache(64)
        parts = [model.forward(tokens[a:b], cache, a) for a, b in ((0, 17), (17, 33), (33, 40))]
    assert torch.allclose(torch.cat(parts), whole, atol=1e-4, rtol=0)
