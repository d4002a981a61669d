"""The fused RMS norm and RoPE kernels (engine/kernels/norm_rope.py) against the torch code of
engine/layers (the reference and CPU path).

Two ways to run:
- here, without a GPU: Triton's interpreter runs the kernels on CPU tensors (small shapes,
  every variant the model families use);
- on the GPU machine: `python -m pytest -q -m gpu tests/kernels/test_norm_rope.py` runs the
  compiled kernels at real shapes, eager and replayed in a CUDA graph.

The contract: RoPE bit-identical to the torch code (the same float32 products, each rounded
before the sum); RMS norm equal up to the order of the row's sum of squares (and rsqrt's last
bit), bound NORM_TOL relative to the output's largest magnitude.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import
triton = pytest.importorskip("triton")

from engine.kernels import norm_rope  # noqa: E402
from engine.layers import norm as norm_layer  # noqa: E402
from engine.layers import rope as rope_layer  # noqa: E402
from engine.layers.rope import RopeConfig, rope_table  # noqa: E402

interp = pytest.mark.skipif(not norm_rope.INTERPRETED, reason="interpreter tests run where there is no GPU "
                            "(TRITON_INTERPRET=1 before the kernels are imported)")
gpu = pytest.mark.gpu

NORM_TOL = 2e-6  # of the output's largest magnitude: float32 summation order of one row (D <= 8192)

# RoPE variants of the model families: (label, cfg, head_dim)
ROPE_CASES = [
    ("neox", RopeConfig(n_rot=16, neox=True, freq_base=1e6), 16),  # qwen3moe, olmoe (NEOX)
    ("normal", RopeConfig(n_rot=16, neox=False), 16),  # llama/mixtral, deepseek2's rope part
    ("neox_partial", RopeConfig(n_rot=8, neox=True), 24),  # n_rot < head_dim: the rest passes through
    ("normal_partial", RopeConfig(n_rot=6, neox=False), 16),
    ("yarn_neox", RopeConfig(n_rot=16, neox=True, freq_base=150000.0, freq_scale=1 / 32, ext_factor=1.0,
                             attn_factor=1.0, beta_fast=32.0, beta_slow=1.0, n_ctx_orig=4096), 16),  # gpt-oss
    ("yarn_normal", RopeConfig(n_rot=16, neox=False, freq_base=10000.0, freq_scale=1 / 40, ext_factor=1.0,
                               attn_factor=1.0, beta_fast=32.0, beta_slow=1.0, n_ctx_orig=4096), 16),  # deepseek2
]


def _norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    out = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return out * weight if weight is not None else out


def _assert_norm_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == torch.float32 and got.is_contiguous()
    err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
    assert err <= NORM_TOL, err


def _rope_cases_device(device: str, n_tok: int, n_qh: int, n_kh: int, head_dim: int, n_ctx: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(n_tok, n_qh, head_dim, generator=g) * 3).to(device)
    k = (torch.randn(n_tok, n_kh, head_dim, generator=g) * 3).to(device)
    positions = torch.randint(0, n_ctx, (n_tok,), generator=g).to(device)
    return q, k, positions


# ------------------------------------------------------------------------------ interpreter

@interp
@pytest.mark.parametrize("d", [64, 128, 576, 2048])
@pytest.mark.parametrize("rows", [1, 5, 37])
@pytest.mark.parametrize("with_weight", [False, True])
def test_interpreter_rms_norm_matches_torch(d: int, rows: int, with_weight: bool) -> None:
    g = torch.Generator().manual_seed(d * 100 + rows)
    x = torch.randn(rows, d, generator=g) * 4 + 0.5
    w = torch.randn(d, generator=g) if with_weight else None
    _assert_norm_close(norm_rope.rms_norm(x, w, 1e-6), _norm_ref(x, w, 1e-6))


@interp
def test_interpreter_rms_norm_of_views(monkeypatch) -> None:
    """The per-head q/k norms (q.view(n, heads, hd)), deepseek2's strided kv[:, :kv_lora] and a
    1-D row, through the layer function as the models call it."""
    monkeypatch.setenv("MOESTUDIO_TRITON", "force")
    g = torch.Generator().manual_seed(3)
    q = torch.randn(7, 4 * 64, generator=g).view(7, 4, 64)
    kv = torch.randn(9, 512 + 64, generator=g)
    for x, w in ((q, torch.randn(64, generator=g)), (kv[:, :512], torch.randn(512, generator=g)),
                 (kv[:, 512:][:, None, :], None), (torch.randn(128, generator=g), torch.randn(128, generator=g))):
        calls = []
        monkeypatch.setattr(norm_rope, "_rms_norm_kernel", _counting(norm_rope._rms_norm_kernel, calls))
        _assert_norm_close(norm_layer.rms_norm(x, w, 1e-5), _norm_ref(x, w, 1e-5))
        assert len(calls) == 1, "one launch, no copy of the view"


@interp
def test_interpreter_rms_norm_falls_back_where_the_kernel_does_not_apply(monkeypatch) -> None:
    """Wider rows than a program holds, other dtypes and MOESTUDIO_TRITON=0 run the torch code."""
    calls = []
    monkeypatch.setattr(norm_rope, "_rms_norm_kernel", _counting(norm_rope._rms_norm_kernel, calls))
    monkeypatch.setenv("MOESTUDIO_TRITON", "force")
    x = torch.randn(2, norm_rope.MAX_NORM_DIM + 8)
    _assert_norm_close(norm_layer.rms_norm(x, None, 1e-6), _norm_ref(x, None, 1e-6))
    xd = torch.randn(3, 64, dtype=torch.float64)
    assert torch.equal(norm_layer.rms_norm(xd, None, 1e-6), _norm_ref(xd, None, 1e-6))
    monkeypatch.setenv("MOESTUDIO_TRITON", "0")
    x = torch.randn(3, 64)
    assert torch.equal(norm_layer.rms_norm(x, None, 1e-6), _norm_ref(x, None, 1e-6))
    assert calls == []
    monkeypatch.setenv("MOESTUDIO_TRITON", "force")
    norm_layer.rms_norm(x, None, 1e-6)
    assert len(calls) == 1


class _counting:
    """A launcher that records its launches (the real kernel runs)."""

    def __init__(self, kernel, calls: list):
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        self.calls.append(grid)
        return self.kernel[grid]


@interp
@pytest.mark.parametrize("label,cfg,head_dim", ROPE_CASES, ids=[c[0] for c in ROPE_CASES])
@pytest.mark.parametrize("n_tok", [1, 6])
def test_interpreter_rope_is_bit_exact(monkeypatch, label: str, cfg: RopeConfig, head_dim: int, n_tok: int) -> None:
    n_ctx = 64
    q, k, positions = _rope_cases_device("cpu", n_tok, 5, 2, head_dim, n_ctx, seed=n_tok)
    want_q = rope_layer._apply_rope_torch(q, positions, cfg, n_ctx)
    want_k = rope_layer._apply_rope_torch(k, positions, cfg, n_ctx)
    calls = []
    monkeypatch.setattr(norm_rope, "_rope_kernel", _counting(norm_rope._rope_kernel, calls))
    monkeypatch.setenv("MOESTUDIO_TRITON", "force")
    got_q, got_k = rope_layer.rope_qk(q, k, positions, cfg, n_ctx)
    assert len(calls) == 1, "q and k in one launch"
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(rope_layer.apply_rope(q, positions, cfg, n_ctx), want_q)
    assert len(calls) == 2


@interp
def test_interpreter_rope_of_deepseek2_strided_slices(monkeypatch) -> None:
    """deepseek2 passes q[..., nope:] [T, H, rope] and kv[:, None, kv_lora:] [T, 1, rope]: read in
    place (no copy), one head of k, positions as int32 too."""
    cfg, n_ctx = ROPE_CASES[-1][1], 40
    g = torch.Generator().manual_seed(5)
    q = torch.randn(3, 20 * (8 + 16), generator=g).view(3, 20, 24)  # 20 heads > one block of heads
    kv = torch.randn(3, 32 + 16, generator=g)
    q_pe, k_pe = q[..., 8:], kv[:, None, 32:]
    for positions in (torch.tensor([0, 39, 17]), torch.tensor([5, 6, 7], dtype=torch.int32)):
        want = (rope_layer._apply_rope_torch(q_pe, positions, cfg, n_ctx),
                rope_layer._apply_rope_torch(k_pe, positions, cfg, n_ctx))
        monkeypatch.setenv("MOESTUDIO_TRITON", "force")
        got = rope_layer.rope_qk(q_pe, k_pe, positions, cfg, n_ctx)
        monkeypatch.setenv("MOESTUDIO_TRITON", "0")
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert got[0].is_contiguous() and got[1].shape == (3, 1, 16)


@interp
@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek2", "gpt-oss"])
def test_interpreter_model_gives_the_same_tokens(make_model, monkeypatch, arch: str) -> None:
    """A tiny synthetic model's prompt logits and greedy tokens with the norm and RoPE kernels
    (force: the interpreter) against the torch code. qwen3moe: per-head q/k norms, NEOX;
    deepseek2: MLA's strided rope slices and the kv_a norm, YaRN; gpt-oss: YaRN NEOX. RoPE is
    exact, the norms differ by summation order, so tokens agree and logits nearly."""
    from engine.layers import linear
    from engine.models import build_model

    path = make_model(arch)
    prompt = torch.tensor([1, 5, 9, 2, 7, 3])
    # Only this module's kernels: the dense products stay on the torch path.
    monkeypatch.setattr(linear, "triton_applies", lambda device: False)
    norm_calls, rope_calls = [], []
    monkeypatch.setattr(norm_rope, "_rms_norm_kernel", _counting(norm_rope._rms_norm_kernel, norm_calls))
    monkeypatch.setattr(norm_rope, "_rope_kernel", _counting(norm_rope._rope_kernel, rope_calls))
    results = {}
    for mode in ("0", "force"):
        monkeypatch.setenv("MOESTUDIO_TRITON", mode)
        results[mode] = _greedy(build_model(path), prompt, 4)
        if mode == "0":
            assert norm_calls == [] and rope_calls == []
    (logits0, toks0), (logits1, toks1) = results["0"], results["force"]
    n_layer, steps = build_model(path).config.n_layer, 5  # steps: the prompt and four tokens
    assert len(rope_calls) == steps * n_layer, "one rope launch per layer and step: q and k together"
    # norms per layer: attn + ffn, and qwen3moe's per-head q and k, deepseek2's kv_a (and q_a
    # where the model has a q LoRA); one more for the output
    per_layer = {"qwen3moe": 4, "gpt-oss": 2, "deepseek2": 3}[arch]
    assert steps * (per_layer * n_layer + 1) <= len(norm_calls) <= steps * ((per_layer + 1) * n_layer + 1)
    assert toks1 == toks0
    assert (logits1 - logits0).abs().max().item() <= 1e-4 * logits0.abs().max().item()


def _greedy(model, prompt: torch.Tensor, n_new: int) -> tuple[torch.Tensor, list[int]]:
    cache = model.new_cache(64)
    logits = model.forward(prompt, cache, 0)
    first = logits.clone()
    tokens = []
    pos = len(prompt)
    for _ in range(n_new):
        tok = int(logits[-1].argmax())
        tokens.append(tok)
        logits = model.forward(torch.tensor([tok]), cache, pos)
        pos += 1
    return first, tokens


# ------------------------------------------------------------------------------ sm_90, no GPU

@pytest.mark.slow
@pytest.mark.skipif(not norm_rope.available(), reason="needs Triton")
def test_kernels_compile_for_hopper_without_spills() -> None:
    """Every variant compiles for sm_90 (Triton ships ptxas; a subprocess, since the kernels
    here may be imported for the interpreter): rows up to 8192 stay in registers, loads are
    16 bytes wide, and RoPE's products are not contracted into FMAs (its bit-exactness)."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "engine.kernels.norm_rope"], capture_output=True, text=True,
                          env=env, timeout=600)
    if proc.returncode != 0 and ("ptxas" in proc.stderr or "backend" in proc.stderr.lower()):
        pytest.skip(f"this Triton cannot compile for CUDA here: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    want = {f"rms_norm D={d} w={w}" for d in norm_rope.AOT_NORM_DIMS for w in (0, 1)}
    want |= {f"rope {label}" for label, *_ in norm_rope.AOT_ROPE}
    assert {r["kernel"] for r in rows} == want
    for r in rows:
        assert r["spill_ops"] == 0 and r["local"] == 0, r
        # rows of 16k values read 16 bytes at a time (the GQA heads' NEOX halves too)
        if r["kernel"].startswith("rms_norm") and not r["kernel"].startswith("rms_norm D=64 "):
            assert set(r["loads"]) == {"LDG.E.128"}, r
        if r["kernel"].startswith("rope"):
            assert r["ffma"] == 0, f"{r['kernel']}: a product fused into a sum is not the torch code's rounding"
            assert r["loads"].get("LDG.E.128", 0) > 0 and "LDG.E" not in r["loads"], r


# ------------------------------------------------------------------------------ GPU

@gpu
@pytest.mark.parametrize("d", [64, 128, 576, 2048, 4096, 7168])
@pytest.mark.parametrize("rows", [1, 37, 512])
@pytest.mark.parametrize("with_weight", [False, True])
def test_gpu_rms_norm_matches_torch(d: int, rows: int, with_weight: bool) -> None:
    g = torch.Generator().manual_seed(d + rows)
    x = (torch.randn(rows, d, generator=g) * 4 + 0.5).cuda()
    w = torch.randn(d, generator=g).cuda() if with_weight else None
    _assert_norm_close(norm_rope.rms_norm(x, w, 1e-6), _norm_ref(x, w, 1e-6))


# (label, cfg, n_qh, n_kh, head_dim) at the real models' shapes
GPU_ROPE = [
    ("qwen3-30b-a3b", RopeConfig(n_rot=128, neox=True, freq_base=1e6), 32, 4, 128),
    ("gpt-oss", RopeConfig(n_rot=64, neox=True, freq_base=150000.0, freq_scale=1 / 32, ext_factor=1.0,
                           n_ctx_orig=4096), 64, 8, 64),
    ("mixtral", RopeConfig(n_rot=128, neox=False, freq_base=1e6), 32, 8, 128),
    ("deepseek2-rope", RopeConfig(n_rot=64, neox=False, freq_scale=1 / 40, ext_factor=1.0, n_ctx_orig=4096,
                                  attn_factor=1.0), 16, 1, 64),
    ("partial", RopeConfig(n_rot=64, neox=True), 16, 2, 128),
]


@gpu
@pytest.mark.parametrize("label,cfg,n_qh,n_kh,head_dim", GPU_ROPE, ids=[c[0] for c in GPU_ROPE])
@pytest.mark.parametrize("n_tok", [1, 300])
def test_gpu_rope_is_bit_exact(monkeypatch, label, cfg, n_qh, n_kh, head_dim, n_tok) -> None:
    n_ctx = 4096
    q, k, positions = _rope_cases_device("cuda", n_tok, n_qh, n_kh, head_dim, n_ctx, seed=n_tok)
    monkeypatch.setenv("MOESTUDIO_TRITON", "1")
    got_q, got_k = rope_layer.rope_qk(q, k, positions, cfg, n_ctx)
    assert torch.equal(got_q, rope_layer._apply_rope_torch(q, positions, cfg, n_ctx))
    assert torch.equal(got_k, rope_layer._apply_rope_torch(k, positions, cfg, n_ctx))


@gpu
def test_gpu_norm_and_rope_replay_in_a_cuda_graph(monkeypatch) -> None:
    """Captured once, replayed at other positions and inputs: the same results as eager runs."""
    monkeypatch.setenv("MOESTUDIO_TRITON", "1")
    cfg, n_ctx = GPU_ROPE[0][1], 4096
    q = torch.randn(1, 32, 128, device="cuda")
    k = torch.randn(1, 4, 128, device="cuda")
    w = torch.randn(128, device="cuda")
    positions = torch.zeros(1, dtype=torch.long, device="cuda")

    def step():
        return rope_layer.rope_qk(norm_layer.rms_norm(q, w, 1e-6), norm_layer.rms_norm(k, w, 1e-6), positions,
                                  cfg, n_ctx)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_q, out_k = step()
    for pos in (7, 4095, 123):
        q.copy_(torch.randn_like(q))
        k.copy_(torch.randn_like(k))
        positions.fill_(pos)
        graph.replay()
        want_q, want_k = step()
        assert torch.equal(out_q, want_q) and torch.equal(out_k, want_k)


@gpu
@pytest.mark.parametrize("n_tok", [1, 300])
def test_gpu_rope_and_norm_of_deepseek2_strided_slices(monkeypatch, n_tok: int) -> None:
    """DeepSeek-V2's MLA at real shapes: q [T, 16, 128 + 64] rotated in its last 64 dims, k_pe the
    last 64 of kv_a's 512 + 64, read in place; the kv_a norm over the strided first 512."""
    monkeypatch.setenv("MOESTUDIO_TRITON", "1")
    cfg, n_ctx = GPU_ROPE[3][1], 4096
    q = torch.randn(n_tok, 16 * 192, device="cuda").view(n_tok, 16, 192)
    kv = torch.randn(n_tok, 512 + 64, device="cuda")
    positions = torch.randint(0, n_ctx, (n_tok,), device="cuda")
    q_pe, k_pe = rope_layer.rope_qk(q[..., 128:], kv[:, None, 512:], positions, cfg, n_ctx)
    assert torch.equal(q_pe, rope_layer._apply_rope_torch(q[..., 128:], positions, cfg, n_ctx))
    assert torch.equal(k_pe, rope_layer._apply_rope_torch(kv[:, None, 512:], positions, cfg, n_ctx))
    w = torch.randn(512, device="cuda")
    _assert_norm_close(norm_layer.rms_norm(kv[:, :512], w, 1e-6), _norm_ref(kv[:, :512], w, 1e-6))
