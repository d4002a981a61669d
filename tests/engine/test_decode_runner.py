"""A decode token is one CUDA graph replay (GPU only).

The graph attends over the whole (masked) cache instead of its filled prefix, so logits may
differ from the eager forward by float32 reduction order; the greedy tokens must not. With a
partial expert cache the graph's layers send their misses to the CPU pool through the mailbox
while the replay runs; the residency map on the GPU follows the policy's refills.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from engine.errors import EngineError
from engine.models import build_model
from engine.moe.hybrid import HybridExperts, HybridOptions
from engine.runtime.tokenizer import tokenize_text

ARCHS = ("qwen3moe", "qwen2moe", "gpt-oss", "deepseek2")
QUANT = {"gpt-oss": QT.MXFP4}
N_PROMPT, N_GEN = 16, 48


def greedy(model, prompt: list[int], n_gen: int = N_GEN) -> tuple[list[int], torch.Tensor]:
    cache = model.new_cache(N_PROMPT + n_gen + 1)
    logits = model.forward(torch.tensor(prompt), cache)[-1]
    tokens, rows = [], []
    for _ in range(n_gen):
        tokens.append(int(logits.argmax()))
        logits = model.forward(torch.tensor(tokens[-1:]), cache)[-1]
        rows.append(logits)
    return tokens, torch.stack(rows)


def hybrid(model, n_slots: int, policy: str = "lru") -> HybridExperts:
    model.experts = HybridExperts(model.expert_weights, "cuda", HybridOptions(
        slots_per_layer=n_slots, miss_fraction=0.0, policy=policy, threads=4))
    return model.experts


@pytest.mark.parametrize("table_qtype", [QT.Q6_K, QT.Q8_0, QT.F16])
def test_the_staged_table_row_gives_the_forward_s_logits(make_model, table_qtype):
    """The runner takes a token as its raw table row, decoded on the device (inside the graph on
    CUDA; here its eager path on the CPU): the logits of an ordinary forward of the token. The
    reference forwards one token at a time too: F16's float products sum in an order that may
    depend on the rows at once (torch's CPU matmul, AVX-512: 2e-4 apart over 16 rows and 1)."""
    from engine.runtime.decode_runner import DecodeRunner
    from engine.synth.spec import preset

    model = build_model(make_model(preset("tiny", "qwen3moe").with_(dense_qtype=table_qtype)), "cpu")
    assert model.embed.qtype == table_qtype
    tokens = torch.arange(5, 5 + N_PROMPT)
    reference_cache = model.new_cache(2 * N_PROMPT)
    model.forward(tokens[:-2], reference_cache)
    reference = torch.cat([model.forward(tokens[t:t + 1], reference_cache) for t in (N_PROMPT - 2, N_PROMPT - 1)])
    cache = model.new_cache(2 * N_PROMPT)
    model.forward(tokens[:-2], cache)
    runner = DecodeRunner(model, cache)
    for i, start in enumerate((N_PROMPT - 2, N_PROMPT - 1)):
        logits = runner.step(tokens[start:start + 1], start)
        assert cache.length == start + 1
        torch.testing.assert_close(logits, reference[i:i + 1], rtol=0, atol=1e-5)


def test_runner_steps_through_prompt_attention_see_their_own_positions(make_model, monkeypatch):
    """Where a decode step's attention is torch's fused one (CUDA without the decode kernel: Triton
    off, or a shape it does not take), the runner hands every step the same positions buffer with
    a new value in it: each step builds its own mask (the one kept for a forward's later layers is
    not the last step's; session 21 found the GPU's torch path decoding off the reference)."""
    from engine.layers import attention
    from engine.runtime.decode_runner import DecodeRunner

    monkeypatch.setattr("engine.models.gqa.attend", attention.prompt_attention)
    model = build_model(make_model("qwen3moe"), "cpu")
    tokens = torch.arange(5, 5 + N_PROMPT)
    reference = model.forward(tokens, model.new_cache(2 * N_PROMPT))[-4:]
    cache = model.new_cache(2 * N_PROMPT)
    model.forward(tokens[:-4], cache)
    runner = DecodeRunner(model, cache)
    for i, start in enumerate(range(N_PROMPT - 4, N_PROMPT)):
        torch.testing.assert_close(runner.step(tokens[start:start + 1], start), reference[i:i + 1], rtol=0, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("executor", ["reference", "hybrid"])
def test_graph_decode_matches_eager(make_model, prompt_text, monkeypatch, arch, executor):
    path = make_model(arch, QUANT.get(arch, QT.Q4_K))
    model = build_model(path, "cuda")
    if executor == "hybrid":  # half the experts resident, the rest through the mailbox
        hybrid(model, model.config.n_expert // 2)
    prompt = tokenize_text(path, prompt_text)[:N_PROMPT]
    monkeypatch.setenv("MOESTUDIO_CUDA_GRAPHS", "0")
    eager_tokens, eager_logits = greedy(model, prompt)
    monkeypatch.setenv("MOESTUDIO_CUDA_GRAPHS", "1")
    if executor == "hybrid":
        before = model.experts.counters.cpu_computed.sum()
    graph_tokens, graph_logits = greedy(model, prompt)
    runner = model._runner
    assert graph_tokens == eager_tokens
    diff = (graph_logits - eager_logits).abs().max().item()
    assert diff < 1e-3 * max(1.0, eager_logits.abs().max().item()), diff
    if executor == "hybrid":
        assert runner.captured and not runner.broken and runner.token_experts.mailbox.with_mailbox
        assert model.experts.counters.decode_path == "graph"
        assert model.experts.counters.cpu_computed.sum() > before  # misses went through the mailbox
        model.experts.close()
    else:
        assert runner.token_experts is None  # the reference executor has no token step: eager


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_the_triton_kernels_give_the_torch_path_s_tokens(make_model, prompt_text, monkeypatch, arch):
    """Every Triton kernel of the step (quantized products, fused q/k/v, norms, RoPE, attention,
    routing) against the torch code they replace (MOESTUDIO_TRITON=0), through the decode graph:
    the same greedy tokens, logits within float32 summation order carried through the layers."""
    path = make_model(arch, QUANT.get(arch, QT.Q4_K))
    prompt = tokenize_text(path, prompt_text)[:N_PROMPT]
    monkeypatch.setenv("MOESTUDIO_TRITON", "0")
    torch_tokens, torch_logits = greedy(build_model(path, "cuda"), prompt)
    monkeypatch.setenv("MOESTUDIO_TRITON", "1")
    kernel_tokens, kernel_logits = greedy(build_model(path, "cuda"), prompt)
    assert kernel_tokens == torch_tokens
    diff = (kernel_logits - torch_logits).abs().max().item()
    assert diff < 1e-3 * max(1.0, torch_logits.abs().max().item()), diff


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["lru", "occurrence", "off"])
def test_every_cache_size_gives_the_all_resident_tokens(make_model, prompt_text, policy):
    path = make_model("qwen3moe", QT.Q4_K)
    model = build_model(path, "cuda")
    prompt = tokenize_text(path, prompt_text)[:N_PROMPT]
    n_expert = model.config.n_expert
    hybrid(model, n_expert).prefill_residency([(layer, e) for layer in model.expert_weights for e in range(n_expert)])
    expected, _ = greedy(model, prompt)
    assert not model._runner.token_experts.mailbox.with_mailbox  # all resident: no host in the loop
    model.experts.close()
    for n_slots in (1, 2, n_expert // 2, n_expert - 1):
        h = hybrid(model, n_slots, policy)
        tokens, _ = greedy(model, prompt)
        assert tokens == expected, (policy, n_slots)
        model.settle()  # the counters trail the GPU by one token
        c = h.counters
        k = model.config.n_expert_used
        assert (c.gpu_hit + c.uploaded + c.cpu_computed == (N_PROMPT + N_GEN) * k).all(), (policy, n_slots)
        if policy != "off":
            assert c.swaps.sum() > 0
        # the GPU map holds exactly the landed copies (settle published them)
        table = model._runner.token_experts.mailbox.map.cpu().numpy()
        assert np.array_equal(table, np.stack([h.layers[layer].slots.resident for layer in h.layer_ids]))
        h.close()


@pytest.mark.gpu
def test_a_failing_cpu_pool_is_an_engine_error_not_a_hang(make_model, prompt_text):
    path = make_model("qwen3moe", QT.Q4_K)
    model = build_model(path, "cuda")
    h = hybrid(model, 2, "off")
    prompt = tokenize_text(path, prompt_text)[:N_PROMPT]
    greedy(model, prompt, n_gen=4)  # captured and serving
    calls = {"n": 0}
    compute = h.pool.compute

    def failing(layer, x, rows, experts):
        if len(x) == 1:  # a decode token's miss (the prompt's rows take the eager path)
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("injected")
        return compute(layer, x, rows, experts)

    expected, _ = greedy(model, prompt, n_gen=4)
    h.pool.compute = failing
    with pytest.raises(EngineError, match="CPU expert pool failed on layer"):
        greedy(model, prompt, n_gen=4)
    h.pool.compute = compute
    assert greedy(model, prompt, n_gen=4)[0] == expected  # the graph keeps working afterwards
    h.close()


@pytest.mark.gpu
@pytest.mark.parametrize("n_slots", [1, 4])
def test_the_mapped_route_gives_the_all_resident_tokens(make_model, prompt_text, n_slots):
    """Experts in pinned RAM (--load-mode none) and costs under which the GPU reads some of a
    layer's misses from there (the first of every two, tune.mapped_misses) while the CPU pool
    computes the others: the all-resident tokens, and every selection counted once, by route."""
    from engine.moe.slots import resident_copies
    from engine.moe.tune import RouteCosts, mapped_misses

    path = make_model("qwen3moe", QT.Q4_K)
    model = build_model(path, "cuda")
    prompt = tokenize_text(path, prompt_text)[:N_PROMPT]
    n_expert, k = model.config.n_expert, model.config.n_expert_used
    hybrid(model, n_expert).prefill_residency([(layer, e) for layer in model.expert_weights for e in range(n_expert)])
    expected, expected_logits = greedy(model, prompt)
    model.experts.close()
    costs = RouteCosts(upload_s=1.0, cpu_s=1.0, cpu_row_s=0.0, gpu_s=1.0, cpu_expert_s=1.0, mapped_s=1.0)
    assert mapped_misses(k, costs)[2] == 1
    pinned = resident_copies(model.expert_weights, pin=True)
    h = model.experts = HybridExperts(pinned, "cuda", HybridOptions(
        slots_per_layer=n_slots, miss_fraction=0.0, policy="off", threads=4, route_costs=costs))
    tokens, logits = greedy(model, prompt)
    assert tokens == expected
    assert (logits - expected_logits).abs().max().item() < 1e-3 * max(1.0, expected_logits.abs().max().item())
    model.settle()
    assert set(model._runner.token_experts.host_rows) == set(h.layer_ids)  # every layer has the route
    c = h.counters
    assert (c.gpu_hit + c.uploaded + c.gpu_mapped + c.cpu_computed == (N_PROMPT + N_GEN) * k).all()
    if n_slots == 1:  # most tokens miss in every layer: both routes serve
        assert c.gpu_mapped.sum() > 0 and c.cpu_computed.sum() > 0
    h.close()


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
@pytest.mark.parametrize("resident", ["all", "two"])
def test_the_one_launch_step_decodes_the_three_launches_logits(make_model, prompt_text, monkeypatch, arch, resident):
    """Every layer's expert step in one launch (MOESTUDIO_ONE_LAUNCH_STEP=1) or in three (=0),
    every expert resident or two a layer (the rest through the mailbox): the same logits, bit for
    bit, and the form taken reported per kind of layer."""
    path = make_model(arch, QUANT.get(arch, QT.Q4_K))
    model = build_model(path, "cuda")
    prompt = tokenize_text(path, prompt_text)[:N_PROMPT]
    n_slots = model.config.n_expert if resident == "all" else 2
    logits = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("MOESTUDIO_ONE_LAUNCH_STEP", mode)
        h = hybrid(model, n_slots, "off")
        h.prefill_residency([(layer, e) for layer in model.expert_weights for e in range(n_slots)])
        logits[mode] = greedy(model, prompt)[1]
        assert bool(model._runner.token_experts.one_launch) == (mode == "1")
        forms = h.counters.decode_expert_step
        assert forms and all(f["one_launch"] == (mode == "1") for f in forms.values()), forms
        h.close()
    assert torch.equal(logits["0"], logits["1"])
