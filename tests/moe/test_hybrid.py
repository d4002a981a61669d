"""Hybrid execution is the all-resident computation split differently.

The accelerator role is played by torch CPU tensors here (the same slot, policy, split and
counter code as on CUDA); the CPU pool is ggml's real CPU kernels. For every architecture,
every cache size class, miss fraction and policy, decoding llama.cpp's greedy continuation
step by step must pick the same argmax token at every step as the all-resident engine.
"""
from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from engine.baseline.oracle import run_reference
from engine.models import build_model
from engine.moe.hybrid import HybridExperts, HybridOptions
from engine.moe.policy import POLICIES
from engine.moe.tune import RouteCosts
from engine.runtime.tokenizer import tokenize_text

ARCHS = ("qwen3moe", "qwen2moe", "llama", "olmoe", "gpt-oss", "deepseek2")
QUANT = {"gpt-oss": QT.MXFP4, "deepseek2": QT.Q4_K, "olmoe": QT.Q8_0, "llama": QT.Q6_K}
N_PROMPT, N_GEN = 24, 64


def decode_logits(model, tokens: list[int]) -> torch.Tensor:
    """Prefill the prompt, then one decode step per token: logits predicting tokens[N_PROMPT:]."""
    cache = model.new_cache(len(tokens))
    out = [model.forward(torch.tensor(tokens[:N_PROMPT]), cache)[-1:]]
    for t in tokens[N_PROMPT:-1]:
        out.append(model.forward(torch.tensor([t]), cache))
    return torch.cat(out)


@pytest.fixture(scope="module")
def reference_runs(make_model, prompt_text):
    runs = {}
    for arch in ARCHS:
        path = make_model(arch, QUANT.get(arch, QT.Q4_K))
        ref = run_reference(path, tokenize_text(path, prompt_text)[:N_PROMPT], generate=N_GEN)
        model = build_model(path)
        runs[arch] = (path, ref.tokens, decode_logits(model, ref.tokens))
    return runs


def _sweep(model, tokens: list[int], resident: torch.Tensor, device: str, threads: int, label: str) -> None:
    """Every cache size class x miss fraction (policies cycling): the all-resident argmax at
    every decode step, and counters that add up to the selections."""
    expected = resident.argmax(-1)
    k = model.config.n_expert_used
    for size_name, n_slots, fraction, policy in _cases(model.config.n_expert):
        hybrid = HybridExperts(model.expert_weights, device, HybridOptions(
            slots_per_layer=n_slots, miss_fraction=fraction, policy=policy, threads=threads))
        model.experts = hybrid
        try:
            logits = decode_logits(model, tokens)
            model.settle()
        finally:
            hybrid.close()
        case = f"{label} cache={size_name} fraction={fraction} policy={policy}"
        assert torch.equal(logits.argmax(-1), expected), case
        # ggml's CPU kernels and the torch path round activations identically except at exact
        # ties, where one quant step of one value moves logits by up to ~1e-2 (test_parity.py).
        assert (logits - resident).abs().max().item() < 5e-2, case
        c = hybrid.counters
        selections = len(tokens) - 1  # prompt rows + one row per decode step
        assert (c.gpu_hit + c.uploaded + c.cpu_computed == selections * k).all(), case


def _cases(n_expert: int):
    sizes = {"none": 0, "one": 1, "half": n_expert // 2, "all": n_expert}
    policies = itertools.cycle(POLICIES)
    return [(s, n, f, next(policies)) for (s, n), f in itertools.product(sizes.items(), (0.0, 0.17, 1.0))]


@pytest.mark.parametrize("arch", ARCHS)
def test_every_split_gives_the_all_resident_tokens(reference_runs, arch):
    path, tokens, resident_logits = reference_runs[arch]
    model = build_model(path)
    _sweep(model, tokens, resident_logits, "cpu", threads=2, label=arch)


def test_a_slot_is_never_read_before_its_copy_lands(make_model, prompt_text, monkeypatch):
    path = make_model("qwen3moe", QT.Q4_K)
    tokens = tokenize_text(path, prompt_text)[:40]
    model = build_model(path)
    expected = decode_logits(model, tokens)
    hybrid = HybridExperts(model.expert_weights, "cpu",
                           HybridOptions(slots_per_layer=3, miss_fraction=0.0, policy="lru", copy_delay_s=0.02))
    reads = []
    for layer in hybrid.layers.values():
        slots = layer.slots
        original = slots.weights

        def checked(slot, staged=False, slots=slots, original=original):
            pending = {s for s, _, handle in slots.pending if not handle.landed()}
            reads.append(slot)
            assert staged or slot not in pending, "a hit read a slot whose copy had not landed"
            return original(slot, staged)

        monkeypatch.setattr(slots, "weights", checked)
    steps = {layer: itertools.count() for layer in hybrid.layers}

    def paced(layer, x, ids, weights):
        # Every other step lets the slow copies land first, so hits happen however fast this
        # machine decodes; the steps in between run while copies are still in flight.
        if next(steps[layer]) % 2:
            deadline = time.monotonic() + 10
            while hybrid.layers[layer].slots.pending and time.monotonic() < deadline:
                hybrid.layers[layer].slots.refresh()
                time.sleep(0.002)
        return hybrid(layer, x, ids, weights)

    model.experts = paced
    try:
        logits = decode_logits(model, tokens)
    finally:
        hybrid.close()
    assert reads, "the cache never served a hit: the test proves nothing"
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
    assert hybrid.counters.swaps.sum() > 0


def test_counters_and_residency_reach_the_telemetry_snapshot(make_model, prompt_text):
    from engine.moe.hybrid import attach_hybrid
    from engine.runtime.engine import Engine, EngineConfig, Request
    from engine.layers.sampler import SamplingParams

    path = make_model("qwen3moe", QT.Q4_K)
    engine = Engine.load(path, EngineConfig(moe_expert_cache_size=4, moe_gpu_miss_fraction=0.5,
                                            moe_profile_adapt="occurrence"), attach_experts=attach_hybrid)
    list(engine.generate(Request(prompt=prompt_text[:200], max_tokens=16, ignore_eos=True,
                                 sampling=SamplingParams(temperature=0))))
    snap = engine.telemetry.snapshot()
    assert snap["engine"] == "hybrid"
    cache = snap["cache"]
    assert cache["slots_per_layer"] == 4 and len(cache["residency"]) == 2
    assert sum(cache["gpu_hit"]) + sum(cache["uploaded"]) + sum(cache["cpu_computed"]) > 0
    resident = np.array(cache["residency"])
    assert ((resident >= 0).sum(axis=1) <= 4).all()
    # the prompt: one chunk, each MoE layer reading its routing back (no grouped GEMM on the CPU)
    assert cache["prompt_steps"] == {"streamed": 0, "resident": 0, "read back": 2}
    engine.model.experts.close()


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_every_split_on_cuda_gives_the_all_resident_tokens(make_model, prompt_text, arch):
    """The same sweep with real CUDA slots, side-stream copies and events. The token stream is
    the all-resident CUDA model's own greedy continuation (no llama.cpp in this process)."""
    path = make_model(arch, QUANT.get(arch, QT.Q4_K))
    model = build_model(path, "cuda")
    tokens = tokenize_text(path, prompt_text)[:N_PROMPT]
    cache = model.new_cache(N_PROMPT + N_GEN)
    logits = model.forward(torch.tensor(tokens), cache)[-1]
    for _ in range(N_GEN):
        tokens.append(int(logits.argmax()))
        logits = model.forward(torch.tensor(tokens[-1:]), cache)[-1]
    resident = decode_logits(model, tokens)
    expected = resident.argmax(-1)
    assert torch.equal(expected.cpu(), torch.tensor(tokens[N_PROMPT:]))
    _sweep(model, tokens, resident, "cuda", threads=4, label=f"cuda {arch}")


def test_load_mode_none_reads_ram_copies_and_gives_the_same_tokens(make_model, prompt_text):
    """--load-mode none: the CPU pool and the uploads read RAM copies of the experts (not the
    memory map), and generation is unchanged; auto means mmap without a GPU."""
    from engine.layers.sampler import SamplingParams
    from engine.moe.hybrid import attach_hybrid
    from engine.runtime.engine import Engine, EngineConfig, Request

    path = make_model("qwen3moe")
    out = {}
    for mode in ("auto", "none"):
        engine = Engine.load(path, EngineConfig(n_ctx=256, load_mode=mode), attach_experts=attach_hybrid)
        try:
            mapped = engine.model.source.torch_raw("blk.0.ffn_gate_exps.weight").data_ptr()
            assert (engine.model.expert_weights[0].gate.raw.data_ptr() == mapped) == (mode == "auto")
            assert engine.telemetry.cache.load_mode == ("mmap" if mode == "auto" else "none")
            events = list(engine.generate(Request(prompt=prompt_text[:200], max_tokens=24, ignore_eos=True,
                                                  sampling=SamplingParams(temperature=0.0))))
            out[mode] = [e.token for e in events[:-1] if e.token is not None]
        finally:
            engine.model.experts.close()
    assert out["none"] == out["auto"] and len(out["auto"]) == 24


def test_uploads_after_a_long_prefill_step_stay_at_the_miss_fraction(make_model):
    """A prefill step's misses beyond the staging slots are computed on the CPU, not owed to the
    decode steps after it: those upload the fraction of their own misses (+ at most one)."""
    model = build_model(make_model("qwen3moe"))
    hybrid = HybridExperts(model.expert_weights, "cpu", HybridOptions(
        slots_per_layer=1, miss_fraction=0.5, policy="off", threads=1, top_k=2, staging_turn_bytes=1))
    try:
        hybrid.prefill_residency([(0, 0)])  # expert 0 resident, static ("off")
        assert hybrid.layers[0].slots.n_staging == 2  # two turns of one expert
        hybrid.replay(0, np.arange(16).reshape(8, 2) % 8)  # prefill: 7 distinct misses, 2 staging slots
        c = hybrid.counters
        before = c.uploaded[0]
        for e in range(1, 9):  # decode: expert 0 hits, one miss per step
            hybrid.replay(0, np.array([[0, 1 + e % 7]]))
        assert c.uploaded[0] - before <= 1 + 0.5 * 8, c.uploaded[0] - before
    finally:
        hybrid.close()


@pytest.mark.parametrize("turn", [1, 2])  # experts per turn: 2 staging slots, 4
def test_prefill_streams_its_misses_through_the_staging_slots_in_turns(reference_runs, turn):
    """Uploads that cost next to nothing against the CPU: a prefill step uploads far more misses
    than there are staging slots, in turns over the two halves of the slots the layers share,
    and the tokens stay those of the all-resident engine."""
    path, tokens, resident = reference_runs["qwen3moe"]
    model = build_model(path)
    k = model.config.n_expert_used
    w = next(iter(model.expert_weights.values()))
    expert_bytes = sum(t.raw[0].numel() for t in (w.gate, w.up, w.down))
    hybrid = HybridExperts(model.expert_weights, "cpu", HybridOptions(
        slots_per_layer=1, miss_fraction=1.0, policy="off", threads=1, top_k=k, staging_turn_bytes=turn * expert_bytes,
        route_costs=RouteCosts(upload_s=1e-9, cpu_s=1e-3, cpu_row_s=1e-4, gpu_s=1e-9), copy_delay_s=0.001))
    model.experts = hybrid
    try:
        cache = model.new_cache(len(tokens))
        first = model.forward(torch.tensor(tokens[:N_PROMPT]), cache)[-1:]
        staging = {id(L.slots.staging) for L in hybrid.layers.values()}
        assert len(staging) == 1  # one set for every layer
        n_staging = hybrid.layers[min(hybrid.layers)].slots.n_staging
        assert n_staging == max(k, 2 * turn)
        assert (hybrid.counters.uploaded > 2 * n_staging).all()  # turns, not one staged batch
        logits = torch.cat([first] + [model.forward(torch.tensor([t]), cache) for t in tokens[N_PROMPT:-1]])
    finally:
        hybrid.close()
    assert torch.equal(logits.argmax(-1), resident.argmax(-1))
    assert (logits - resident).abs().max().item() < 5e-2
    c = hybrid.counters
    assert (c.gpu_hit + c.uploaded + c.cpu_computed == (len(tokens) - 1) * k).all()


def test_a_many_row_step_streams_until_its_text_keeps_to_the_resident_experts(make_model, monkeypatch):
    """A layer streams every missing expert while nothing is known of the prompt's experts (its
    first chunk) or its last chunk used them, and reads its routing back once the prompt keeps to
    the resident ones: streaming would copy experts no row needs."""
    pytest.importorskip("triton")
    monkeypatch.setenv("MOESTUDIO_TRITON", "force")  # the grouped GEMM's condition holds on the CPU
    model = build_model(make_model("qwen3moe", QT.Q8_0))
    cfg = model.config
    k, n_expert = cfg.n_expert_used, cfg.n_expert
    costs = RouteCosts(upload_s=60e-6, cpu_s=150e-6, cpu_row_s=13e-6, gpu_s=16e-6)
    hybrid = HybridExperts(model.expert_weights, "cpu", HybridOptions(
        slots_per_layer=2, miss_fraction=1.0, policy="off", threads=1, top_k=k, route_costs=costs))
    try:
        layer = hybrid.layer_ids[0]
        L = hybrid.layers[layer]
        hybrid.prefill_residency([(layer, 0), (layer, 1)])
        hybrid.read_back_s = 2e-4  # the H200's read-back idle (session 13)
        n_tok = 40  # 80 pairs: the grouped GEMM takes the step, and every expert is all but certain
        x = torch.zeros(n_tok, cfg.n_embd)
        ids = torch.zeros(n_tok, k, dtype=torch.int64)
        assert hybrid._streamed(L, x, ids)  # nothing known yet
        kept = np.zeros(n_expert, np.int64)
        kept[:2] = n_tok * k // 2
        hybrid._account(layer, L, kept, np.arange(2), np.arange(2), np.arange(0), np.arange(0), n_tok)
        assert not hybrid._streamed(L, x, ids)
        spread = np.full(n_expert, n_tok * k // n_expert, np.int64)
        hybrid._account(layer, L, spread, np.arange(n_expert), np.arange(2), np.arange(0), np.arange(2, n_expert),
                        n_tok)
        assert hybrid._streamed(L, x, ids)
        # one missing expert with a few rows: streaming the six costs more than computing it, until
        # the read-back idles the GPU longer than they take to copy
        few = kept.copy()
        few[5] = 3
        hybrid._account(layer, L, few, np.array([0, 1, 5]), np.arange(2), np.arange(0), np.array([5]), n_tok)
        assert not hybrid._streamed(L, x, ids)
        hybrid.read_back_s = (n_expert - 2) * costs.upload_s
        assert hybrid._streamed(L, x, ids)
        hybrid.read_back_s = 2e-4
        assert not hybrid._streamed(L, x, ids)
        hybrid.replay(layer, np.array([[0, 1]]))  # a decode step: the next many-row step is another prompt's
        assert hybrid._streamed(L, x, ids)
        hybrid._account(layer, L, kept, np.arange(2), np.arange(2), np.arange(0), np.arange(0), n_tok)
        assert not hybrid._streamed(L, x, ids)
        hybrid.end_prompt()  # a decode token of the token graph, which steps no layer here
        assert hybrid._streamed(L, x, ids)
    finally:
        hybrid.close()


@pytest.mark.gpu
def test_a_many_row_read_back_times_the_gpu_idle_through_it(make_model):
    """What streaming saves a step is the GPU's idle while the host reads the routing back and
    lays the step out: CUDA events around it, folded into read_back_s once they have landed. A
    read-back that first allocates its pinned buffers (milliseconds, once) is not timed: on the
    H200 that one sample made every later chunk stream."""
    model = build_model(make_model("qwen3moe", QT.Q8_0), "cuda")
    cfg = model.config
    hybrid = HybridExperts(model.expert_weights, "cuda", HybridOptions(
        slots_per_layer=2, miss_fraction=1.0, policy="off", threads=1, top_k=cfg.n_expert_used))
    try:
        g = torch.Generator().manual_seed(0)
        n_tok = 40  # 80 pairs: a many-row step
        ids = torch.stack([torch.randperm(cfg.n_expert, generator=g)[:cfg.n_expert_used] for _ in range(n_tok)])
        x, weights = torch.randn(n_tok, cfg.n_embd, device="cuda"), torch.rand(n_tok, cfg.n_expert_used, device="cuda")
        layer = hybrid.layer_ids[0]
        hybrid(layer, x, ids.cuda(), weights)  # allocates the pinned buffers: untimed
        hybrid(layer, x, ids.cuda(), weights)
        assert hybrid.read_back_s == 0.0  # its marks land with the next read-back
        hybrid(layer, x, ids.cuda(), weights)
        assert 0.0 < hybrid.read_back_s < 1e-2, hybrid.read_back_s
    finally:
        hybrid.close()


def test_the_cpu_pool_is_called_from_the_engine_thread_only(make_model, prompt_text):
    """libgomp gives each calling thread its own team and stops spinning between calls once the
    teams outnumber the cores (cpu_pool.py): prompts and decode call the pool from one thread."""
    import threading

    path = make_model("qwen3moe", QT.Q4_K)
    model = build_model(path)
    hybrid = HybridExperts(model.expert_weights, "cpu", HybridOptions(slots_per_layer=2, miss_fraction=0.0, threads=2))
    model.experts = hybrid
    callers = set()
    compute = hybrid.pool.compute

    def recording(*args):
        callers.add(threading.get_ident())
        return compute(*args)

    hybrid.pool.compute = recording
    try:
        decode_logits(model, tokenize_text(path, prompt_text)[:N_PROMPT + 8])
    finally:
        hybrid.close()
    assert callers == {threading.get_ident()}
