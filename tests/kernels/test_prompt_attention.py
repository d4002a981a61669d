"""A prompt's attention through torch's fused SDPA (engine.layers.attention.prompt_attention)
against the reference einsum code of `attend`.

- here: SDPA's CPU kernels at small shapes, every variant the families use (the decode
  kernel tests' geometries: GQA groups 1/2/4/8, the sliding window, sinks, MLA's head dims),
  a chunk at the start of the cache and one in the middle, in one launch and in query slices;
- on the GPU (`-m gpu`): the real geometries at a 4,096-token cache with only the
  memory-efficient kernel allowed (it must take every one of them: the math backend would
  hold the scores), against a float64-accumulated reference, within the mask budget plus
  copies of the operands.

The contract: equal to `attend` up to float32 summation order, within the decode kernel tests'
REL_TOL of the output's largest magnitude (their `check`); on the GPU a prompt's query (more
than a decode step's tokens) runs in float16: equal to `attend` over q, k and v rounded to
float16 (the sink exact), up to the output's float16 rounding (HALF_TOL).
"""
from __future__ import annotations

import pytest
import torch

from engine.kernels.decode_attention import MAX_TOKENS, REAL_GEOMETRIES
from engine.layers import attention, precision
from engine.layers.attention import attend, prompt_attention
from tests.kernels.test_decode_attention import GEOMETRIES, check  # the families' variants, the tolerance

HALF_TOL = 2.0 ** -10  # of the output's largest magnitude: a float16 output's rounding, and float32 sums


def case(n_tok, n_head, n_kv, dk, dv, start, sinks, device="cpu", seed=0):
    """q for tokens start..start+n_tok-1 and the filled cache prefix attention reads."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n_tok, n_head, dk, generator=g)
    k = torch.randn(start + n_tok, n_kv, dk, generator=g)
    v = torch.randn(start + n_tok, n_kv, dv, generator=g)
    s = torch.randn(n_head, generator=g) * 2.0 if sinks else None
    positions = torch.arange(start, start + n_tok)
    return tuple(t.to(device) if t is not None else None for t in (q, k, v, positions, s))


@pytest.mark.parametrize("name", GEOMETRIES)
@pytest.mark.parametrize("start", [0, 37])
def test_a_chunk_matches_the_reference(name, start):
    n_head, n_kv, dk, dv, window, sinks = GEOMETRIES[name]
    q, k, v, positions, s = case(24, n_head, n_kv, dk, dv, start, sinks)
    scale = dk ** -0.5
    out = prompt_attention(q, k, v, positions, scale, window, s)
    assert out.dtype == torch.float32
    check(out, attend(q, k, v, positions, scale, window, s))


@pytest.mark.parametrize("name", ["group8-64-window-sinks", "mla-tiny-288-256"])
def test_query_slices_give_the_one_launch_result(monkeypatch, name):
    """A mask budget of a few rows splits the chunk into many launches (one of a single row)."""
    n_head, n_kv, dk, dv, window, sinks = GEOMETRIES[name]
    q, k, v, positions, s = case(21, n_head, n_kv, dk, dv, 30, sinks, seed=1)
    scale = dk ** -0.5
    whole = prompt_attention(q, k, v, positions, scale, window, s)
    group = n_head // n_kv
    width = -(-(k.shape[0] + (s is not None)) // 16) * 16
    for rows in (1, 5):
        monkeypatch.setattr(attention, "MASK_BYTES", rows * group * width * 4)
        check(prompt_attention(q, k, v, positions, scale, window, s), whole)


def test_a_forwards_layers_share_one_mask():
    """Layers of one forward (the same positions tensor, other keys and values) reuse the mask;
    a window, a sink or other positions get their own, and every result stays the reference's."""
    q, k, v, positions, _ = case(16, 8, 2, 64, 64, 9, False, seed=4)
    key = (k.shape[0], 4, 0, False, torch.float32)  # keys, group, window, sink, dtype
    prompt_attention(q, k, v, positions, 0.125)
    mask = attention._MASKS.get(positions, key)
    assert mask is not None
    for seed, window, sinks in ((5, 0, None), (6, 7, None), (7, 0, torch.full((8,), 0.5)), (8, 0, None)):
        q2, k2, v2, _, _ = case(16, 8, 2, 64, 64, 9, False, seed=seed)
        check(prompt_attention(q2, k2, v2, positions, 0.125, window, sinks), attend(q2, k2, v2, positions, 0.125,
                                                                                    window, sinks))
        if seed == 5:
            assert attention._MASKS.get(positions, key) is mask  # reused
    assert attention._MASKS.get(positions, key) is not mask  # rebuilt after the window's and the sink's
    same_values = positions.clone()
    assert attention._MASKS.get(same_values, key) is None
    del positions  # the forward is over: its mask is let go
    assert attention._MASKS._entry is None


def test_the_sink_takes_its_share_of_the_softmax():
    """A large sink leaves almost nothing to the keys; a very negative one changes nothing."""
    q, k, v, positions, _ = case(8, 4, 2, 64, 64, 5, False, seed=2)
    plain = prompt_attention(q, k, v, positions, 0.125)
    assert prompt_attention(q, k, v, positions, 0.125, sinks=torch.full((4,), 60.0)).abs().max() < 1e-6
    check(prompt_attention(q, k, v, positions, 0.125, sinks=torch.full((4,), -60.0)), plain)


def test_a_float64_run_keeps_the_reference_code():
    """The noise-floor run (precision.accumulate_in float64) never takes the fused path."""
    q, k, v, positions, _ = case(12, 8, 2, 64, 64, 3, False, seed=3)
    with precision.accumulate_in(torch.float64):
        wide = attend(q, k, v, positions, 0.125)
    check(prompt_attention(q, k, v, positions, 0.125), wide)


# ------------------------------------------------------------------------------ on the GPU

@pytest.mark.gpu
@pytest.mark.parametrize("name", list(REAL_GEOMETRIES))
@pytest.mark.parametrize("start", [0, 4096 - 256])
def test_real_shapes_run_fused_on_the_gpu(name, start):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    n_head, n_kv, dk, dv, window, sinks = REAL_GEOMETRIES[name]
    q, k, v, positions, s = case(256, n_head, n_kv, dk, dv, start, sinks, device="cuda")
    scale = dk ** -0.5
    with precision.accumulate_in(torch.float64):
        ref = attend(*(t.half().float() for t in (q, k, v)), positions, scale, window, s)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):  # raises where the fused kernel cannot take it
        out = attend(q, k, v, positions, scale, window, s)
    transient = torch.cuda.max_memory_allocated() - before
    assert out.dtype == torch.float32
    err = (out - ref).abs().max().item()
    assert err <= HALF_TOL * ref.abs().max().item(), f"max error {err} vs magnitude {ref.abs().max().item()}"
    # Bounded by the mask budget and copies of the operands, however long the context: the
    # scores ([heads, T, S] float32) are never held.
    operands = 3 * (q.numel() + out.numel()) * 4 + 2 * (k.numel() + v.numel()) * 4
    assert transient <= attention.MASK_BYTES + operands, f"{transient} bytes held"


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gpt-oss-swa"])
def test_a_decode_sized_query_stays_float32_on_the_gpu(name):
    """The float16 route is a prompt's: a query of a decode step's size (where the fused decode
    kernel does not serve it) keeps float32's tolerance."""
    n_head, n_kv, dk, dv, window, sinks = REAL_GEOMETRIES[name]
    q, k, v, positions, s = case(MAX_TOKENS, n_head, n_kv, dk, dv, 300, sinks, device="cuda", seed=5)
    scale = dk ** -0.5
    with precision.accumulate_in(torch.float64):
        ref = attend(q, k, v, positions, scale, window, s)
    check(prompt_attention(q, k, v, positions, scale, window, s), ref)
