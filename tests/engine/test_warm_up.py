"""The load's warm-up (Engine.warm_up): every kernel a request launches runs once at load, so the
first reply does not wait for Triton's compiles, and the expert cache learns nothing from its
made-up tokens: after it, a request decodes, counts and refills exactly as without it."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from engine.layers.sampler import SamplingParams
from engine.moe.hybrid import attach_hybrid
from engine.quant.triton_kernels import DENSE_MAX_ROWS
from engine.runtime.engine import Engine, EngineConfig, Request, TokenEvent
from engine.runtime.tokenizer import tokenize_text
from engine.synth.spec import preset


def _generate(engine: Engine, prompt: list[int]) -> list[int]:
    request = Request(prompt=prompt, max_tokens=24, ignore_eos=True, sampling=SamplingParams(temperature=0.0))
    return [e.token for e in engine.generate(request) if isinstance(e, TokenEvent) and e.token is not None]


def _cache_state(engine: Engine) -> dict:
    """What the expert cache learnt and counted: residency, policies, counters, totals."""
    h = engine.model.experts
    c = h.counters
    state = {name: np.array(getattr(c, name)).tolist() for name in
             ("gpu_hit", "uploaded", "cpu_computed", "swaps", "heat", "residency")}
    state.update(prompt_steps=dict(c.prompt_steps), bytes_uploaded=c.bytes_uploaded, prompt_id=h.prompt_id,
                 slot_expert=[L.slots.slot_expert.tolist() for L in h.layers.values()],
                 policy=[(L.policy.counts.tolist(), L.policy.last_use.tolist(), L.policy.step, L.policy.tokens)
                         for L in h.layers.values()])
    return state


def test_the_warm_up_teaches_the_cache_nothing_and_leaves_the_replies_as_they_were(tiny, prompt_text):
    """Two engines on one file, a partial cache whose policy refills at every miss: the one that
    warmed up first (as a CUDA load does) gives the same tokens and ends with the same cache,
    counters and policies as the one that did not."""
    config = EngineConfig(n_ctx=256, moe_expert_cache_size=3, moe_profile_adapt="lru")
    prompt = tokenize_text(tiny, prompt_text)[:40]
    cold = Engine.load(tiny, config, attach_experts=attach_hybrid)
    warm = Engine.load(tiny, config, attach_experts=attach_hybrid)
    try:
        before = _cache_state(warm)
        warm.warm_up()
        assert warm.cache.length == 0 and warm._cached == []
        assert _cache_state(warm) == before
        tokens = _generate(cold, prompt)
        assert _generate(warm, prompt) == tokens
        after = _cache_state(cold)
        assert after["swaps"] != before["swaps"]  # the request did teach the cache: the test can tell
        assert _cache_state(warm) == after
    finally:
        cold.model.experts.close()
        warm.model.experts.close()


# In a process of its own, so that no earlier test's launches have compiled the variants: the
# load (with its warm-up), then requests of other shapes, counting the kernels they compile.
_REQUESTS_AFTER_LOAD = """
import json, sys
from engine.bench.compiles import counting_compiles
from engine.layers.sampler import SamplingParams
from engine.moe.hybrid import attach_hybrid
from engine.runtime.engine import Engine, EngineConfig, Request

path, cache = sys.argv[1], sys.argv[2]
with counting_compiles() as at_load:
    engine = Engine.load(path, EngineConfig(device="cuda", n_ctx=2048,
                                            moe_expert_cache_size=int(cache) if cache.isdigit() else cache),
                         attach_experts=attach_hybrid)
text = [(i * 131 + 7) % engine.model.config.n_vocab for i in range(1200)]
greedy = SamplingParams(temperature=0.0)
with counting_compiles() as requests:
    for n in (5, 2, 45, 100, 700):  # 700: two chunks, the second at position 512
        events = list(engine.generate(Request(prompt=text[:n], max_tokens=5, ignore_eos=True, sampling=greedy)))
    # a follow-up that reuses the cache: its new tokens start at an odd position
    follow_up = text[:700] + [e.token for e in events if getattr(e, "token", None) is not None] + text[1000:1016]
    list(engine.generate(Request(prompt=follow_up, max_tokens=5, ignore_eos=True, sampling=greedy)))
print(json.dumps({"load": at_load.as_dict(), "requests": requests.as_dict()}))
"""


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["all", "4"])
def test_gpu_after_the_load_s_warm_up_no_request_compiles_a_kernel(tiny, cache):
    """Prompts of other lengths, at other positions (a second chunk, a follow-up that reuses the
    cache), then decode tokens: every kernel variant they launch was launched by the warm-up."""
    run = subprocess.run([sys.executable, "-c", _REQUESTS_AFTER_LOAD, str(tiny), cache], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["load"]["counted"] and seen["load"]["count"] > 0  # the counter sees the warm-up's launches
    assert seen["requests"]["count"] == 0, seen["requests"]["kernels"]


# The dense products' variants compiled up front (in parallel threads), then forward passes of
# every row count: each variant they launch must be one of those, or the parallel compile is
# time spent twice.
_FORWARD_AFTER_DENSE_COMPILES = """
import json, sys, torch
from engine.bench.compiles import counting_compiles
from engine.gguf.reader import ModelFile
from engine.models import build_model
from engine.quant.triton_kernels import DENSE_MAX_ROWS

model = build_model(ModelFile.open(sys.argv[1]), "cuda")
with counting_compiles() as ahead:
    model.compile_dense_kernels()  # what Engine.warm_up runs first
cache = model.new_cache(64)
with counting_compiles() as forward:
    start = 0
    for n in range(DENSE_MAX_ROWS, 0, -1):
        model.forward(torch.arange(n) + 3, cache, start, last_only=True)
        start += n
    torch.cuda.synchronize()
print(json.dumps({"ahead": ahead.as_dict(), "forward": forward.as_dict()}))
"""


@pytest.mark.gpu
def test_gpu_dense_variants_compiled_ahead_are_the_ones_the_forward_launches(make_model):
    # quantized dense weights: the tiny model's F32 ones go through torch's matmul, not the kernel
    model = make_model(preset("tiny", "qwen3moe").with_(dense_qtype=QT.Q4_K))
    run = subprocess.run([sys.executable, "-c", _FORWARD_AFTER_DENSE_COMPILES, str(model)], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    # every row count: the Q4_K kernel with lanes along K (dense_tile's row_kquant)
    assert seen["ahead"]["kernels"] == ["_dense_k4_kernel"], seen
    # a variant per row count at least (ROWS is a constexpr); weights of one K may share a variant
    assert seen["ahead"]["count"] >= DENSE_MAX_ROWS, seen
    assert not {"_dense_k4_kernel", "_dense_kernel"} & set(seen["forward"]["kernels"]), seen
