"""The fused RMS norm, residual add + RMS norm and RoPE (with qwen3moe's per-head q/k norms)
kernels (engine/kernels/norm_rope.py) against the torch code of engine/layers (the reference
and CPU path).

Two ways to run:
- here, without a GPU: Triton's interpreter runs the kernels on CPU tensors (small shapes,
  every variant the model families use);
- on the GPU machine: `python -m pytest -q -m gpu tests/kernels/test_norm_rope.py` runs the
  compiled kernels at real shapes, eager and replayed in a CUDA graph.

The contract: RoPE bit-identical to the torch code (the same float32 products, each rounded
before the sum); RMS norm equal up to the order of the row's sum of squares (and rsqrt's last
bit), bound NORM_TOL relative to the output's largest magnitude; the residual add bit-identical
(one rounded add). Where the inputs are small integers every order of the sum of squares is
exact, so there the fused norms must equal the torch sequence bit for bit too (on CPU, where
rsqrt is the same 1/sqrt): that pins the formula, not just the tolerance.
"""
from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from engine.kernels import norm_rope  # noqa: E402
from engine.layers import norm as norm_layer  # noqa: E402
from engine.layers import rope as rope_layer  # noqa: E402
from engine.layers.rope import RopeConfig  # noqa: E402

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


def _add_norm_ref(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor | None,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    s = h + delta
    return s, _norm_ref(s, weight, eps)


def _ints(g: torch.Generator, *shape: int) -> torch.Tensor:
    """Small integers as float32: every partial sum of their squares is exact."""
    return torch.randint(-4, 5, shape, generator=g).float()


@interp
@pytest.mark.parametrize("d", [64, 256, 2048, 2880])
@pytest.mark.parametrize("rows", [1, 6])
@pytest.mark.parametrize("with_weight", [False, True])
def test_interpreter_add_rms_norm_matches_torch(monkeypatch, d: int, rows: int, with_weight: bool) -> None:
    """The residual add is exact (h_new == h + delta bit for bit), the norm of the sum equal to
    summation order; one launch through the layer function."""
    g = torch.Generator().manual_seed(d + rows)
    h = torch.randn(rows, d, generator=g) * 4 + 0.5
    delta = torch.randn(rows, d, generator=g) * 3
    w = torch.randn(d, generator=g) if with_weight else None
    calls = []
    monkeypatch.setattr(norm_rope, "_add_rms_norm_kernel", _counting(norm_rope._add_rms_norm_kernel, calls))
    monkeypatch.setenv("MOESTUDIO_TRITON", "force")
    h_new, x = norm_layer.add_rms_norm(h, delta, w, 1e-6)
    want_h, want_x = _add_norm_ref(h, delta, w, 1e-6)
    assert len(calls) == 1
    assert torch.equal(h_new, want_h) and h_new.is_contiguous()
    _assert_norm_close(x, want_x)
    hi, di = _ints(g, rows, d), _ints(g, rows, d)
    assert all(torch.equal(a, b) for a, b in zip(norm_rope.add_rms_norm(hi, di, w, 1e-6),
                                                  _add_norm_ref(hi, di, w, 1e-6)))


@interp
def test_interpreter_add_rms_norm_of_strided_rows_and_fallbacks(monkeypatch) -> None:
    """Rows with a stride (a slice of a wider tensor) are read in place; shapes the kernel does not
    take (broadcast delta, float64, rows past MAX_NORM_DIM) and MOESTUDIO_TRITON=0 run the torch
    code, with the same results."""
    g = torch.Generator().manual_seed(11)
    wide = torch.randn(4, 96, generator=g)
    h, delta, w = wide[:, :64], torch.randn(4, 64, generator=g), torch.randn(64, generator=g)
    calls = []
    monkeypatch.setattr(norm_rope, "_add_rms_norm_kernel", _counting(norm_rope._add_rms_norm_kernel, calls))
    monkeypatch.setenv("MOESTUDIO_TRITON", "force")
    h_new, x = norm_layer.add_rms_norm(h, delta, w, 1e-5)
    want_h, want_x = _add_norm_ref(h, delta, w, 1e-5)
    assert len(calls) == 1 and torch.equal(h_new, want_h)
    _assert_norm_close(x, want_x)
    for args in ((h, delta[:1], w), (h.double(), delta.double(), w.double()),
                 (torch.randn(2, norm_rope.MAX_NORM_DIM + 8), torch.randn(2, norm_rope.MAX_NORM_DIM + 8), None)):
        got, want = norm_layer.add_rms_norm(*args, 1e-5), _add_norm_ref(*args, 1e-5)
        assert torch.equal(got[0], want[0])
        _assert_norm_close(got[1].float(), want[1].float())
    monkeypatch.setenv("MOESTUDIO_TRITON", "0")
    got = norm_layer.add_rms_norm(h, delta, w, 1e-5)
    assert torch.equal(got[0], want_h) and torch.equal(got[1], want_x)
    assert len(calls) == 1


def _rope_norm_ref(q, k, positions, cfg, n_ctx, qw, kw, eps):
    """The torch sequence the fused launch replaces: the per-head norms, then RoPE."""
    return (rope_layer._apply_rope_torch(_norm_ref(q, qw, eps), positions, cfg, n_ctx),
            rope_layer._apply_rope_torch(_norm_ref(k, kw, eps), positions, cfg, n_ctx))


@interp
@pytest.mark.parametrize("label,cfg,head_dim", ROPE_CASES, ids=[c[0] for c in ROPE_CASES])
@pytest.mark.parametrize("n_tok", [1, 6])
def test_interpreter_rope_with_qk_norm_matches_the_two_steps(monkeypatch, label: str, cfg: RopeConfig,
                                                            head_dim: int, n_tok: int) -> None:
    """qwen3moe's per-head q/k norms in the RoPE launch (every pairing and partial n_rot, so the
    passed-through dims are normalised too): one launch, no norm launch; equal to norm-then-rope
    up to the norm's summation order, and bit for bit where that order cannot matter."""
    n_ctx, eps = 64, 1e-6
    q, k, positions = _rope_cases_device("cpu", n_tok, 20, 4, head_dim, n_ctx, seed=n_tok + 7)
    g = torch.Generator().manual_seed(head_dim)
    qw, kw = torch.randn(head_dim, generator=g), torch.randn(head_dim, generator=g)
    rope_calls, norm_calls = [], []
    monkeypatch.setattr(norm_rope, "_rope_kernel", _counting(norm_rope._rope_kernel, rope_calls))
    monkeypatch.setattr(norm_rope, "_rms_norm_kernel", _counting(norm_rope._rms_norm_kernel, norm_calls))
    monkeypatch.setenv("MOESTUDIO_TRITON", "force")
    got = rope_layer.rope_qk(q, k, positions, cfg, n_ctx, (qw, kw), eps)
    assert len(rope_calls) == 1 and norm_calls == []
    for a, b in zip(got, _rope_norm_ref(q, k, positions, cfg, n_ctx, qw, kw, eps)):
        _assert_norm_close(a, b)
    qi, ki = _ints(g, n_tok, 20, head_dim), _ints(g, n_tok, 4, head_dim)
    got = rope_layer.rope_qk(qi, ki, positions, cfg, n_ctx, (qw, kw), eps)
    want = _rope_norm_ref(qi, ki, positions, cfg, n_ctx, qw, kw, eps)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    monkeypatch.setenv("MOESTUDIO_TRITON", "0")
    got = rope_layer.rope_qk(qi, ki, positions, cfg, n_ctx, (qw, kw), eps)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and len(rope_calls) == 2


@interp
@pytest.mark.parametrize("label,cfg,head_dim", [ROPE_CASES[0], ROPE_CASES[3]], ids=["neox", "normal_partial"])
@pytest.mark.parametrize("start", [None, 3], ids=["graph", "prompt"])
def test_interpreter_rope_stores_k_and_v_into_the_cache(monkeypatch, label: str, cfg: RopeConfig, head_dim: int,
                                                      start: int | None) -> None:
    """rope_qk_store: the RoPE launch (with the per-head norms) also writes the rotated k rows and
    v's rows into the cache rows at the positions, and returns what KVCache.store returns; the
    same cache and results as rope_qk then store (the torch path), other rows untouched."""
    from engine.layers.attention import KVCache

    n_ctx, n_kh, eps = 16, 3, 1e-6
    n_tok = 1 if start is None else 5
    q, _, _ = _rope_cases_device("cpu", n_tok, 8, n_kh, head_dim, n_ctx, seed=n_tok)
    g = torch.Generator().manual_seed(head_dim)
    kv = _ints(g, n_tok, n_kh, 2 * head_dim)  # one projection's output: k and v are strided views of it
    k, v = kv[..., :head_dim], kv[..., head_dim:]
    positions = torch.tensor([11]) if start is None else torch.arange(start, start + n_tok)
    qw, kw = torch.rand(head_dim, generator=g) + 0.5, torch.rand(head_dim, generator=g) + 0.5
    rope_calls = []
    monkeypatch.setattr(norm_rope, "_rope_kernel", _counting(norm_rope._rope_kernel, rope_calls))
    caches, outs = [], []
    for mode in ("force", "0"):
        monkeypatch.setenv("MOESTUDIO_TRITON", mode)
        cache = KVCache(1, n_ctx, n_kh, head_dim, head_dim)
        for c in (cache.k[0], cache.v[0]):
            c.fill_(-7.0)  # rows the step must not touch
        outs.append(rope_layer.rope_qk_store(q, k, v, positions, cfg, cache, 0, start, (qw, kw), eps))
        caches.append(cache)
    assert len(rope_calls) == 1
    (q1, k1, v1), (q0, k0, v0) = outs
    _assert_norm_close(q1, q0)
    _assert_norm_close(caches[0].k[0], caches[1].k[0])
    assert torch.equal(caches[0].v[0], caches[1].v[0]) and torch.equal(caches[0].v[0][positions], v)
    untouched = torch.ones(n_ctx, dtype=torch.bool)
    untouched[positions] = False
    assert (caches[0].k[0][untouched] == -7.0).all() and (caches[0].v[0][untouched] == -7.0).all()
    rows = n_ctx if start is None else start + n_tok
    assert k1.shape[0] == v1.shape[0] == k0.shape[0] == rows
    assert k1.data_ptr() == caches[0].k[0].data_ptr() and v1.data_ptr() == caches[0].v[0].data_ptr()


@interp
def test_interpreter_rope_with_wide_qk_norm_takes_two_launches(monkeypatch) -> None:
    """Head rows wider than MAX_ROPE_NORM_DIM: the norm launch, then the plain RoPE launch."""
    cfg, n_ctx, hd = RopeConfig(n_rot=64, neox=True), 16, 2 * norm_rope.MAX_ROPE_NORM_DIM
    q, k, positions = _rope_cases_device("cpu", 2, 2, 1, hd, n_ctx, seed=1)
    qw, kw = torch.randn(hd), torch.randn(hd)
    rope_calls, norm_calls = [], []
    monkeypatch.setattr(norm_rope, "_rope_kernel", _counting(norm_rope._rope_kernel, rope_calls))
    monkeypatch.setattr(norm_rope, "_rms_norm_kernel", _counting(norm_rope._rms_norm_kernel, norm_calls))
    monkeypatch.setenv("MOESTUDIO_TRITON", "force")
    got = rope_layer.rope_qk(q, k, positions, cfg, n_ctx, (qw, kw), 1e-6)
    assert len(rope_calls) == 1 and len(norm_calls) == 2
    for a, b in zip(got, _rope_norm_ref(q, k, positions, cfg, n_ctx, qw, kw, 1e-6)):
        _assert_norm_close(a, b)


@interp
@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek2", "gpt-oss"])
def test_interpreter_model_gives_the_same_tokens(make_model, monkeypatch, arch: str) -> None:
    """A tiny synthetic model's prompt logits and greedy tokens with the norm and RoPE kernels
    (force: the interpreter) against the torch code. qwen3moe: per-head q/k norms in the RoPE
    launch, NEOX; deepseek2: MLA's strided rope slices and the kv_a norm, YaRN; gpt-oss: YaRN
    NEOX; every family: the residual adds fused with the norms that follow. RoPE and the adds
    are exact, the norms differ by summation order, so tokens agree and logits nearly."""
    from engine.layers import linear
    from engine.models import build_model

    path = make_model(arch)
    prompt = torch.tensor([1, 5, 9, 2, 7, 3])
    # Only this module's kernels: the dense products stay on the torch path.
    monkeypatch.setattr(linear, "triton_applies", lambda device: False)
    norm_calls, add_norm_calls, rope_calls = [], [], []
    monkeypatch.setattr(norm_rope, "_rms_norm_kernel", _counting(norm_rope._rms_norm_kernel, norm_calls))
    monkeypatch.setattr(norm_rope, "_add_rms_norm_kernel", _counting(norm_rope._add_rms_norm_kernel,
                                                                     add_norm_calls))
    monkeypatch.setattr(norm_rope, "_rope_kernel", _counting(norm_rope._rope_kernel, rope_calls))
    results = {}
    for mode in ("0", "force"):
        monkeypatch.setenv("MOESTUDIO_TRITON", mode)
        results[mode] = _greedy(build_model(path), prompt, 4)
        if mode == "0":
            assert norm_calls == [] and add_norm_calls == [] and rope_calls == []
    (logits0, toks0), (logits1, toks1) = results["0"], results["force"]
    n_layer, steps = build_model(path).config.n_layer, 5  # steps: the prompt and four tokens
    assert len(rope_calls) == steps * n_layer, "one rope launch per layer and step: q, k and their norms"
    # two residual adds per layer, each with the norm after it (the next attn/ffn norm, the
    # output norm); plain norms: the first attn norm per step, and deepseek2's kv_a per layer
    # (the tiny model has no q LoRA, so no q_a norm); qwen3moe's per-head norms are in the rope launch
    assert len(add_norm_calls) == steps * 2 * n_layer
    assert len(norm_calls) == steps * (1 + {"qwen3moe": 0, "gpt-oss": 0, "deepseek2": 1}[arch] * n_layer)
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
    16 bytes wide, and RoPE's products are not contracted into FMAs (its bit-exactness; with
    the per-head q/k norms too, whose power-of-two mean is a product, not the FMAs of a division)."""
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
    want |= {f"add_rms_norm D={d}" for d in norm_rope.AOT_ADD_NORM_DIMS}
    want |= {f"rope {label}" for label, *_ in norm_rope.AOT_ROPE}
    want |= {f"rope {label} +kv" for label, *_ in norm_rope.AOT_ROPE if label != "deepseek2"}
    assert {r["kernel"] for r in rows} == want
    for r in rows:
        assert r["spill_ops"] == 0 and r["local"] == 0, r
        # rows of 16k values read 16 bytes at a time (the GQA heads' NEOX halves too)
        if "rms_norm" in r["kernel"] and not r["kernel"].startswith("rms_norm D=64 "):
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
def test_gpu_rope_store_replays_in_a_cuda_graph(monkeypatch) -> None:
    """qwen3moe's decode step: q/k norms, RoPE and the k/v stores in one launch, captured once and
    replayed at other positions: the cache rows equal rope_qk then index_copy_ (bit for bit: the
    same kernel rotates both)."""
    from engine.layers.attention import KVCache

    monkeypatch.setenv("MOESTUDIO_TRITON", "1")
    cfg, n_ctx = GPU_ROPE[0][1], 4096
    qkv = torch.randn(1, 32 * 128 + 2 * 4 * 128, device="cuda")
    w = torch.randn(128, device="cuda")
    positions = torch.zeros(1, dtype=torch.long, device="cuda")
    cache = KVCache(1, n_ctx, 4, 128, 128, "cuda")

    def views():
        q, k, v = qkv.split([32 * 128, 4 * 128, 4 * 128], dim=-1)
        return q.view(1, 32, 128), k.view(1, 4, 128), v.view(1, 4, 128)

    def step():
        q, k, v = views()
        return rope_layer.rope_qk_store(q, k, v, positions, cfg, cache, 0, None, (w, w), 1e-6)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_q, _, _ = step()
    for pos in (7, 4095, 123):
        qkv.copy_(torch.randn_like(qkv))
        positions.fill_(pos)
        graph.replay()
        q, k, v = views()
        want_q, want_k = rope_layer.rope_qk(q, k, positions, cfg, n_ctx, (w, w), 1e-6)
        assert torch.equal(out_q, want_q)
        assert torch.equal(cache.k[0][pos], want_k[0]) and torch.equal(cache.v[0][pos], v[0])


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


@gpu
@pytest.mark.parametrize("d", [2048, 2880, 4096, 7168])
@pytest.mark.parametrize("rows", [1, 300])
def test_gpu_add_rms_norm_matches_torch(monkeypatch, d: int, rows: int) -> None:
    """The residual add + next norm at the models' n_embd: the add bit for bit, the norm to
    summation order."""
    monkeypatch.setenv("MOESTUDIO_TRITON", "1")
    g = torch.Generator().manual_seed(d + rows)
    h = (torch.randn(rows, d, generator=g) * 4 + 0.5).cuda()
    delta = (torch.randn(rows, d, generator=g) * 3).cuda()
    w = torch.randn(d, generator=g).cuda()
    h_new, x = norm_layer.add_rms_norm(h, delta, w, 1e-6)
    want_h, want_x = _add_norm_ref(h, delta, w, 1e-6)
    assert torch.equal(h_new, want_h)
    _assert_norm_close(x, want_x)


@gpu
@pytest.mark.parametrize("n_tok", [1, 300])
def test_gpu_rope_with_qk_norm_matches_the_two_steps(monkeypatch, n_tok: int) -> None:
    """qwen3moe's (Qwen3-30B-A3B: 32 q heads, 4 kv heads, head_dim 128, NEOX) per-head norms in
    the RoPE launch against norm-then-rope in torch."""
    monkeypatch.setenv("MOESTUDIO_TRITON", "1")
    cfg, n_ctx = GPU_ROPE[0][1], 4096
    q, k, positions = _rope_cases_device("cuda", n_tok, 32, 4, 128, n_ctx, seed=n_tok)
    qw, kw = torch.randn(128, device="cuda"), torch.randn(128, device="cuda")
    got = rope_layer.rope_qk(q, k, positions, cfg, n_ctx, (qw, kw), 1e-6)
    for a, b in zip(got, _rope_norm_ref(q, k, positions, cfg, n_ctx, qw, kw, 1e-6)):
        _assert_norm_close(a, b)


@gpu
def test_gpu_fused_norms_replay_in_a_cuda_graph(monkeypatch) -> None:
    """add_rms_norm and the q/k-normed RoPE captured once, replayed at other positions and
    inputs: the same results as eager runs."""
    monkeypatch.setenv("MOESTUDIO_TRITON", "1")
    cfg, n_ctx = GPU_ROPE[0][1], 4096
    h, delta = torch.randn(1, 2048, device="cuda"), torch.randn(1, 2048, device="cuda")
    w = torch.randn(2048, device="cuda")
    q = torch.randn(1, 32, 128, device="cuda")
    k = torch.randn(1, 4, 128, device="cuda")
    qw, kw = torch.randn(128, device="cuda"), torch.randn(128, device="cuda")
    positions = torch.zeros(1, dtype=torch.long, device="cuda")

    def step():
        return (*norm_layer.add_rms_norm(h, delta, w, 1e-6),
                *rope_layer.rope_qk(q, k, positions, cfg, n_ctx, (qw, kw), 1e-6))

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for pos in (7, 4095, 123):
        for t in (h, delta, q, k):
            t.copy_(torch.randn_like(t))
        positions.fill_(pos)
        graph.replay()
        for got, want in zip(outs, step()):
            assert torch.equal(got, want)
