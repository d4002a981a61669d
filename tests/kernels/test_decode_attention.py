"""The fused decode attention kernel (engine/kernels/decode_attention.py) against the torch
reference, engine.layers.attention.attend.

- here, without a GPU: Triton's interpreter runs the kernel on CPU tensors at small shapes
  (every variant the model families use: GQA groups 1/2/4/8, head dims 64/128, the sliding
  window, sinks, deepseek2's MLA shape), and a tiny model decodes the same tokens with the
  kernels forced as with the torch code; the kernel also compiles for sm_90 (Hopper) here;
- on the GPU (`-m gpu`): the compiled kernel at real shapes and contexts 4096 / 32768, and
  inside a CUDA graph.

The contract: equal to `attend` up to float32 summation order (online-softmax rescaling and
split partials), i.e. within REL_TOL of the output's largest magnitude; the whole cache and its
filled prefix (graph and eager) give bit-identical results.
"""
from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from engine.kernels import decode_attention as da  # noqa: E402
from engine.layers import precision  # noqa: E402
from engine.layers.attention import attend  # noqa: E402

interp = pytest.mark.skipif(not da.INTERPRETED, reason="interpreter tests run where there is no GPU "
                            "(TRITON_INTERPRET=1 before the kernel is imported)")
gpu = pytest.mark.gpu

REL_TOL = 1e-5  # of the output's largest magnitude: float32 summation order only


def reference(q, k, v, positions, scale, window=0, sinks=None) -> torch.Tensor:
    """attend's torch code (MOESTUDIO_TRITON unset runs it for CPU tensors; on CUDA, forced off)."""
    old = os.environ.get("MOESTUDIO_TRITON")
    os.environ["MOESTUDIO_TRITON"] = "0"
    try:
        return attend(q, k, v, positions, scale, window, sinks)
    finally:
        if old is None:
            del os.environ["MOESTUDIO_TRITON"]
        else:
            os.environ["MOESTUDIO_TRITON"] = old


def case(n_tok, n_head, n_kv, dk, dv, n_ctx, pos, device="cpu", sinks=False, seed=0):
    """q for tokens at pos..pos+n_tok-1 and a cache whose rows past them hold garbage (large
    values: read by mistake they would show)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n_tok, n_head, dk, generator=g)
    k = torch.randn(n_ctx, n_kv, dk, generator=g)
    v = torch.randn(n_ctx, n_kv, dv, generator=g)
    end = pos + n_tok
    k[end:] = 1e4
    v[end:] = float("nan")
    s = torch.randn(n_head, generator=g) * 2.0 if sinks else None
    positions = torch.arange(pos, end)
    to = (lambda t: t.to(device) if t is not None else None)
    return to(q), to(k), to(v), to(positions), to(s)


def check(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and torch.isfinite(out).all()
    err = (out - ref).abs().max().item()
    assert err <= REL_TOL * ref.abs().max().item(), f"max error {err} vs magnitude {ref.abs().max().item()}"


# (n_head, n_kv, dk, dv, window, sinks): the families' variants at small head counts
GEOMETRIES = {
    "group1-64": (4, 4, 64, 64, 0, False),  # olmoe
    "group2-64": (4, 2, 64, 64, 0, False),  # the tiny models
    "group4-128": (8, 2, 128, 128, 0, False),  # mixtral's group
    "group8-128": (16, 2, 128, 128, 0, False),  # qwen3moe
    "group8-64-window-sinks": (16, 2, 64, 64, 16, True),  # gpt-oss sliding layers
    "group8-64-sinks": (16, 2, 64, 64, 0, True),  # gpt-oss full layers
    "mla-576-512": (16, 1, 576, 512, 0, False),  # deepseek2
    "mla-tiny-288-256": (4, 1, 288, 256, 0, False),  # the tiny deepseek2
}
N_CTX = 96


@interp
@pytest.mark.parametrize("name", GEOMETRIES)
@pytest.mark.parametrize("pos", [0, 1, 45, N_CTX - 1])
def test_one_token_matches_attend_over_cache_and_prefix(name, pos):
    n_head, n_kv, dk, dv, window, sinks = GEOMETRIES[name]
    q, k, v, positions, s = case(1, n_head, n_kv, dk, dv, N_CTX, pos, sinks=sinks)
    scale = dk ** -0.5
    whole = da.decode_attention(q, k, v, positions, scale, window, s)
    prefix = da.decode_attention(q, k[:pos + 1], v[:pos + 1], positions, scale, window, s)
    # Only keys up to the position are read, and the split plan never depends on the view's
    # length: the graph's whole cache and the eager prefix run the same sums.
    assert torch.equal(whole, prefix)
    check(whole, reference(q, k[:pos + 1], v[:pos + 1], positions, scale, window, s))


@interp
@pytest.mark.parametrize("n_splits", [1, 3, 7, 64])
def test_any_split_count_gives_the_same_attention(n_splits):
    """Chunks of one key block, many empty splits, one split for all: the partials combine
    to the reference (window and sinks on, so the range starts past 0)."""
    q, k, v, positions, s = case(1, 16, 2, 64, 64, N_CTX, 80, sinks=True, seed=1)
    out = da.decode_attention(q, k, v, positions, 0.125, 20, s, n_splits=n_splits)
    check(out, reference(q, k[:81], v[:81], positions, 0.125, 20, s))


@interp
@pytest.mark.parametrize("n_tok", [2, 8])
@pytest.mark.parametrize("name", ["group2-64", "group8-64-window-sinks", "mla-tiny-288-256"])
def test_a_few_tokens_are_causal_among_themselves(n_tok, name):
    n_head, n_kv, dk, dv, window, sinks = GEOMETRIES[name]
    q, k, v, positions, s = case(n_tok, n_head, n_kv, dk, dv, N_CTX, 30, sinks=sinks, seed=2)
    end = 30 + n_tok
    out = da.decode_attention(q, k, v, positions, dk ** -0.5, window, s)
    check(out, reference(q, k[:end], v[:end], positions, dk ** -0.5, window, s))


@interp
def test_attend_dispatches_where_the_kernels_run(monkeypatch):
    """With the kernels forced, attend runs the kernel for decode-sized queries; the torch
    code for longer ones and inside a float64-accumulated run (the noise floor)."""
    q, k, v, positions, s = case(1, 16, 2, 64, 64, N_CTX, 50, sinks=True, seed=3)
    monkeypatch.setenv("MOESTUDIO_TRITON", "force")
    kernel = da.decode_attention(q, k, v, positions, 0.125, 16, s)
    assert torch.equal(attend(q, k, v, positions, 0.125, 16, s), kernel)
    with precision.accumulate_in(torch.float64):
        wide = attend(q, k[:51], v[:51], positions, 0.125, 16, s)
    assert not torch.equal(wide, kernel)
    check(wide, kernel)
    monkeypatch.setenv("MOESTUDIO_TRITON", "0")
    assert not torch.equal(attend(q, k[:51], v[:51], positions, 0.125, 16, s), kernel)


@interp
@pytest.mark.parametrize("arch", ["gpt-oss", "deepseek2"])
def test_a_tiny_model_decodes_the_same_tokens_with_the_kernels(make_model, prompt_text, monkeypatch, arch):
    """End to end: greedy decoding with every Triton kernel forced (the interpreter) gives the
    torch path's tokens; gpt-oss crosses its 16-token window with sinks, deepseek2 is MLA."""
    from engine.models import build_model
    from engine.runtime.tokenizer import tokenize_text

    path = make_model(arch)
    prompt = tokenize_text(path, prompt_text)[:20]

    def greedy(mode: str) -> tuple[list[int], torch.Tensor]:
        monkeypatch.setenv("MOESTUDIO_TRITON", mode)
        model = build_model(path)
        cache = model.new_cache(64)
        logits = model.forward(torch.tensor(prompt), cache)[-1]
        tokens, rows = [], []
        for _ in range(6):
            tokens.append(int(logits.argmax()))
            logits = model.forward(torch.tensor(tokens[-1:]), cache)[-1]
            rows.append(logits)
        return tokens, torch.stack(rows)

    tokens, logits = greedy("force")
    ref_tokens, ref_logits = greedy("0")
    assert tokens == ref_tokens
    # The forced run also rounds activations in the dense kernels: same values, other sums.
    assert (logits - ref_logits).abs().max().item() <= 1e-4 * ref_logits.abs().max().item()


def test_kernels_compile_for_hopper_without_spills() -> None:
    """Every launch of the real geometries compiles for sm_90 (no GPU needed: Triton ships
    ptxas) without spilling; run in a subprocess, where the kernel is compiled, not interpreted."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "engine.kernels.decode_attention", "--aot"], capture_output=True,
                          text=True, env=env, timeout=900)
    if proc.returncode != 0 and ("ptxas" in proc.stderr or "backend" in proc.stderr.lower()):
        pytest.skip(f"this Triton cannot compile for CUDA here: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {r["geometry"] for r in rows} == set(da.REAL_GEOMETRIES)
    for r in rows:
        assert r["spill_ops"] == 0 and r["local"] == 0, f"{r['geometry']} {r['kernel']} spills: {r}"


# ------------------------------------------------------------------------------ on the GPU

@gpu
@pytest.mark.parametrize("name", list(da.REAL_GEOMETRIES))
@pytest.mark.parametrize("n_ctx", [4096, 32768])
def test_real_shapes_match_attend(name, n_ctx):
    n_head, n_kv, dk, dv, window, sinks = da.REAL_GEOMETRIES[name]
    _, k, v, _, s = case(1, n_head, n_kv, dk, dv, n_ctx, n_ctx - 1, device="cuda", sinks=sinks)
    scale = dk ** -0.5
    for pos in (0, 7, n_ctx // 2 + 3, n_ctx - 1):
        q = torch.randn(1, n_head, dk, device="cuda")
        positions = torch.tensor([pos], device="cuda")
        whole = da.decode_attention(q, k, v, positions, scale, window, s)
        assert torch.equal(whole, da.decode_attention(q, k[:pos + 1], v[:pos + 1], positions, scale, window, s))
        check(whole, reference(q, k[:pos + 1], v[:pos + 1], positions, scale, window, s))


@gpu
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gpt-oss-swa", "deepseek2-mla"])
def test_graph_replays_follow_the_position(name):
    """Captured once at one position, replayed at others (the position a device tensor): the
    graph gives the eager prefix call's result bit for bit."""
    n_head, n_kv, dk, dv, window, sinks = da.REAL_GEOMETRIES[name]
    n_ctx = 4096
    q, k, v, _, s = case(1, n_head, n_kv, dk, dv, n_ctx, n_ctx - 1, device="cuda", sinks=sinks)
    pos = torch.zeros(1, dtype=torch.int64, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # the inputs were copied on the default stream
    with torch.cuda.stream(stream):
        da.decode_attention(q, k, v, pos, 0.1, window, s)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = da.decode_attention(q, k, v, pos, 0.1, window, s)
    torch.cuda.current_stream().wait_stream(stream)
    for p in (0, 100, 2049, n_ctx - 1):
        pos.fill_(p)
        graph.replay()
        torch.cuda.synchronize()
        eager = da.decode_attention(q, k[:p + 1], v[:p + 1], pos, 0.1, window, s)
        assert torch.equal(out, eager), p
        check(out, reference(q, k[:p + 1], v[:p + 1], pos, 0.1, window, s))
