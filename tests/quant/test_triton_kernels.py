"""The Triton decode expert kernels against the torch reference (engine.layers.moe.expert_ffn).

Two ways to run:
- here / in CI, without a GPU: Triton's interpreter runs the kernels on CPU tensors, on tiny
  shapes (skipped when Triton is not installed);
- on the GPU machine: `python -m pytest -q -m gpu tests/quant/test_triton_kernels.py` runs the
  compiled kernels at real decode shapes (Qwen3-30B-A3B, gpt-oss-120b) and the hybrid hook.

The contract: activation rounding bit-exact with round_activation, dot products equal to the
float32 reference up to summation order (~1e-5 relative to the output's scale).
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

triton = pytest.importorskip("triton")

from engine.bench import kernels as kb  # noqa: E402
from engine.layers.moe import SILU, SWIGLU_OAI, ExpertTensor, ExpertWeights, expert_ffn  # noqa: E402
from engine.quant import triton_kernels as tk  # noqa: E402
from engine.quant.activation import round_activation  # noqa: E402
from engine.quant.dequant import dequantize  # noqa: E402
from engine.quant.layout import Q6_K_PADDED_BLOCK, dequantize_layout, kernel_layout  # noqa: E402
from engine.synth.randblocks import random_blocks  # noqa: E402

interp = pytest.mark.skipif(not tk.INTERPRETED, reason="interpreter tests run where there is no GPU "
                            "(TRITON_INTERPRET=1 before the kernels are imported)")
gpu = pytest.mark.gpu

REL_TOL = 2e-5  # of the output's largest magnitude: float32 summation order only


# ------------------------------------------------------------------------------ fixtures

def _random_raw(rng: np.random.Generator, qtype: QT, shape: tuple[int, int, int], std: float) -> torch.Tensor:
    if qtype == QT.F16:
        arr = (rng.standard_normal(shape) * std).astype(np.float16).view(np.uint8)
    elif qtype == QT.BF16:
        bits = (rng.standard_normal(shape) * std).astype(np.float32).view(np.uint32) >> 16
        arr = bits.astype(np.uint16).view(np.uint8)
    else:
        arr = random_blocks(rng, qtype, shape, std)
        if qtype == QT.MXFP4:  # random_blocks gives every block one exponent: vary them, so a scale mixed up shows
            blocks = arr.reshape(-1, 17)
            blocks[:, 0] = (blocks[:, 0].astype(np.int16) + rng.integers(-1, 3, blocks.shape[0])).astype(np.uint8)
    return torch.from_numpy(np.ascontiguousarray(arr).reshape(shape[0], shape[1], -1))


def make_weights(qtypes: tuple[QT, QT, QT], n_expert: int, n_embd: int, n_ff: int, activation: str = SILU,
                 bias: bool = False, seed: int = 0) -> ExpertWeights:
    rng = np.random.default_rng(seed)
    shapes = ((n_expert, n_ff, n_embd), (n_expert, n_ff, n_embd), (n_expert, n_embd, n_ff))
    stds = (n_embd ** -0.5, n_embd ** -0.5, n_ff ** -0.5)
    tensors = []
    for qtype, shape, std in zip(qtypes, shapes, stds):
        b = torch.from_numpy(rng.standard_normal((n_expert, shape[1])).astype(np.float32) * 0.1) if bias else None
        tensors.append(ExpertTensor(_random_raw(rng, qtype, shape, std), qtype, shape, b))
    return ExpertWeights(*tensors, activation=activation)


def weights_to(w: ExpertWeights, device) -> ExpertWeights:
    def move(t: ExpertTensor) -> ExpertTensor:
        return ExpertTensor(t.raw, t.qtype, t.shape, t.bias.to(device) if t.bias is not None else None)
    return ExpertWeights(move(w.gate), move(w.up), move(w.down), activation=w.activation)


class Case:
    """A layer step: tokens x, top-k ids/weights, experts in permuted slots of slot buffers, in
    the layout LayerSlots gives them (layout.kernel_layout: Q6_K padded, MXFP4 and Q8_0 planar), or with
    `gguf_layout` as the file holds them."""

    def __init__(self, w: ExpertWeights, n_tok: int, k: int, device, seed: int = 0, gguf_layout: bool = False):
        g = torch.Generator().manual_seed(seed)
        n_expert, n_embd = w.n_expert, w.gate.shape[2]
        self.w = weights_to(w, device)
        self.x = (torch.randn(n_tok, n_embd, generator=g) * 2.0).to(device)
        self.ids = torch.stack([torch.randperm(n_expert, generator=g)[:k] for _ in range(n_tok)]).to(device)
        self.weights = torch.rand(n_tok, k, generator=g).to(device)
        self.perm = torch.randperm(n_expert, generator=g)  # slot -> expert
        slot_of = torch.empty_like(self.perm)
        slot_of[self.perm] = torch.arange(n_expert)
        self.buffers = [(t.raw[self.perm].contiguous() if gguf_layout else kernel_layout(t.raw[self.perm], t.qtype))
                        .to(device) for t in (w.gate, w.up, w.down)]
        tok, pos = torch.nonzero(torch.ones_like(self.ids, dtype=torch.bool), as_tuple=True)
        e = self.ids[tok, pos].cpu()
        order = torch.argsort(slot_of[e], stable=True)  # group pairs by slot, as the hook does
        tok, pos, e = tok.cpu()[order], pos.cpu()[order], e[order]
        i32 = dict(dtype=torch.int32, device=device)
        self.tok, self.pos = tok.to(**i32), pos.to(**i32)
        self.slot, self.exp = slot_of[e].to(**i32), e.to(**i32)
        self.device = device

    def mats(self, e: int):
        return tuple(dequantize_layout(b[int(torch.nonzero(self.perm == e))], t.qtype, t.shape[1:])
                     for b, t in zip(self.buffers, (self.w.gate, self.w.up, self.w.down)))

    def reference(self):
        """h per pair (gate/up + activation) and per_slot [k, T, D] from the torch path."""
        w = self.w
        hs, out = [], torch.zeros(self.ids.shape[1], *self.x.shape, device=self.device)
        for t, j, e in zip(self.tok.tolist(), self.pos.tolist(), self.exp.tolist()):
            gate, up, down = self.mats(e)
            xr = self.x[t:t + 1]
            g = round_activation(xr, w.gate.qtype) @ gate.T
            u = round_activation(xr, w.up.qtype) @ up.T
            if w.gate.bias is not None:
                g, u = g + w.gate.bias[e], u + w.up.bias[e]
            from engine.layers.moe import activate
            hs.append(activate(w.activation, g, u)[0])
            out[j, t] = expert_ffn(xr, gate, up, down, w, e)[0] * self.weights[t, j]
        return torch.stack(hs), out

    def down_reference(self, h: torch.Tensor) -> torch.Tensor:
        """per_slot from a given h (so down is checked on exactly the kernel's h)."""
        w = self.w
        out = torch.zeros(self.ids.shape[1], *self.x.shape, device=self.device)
        for p, (t, j, e) in enumerate(zip(self.tok.tolist(), self.pos.tolist(), self.exp.tolist())):
            down = self.mats(e)[2]
            y = round_activation(h[p:p + 1], w.down.qtype) @ down.T
            if w.down.bias is not None:
                y = y + w.down.bias[e]
            out[j, t] = y[0] * self.weights[t, j]
        return out


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def check_case(case: Case, gate_up_cfg=None, down_cfg=None, tol: float = REL_TOL, whole: bool = True,
               split: tk.SplitK | None = None, down_tile: str | None = None, gate_up_tile: str | None = None) -> dict:
    w = case.w
    h_ref, out_ref = case.reference()
    xg = tk.round_rows(case.x, w.gate.qtype)
    xu = tk.round_rows(case.x, w.up.qtype)
    assert torch.equal(xg.values, round_activation(case.x, w.gate.qtype))
    h, hr = tk.gate_up(xg, xu, case.buffers[0], case.buffers[1], w, case.tok, case.slot, case.exp, gate_up_cfg, split,
                       tile=gate_up_tile)
    assert torch.isfinite(h).all()
    err_h = rel_err(h, h_ref)
    assert err_h < tol, f"gate/up + activation: relative error {err_h:.2e}"
    # The last program of each pair rounded h for the down weights, bit-exactly.
    assert torch.equal(hr.values, round_activation(h, w.down.qtype)), "h rounded in the kernel differs"
    check_q8_k_parts(hr, w.down.qtype)
    out = torch.zeros_like(out_ref)
    tk.down(hr, case.buffers[2], w, case.tok, case.pos, case.slot, case.exp, case.weights, out, down_cfg, down_tile)
    err_d = rel_err(out, case.down_reference(h))
    assert err_d < tol, f"down: relative error {err_d:.2e}"
    # End to end: h's float order may move one rounding step of one activation value (a tie),
    # so the whole path is held to a looser bound than each kernel on identical inputs.
    err_all = rel_err(out, out_ref)
    assert err_all < 1e-3, f"end to end: relative error {err_all:.2e}"
    if not whole:
        return {"h": err_h, "down": err_d, "all": err_all}
    out2 = torch.zeros_like(out_ref)
    tk.experts_forward(case.x, case.buffers, w, case.tok, case.pos, case.slot, case.exp, case.weights, out2,
                       gate_up_cfg, down_cfg, split, down_tile=down_tile, gate_up_tile=gate_up_tile)
    assert torch.equal(out, out2), "experts_forward differs from its parts"
    return {"h": err_h, "down": err_d, "all": err_all}


# ------------------------------------------------------------------------------ rounding

def check_rounding(qtype: QT, x: torch.Tensor) -> None:
    """round_rows is bit-identical to round_activation (rows of two strides), for the decode
    kernels and for the grouped GEMM."""
    rows = torch.stack([x, -x * 0.5])
    wide = torch.zeros(2, x.numel() + 64, device=x.device)
    wide[:, :x.numel()] = rows
    for src in (rows, wide[:, :x.numel()]):
        for grouped in (False, True):
            got = tk.round_rows(src, qtype, grouped=grouped)
            want = round_activation(rows, qtype)
            diff = (got.values != want).sum().item()
            assert torch.equal(got.values, want), f"{qtype.name}: {diff} of {want.numel()} values differ"
            assert (got.padded[:, x.numel():] == 0).all(), "rows are zero-padded to whole K steps"
            check_q8_k_parts(got, qtype, grouped)


def nibble_order_values() -> torch.Tensor:
    """The value (0-31) at each position of a block in the decode kernels' order of MXFP4's
    activation quants: position 4 (4h + l) + b holds nibble b of half h of the block's quant word
    l, that is of byte 4l + 2h + b // 2, its low nibble (that value) for even b, its high one
    (16 on) for odd b."""
    p = torch.arange(32)
    word, b = p // 4, p % 4
    h, l = word // 4, word % 4
    return 4 * l + 2 * h + b // 2 + 16 * (b % 2)


def check_q8_k_parts(r, qtype: QT, grouped: bool = False) -> None:
    """Where the kernels take int8 activations (Q8_K for K-quants, Q8_0 for Q8_0 and MXFP4),
    the quants times their scales are the rounded values (MXFP4's for the decode kernels in
    their nibble order)."""
    T, K = r.values.shape
    quants = r.quants
    if qtype in (QT.Q4_K, QT.Q5_K, QT.Q6_K):
        d = r.scales[:, ::8].repeat_interleave(256, dim=1)
    elif qtype in (QT.Q8_0, QT.MXFP4):
        d = r.scales.repeat_interleave(32, dim=1)
        if qtype == QT.MXFP4 and not grouped:
            quants = quants.view(T, -1, 32)[:, :, torch.argsort(nibble_order_values())].reshape(T, -1)
    else:
        return
    assert (r.padded[:, K:] == 0).all()
    assert torch.equal((d * quants.float())[:, :K], r.values)


def rounding_inputs(K: int, device, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(K, generator=g) * 3.0
    ties = x.clone()
    ties[::7] = 0.0
    ties[5] = -ties.abs().max() * 1.5      # a negative largest value ...
    ties[100] = ties[5].abs()              # ... tied in magnitude by a later positive one
    ties[40:72] = 0.0                      # an all-zero block
    halves = (torch.randint(-100, 100, (K,), generator=g).float() + 0.5) / 127.0  # many exact .5 quants
    halves[::64] = 1.0
    return [t.to(device) for t in (x, ties, halves)]


# ------------------------------------------------------------------------------ interpreter tests

SMALL = tk.TileConfig(128, 4)  # few programs: the interpreter's cost is per program and per op
ROUND_TYPES = [QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q8_0, QT.MXFP4, QT.F16, QT.BF16]


@interp
@pytest.mark.parametrize("qtype", ROUND_TYPES, ids=lambda t: t.name)
def test_interpreter_rounding_is_bit_exact(qtype: QT) -> None:
    K = 512 if qtype in (QT.Q4_K, QT.Q5_K, QT.Q6_K) else 352
    for x in rounding_inputs(K, "cpu"):
        check_rounding(qtype, x)


# (gate, up, down) types and geometry (n_embd, n_ff): tails of K steps and of row tiles included.
INTERP_CASES = {
    "Q4_K": ((QT.Q4_K,) * 3, 512, 256),
    "Q5_K": ((QT.Q5_K,) * 3, 256, 256),
    "Q6_K": ((QT.Q6_K,) * 3, 256, 256),
    "Q8_0": ((QT.Q8_0,) * 3, 352, 96),
    "MXFP4": ((QT.MXFP4,) * 3, 288, 160),
    "F16": ((QT.F16,) * 3, 288, 96),
    "BF16": ((QT.BF16,) * 3, 288, 96),
    "Q4_K-Q4_K-Q6_K": ((QT.Q4_K, QT.Q4_K, QT.Q6_K), 256, 256),
    "Q4_K-Q5_K-Q8_0": ((QT.Q4_K, QT.Q5_K, QT.Q8_0), 256, 256),
    "Q8_0-Q6_K-MXFP4": ((QT.Q8_0, QT.Q6_K, QT.MXFP4), 256, 256),
    "Q6_K-MXFP4-Q4_K": ((QT.Q6_K, QT.MXFP4, QT.Q4_K), 256, 256),  # gate and up rounded apart
}


@interp
@pytest.mark.parametrize("name", list(INTERP_CASES))
def test_interpreter_kernels_match_reference(name: str) -> None:
    qtypes, n_embd, n_ff = INTERP_CASES[name]
    w = make_weights(qtypes, n_expert=6, n_embd=n_embd, n_ff=n_ff, seed=len(name))
    # Where n_ff is 256, two programs share each pair's h (the last one to finish rounds it).
    check_case(Case(w, n_tok=2, k=2, device="cpu", seed=1), SMALL, SMALL, whole=False)


@interp
@pytest.mark.parametrize("name,n_embd,split", [("Q4_K", 512, tk.SplitK(2, 1)), ("Q8_0", 768, tk.SplitK(2, 2)),
                                               ("Q4_K-Q5_K-Q8_0", 768, tk.SplitK(3, 1)), ("F16", 512, tk.SplitK(2, 1))])
def test_interpreter_gate_up_split_over_k(name: str, n_embd: int, split: tk.SplitK) -> None:
    """gate/up with its K steps on several programs (one token's few pairs on a GPU): the last
    program of a row block adds the slices' sums, activates, and the pair's last rounds h."""
    w = make_weights(INTERP_CASES[name][0], n_expert=6, n_embd=n_embd, n_ff=256, seed=11)
    check_case(Case(w, n_tok=2, k=2, device="cpu", seed=4), SMALL, SMALL, split=split)


def laid_out_type(qtype: QT) -> int:
    """The kernel type of a weight's rows in layout.kernel_layout's layout."""
    return tk.LAID_OUT_TYPES.get(qtype, int(qtype))


@interp
@pytest.mark.parametrize("name,split", [("Q4_K", None), ("Q5_K", tk.SplitK(2, 3)), ("Q4_K-Q5_K-Q8_0", tk.SplitK(3, 2)),
                                        ("Q6_K", None), ("Q6_K-MXFP4-Q4_K", tk.SplitK(2, 3)),
                                        ("MXFP4", tk.SplitK(3, 2))])
def test_interpreter_one_token_gate_up_with_lanes_along_k(name: str, split: tk.SplitK | None) -> None:
    """One token's Q4_K / Q5_K / Q6_K / MXFP4 gate/up takes the lanes-along-K kernel (four K steps
    an access): 5 steps are a whole group and a partial one, or slices of 3 and 2 (2, 2 and 1) steps."""
    qtypes = INTERP_CASES[name][0]
    assert tk.expert_tile(laid_out_type(qtypes[0]), laid_out_type(qtypes[1]), 1) == "row"
    w = make_weights(qtypes, n_expert=6, n_embd=1280, n_ff=256, seed=12)
    check_case(Case(w, n_tok=1, k=3, device="cpu", seed=6), tk.TileConfig(64, 4), SMALL, split=split)


@interp
@pytest.mark.parametrize("split", [None, tk.SplitK(2, 3)], ids=["unsplit", "split"])
def test_interpreter_one_token_gpt_oss_gate_up_with_lanes_along_k(split: tk.SplitK | None) -> None:
    """gpt-oss's one-token gate/up in the lanes-along-K kernel: MXFP4 rows of a partial last K step
    (45 blocks: five whole steps and one of 5 blocks), biases, SWIGLU_OAI."""
    assert tk.expert_tile(tk.MXFP4_PLANAR, tk.MXFP4_PLANAR, 1) == "row"
    w = make_weights((QT.MXFP4,) * 3, n_expert=5, n_embd=1440, n_ff=192, activation=SWIGLU_OAI, bias=True, seed=13)
    check_case(Case(w, n_tok=1, k=3, device="cpu", seed=7), tk.TileConfig(64, 4), SMALL, split=split)


@interp
@pytest.mark.parametrize("n_embd,split", [(1280, None), (1440, tk.SplitK(2, 3))], ids=["unsplit", "partial-split"])
def test_interpreter_planar_q8_0_gate_up_with_lanes_along_k(n_embd: int, split: tk.SplitK | None) -> None:
    """One token's planar Q8_0 gate/up in the lanes-along-K tile (a lane a 32-byte block, eight a
    K step): five K steps (a group of four and one), and 1440 (a partial last step of 5 blocks)
    split in slices of 3 and 2 steps."""
    assert tk.expert_tile(tk.Q8_0_PLANAR, tk.Q8_0_PLANAR, 1) == "row"
    w = make_weights((QT.Q8_0,) * 3, n_expert=5, n_embd=n_embd, n_ff=192, seed=18)
    check_case(Case(w, n_tok=1, k=3, device="cpu", seed=12), tk.TileConfig(64, 4), SMALL, split=split)


def test_expert_step_defaults_by_type_and_tokens() -> None:
    """Gate/up in the row tile takes its rows in turns, a pair a program, at any number of tokens.
    One token: every type the row tiles read takes them; 2-8 tokens: planar Q8_0 and padded Q6_K take
    both row tiles (down in runs of RUN_GROUP pairs), planar MXFP4 gate/up's row tile and down's
    quantized tile (under a register cap), Q4_K and Q5_K the quantized tiles (Q4_K's gate/up under the
    cap too); past RUN_MAX_TOKENS every type the quantized tiles."""
    q8, k4, k5, q6, mx = tk.Q8_0_PLANAR, int(QT.Q4_K), int(QT.Q5_K), tk.Q6_K_PADDED, tk.MXFP4_PLANAR
    for q in (q8, k4, q6, mx):
        assert tk.gate_up_config(tk.expert_tile(q, q, 1), q, q, 768) == tk.GATE_UP_ROW_IN_TURNS
    assert tk.run_group("row", tk.GATE_UP_ROW_IN_TURNS, 4) == 1
    assert tk.down_config(tk.expert_down_tile(mx, 1), mx) == tk.DOWN_BY_TYPE[("row", mx)] == tk.TileConfig(4, 2)
    assert tk.down_config(tk.expert_down_tile(q8, 1), q8) == tk.DOWN_CONFIG["row"]
    for tokens in (2, 4, tk.RUN_MAX_TOKENS):
        for q in (q8, q6):
            assert (tk.expert_tile(q, q, tokens), tk.expert_down_tile(q, tokens)) == ("row", "row")
            assert tk.run_group("row", tk.down_config("row", q), tokens) == tk.RUN_GROUP == 2
        assert (tk.expert_tile(mx, mx, tokens), tk.expert_down_tile(mx, tokens)) == ("row", "tile")
        for q in (k4, k5):
            assert (tk.expert_tile(q, q, tokens), tk.expert_down_tile(q, tokens)) == ("tile", "tile")
    assert tk.gate_up_config("tile", mx, mx, 2880).maxnreg == tk.down_config("tile", mx).maxnreg == 128
    assert tk.gate_up_config("tile", k4, k4, 768) == tk.TileConfig(32, 2, maxnreg=128)  # the same registers
    assert tk.gate_up_config("tile", k5, k5, 768) == tk.GATE_UP_CONFIG["tile"]
    assert tk.gate_up_config("tile", mx, k4, 768) == tk.GATE_UP_CONFIG["tile"]  # one type for both
    assert tk.gate_up_config("row", q8, q8, 767) == tk.GATE_UP_CONFIG["row"]  # rows that turns cannot halve
    for q in (q8, q6, mx):
        assert tk.expert_tile(q, q, tk.RUN_MAX_TOKENS + 1) == tk.expert_down_tile(q, tk.RUN_MAX_TOKENS + 1) == "tile"
    assert tk.expert_tile(q8, k4, 2) == "tile"  # several tokens: both of gate and up of those types only
    # the one-launch step keeps down's rows a warp on gate/up's warps: MXFP4's down row, 2 a warp, 8 on 4
    assert tk.step_down_config("row", mx, 4) == tk.TileConfig(8, 4)
    assert tk.step_down_config("row", q8, 4) == tk.TileConfig(4, 4)


def test_row_tiles_take_their_types_in_their_layout() -> None:
    w = make_weights((QT.Q8_0,) * 3, n_expert=2, n_embd=256, n_ff=96, seed=1)
    case = Case(w, n_tok=1, k=1, device="cpu", gguf_layout=True)  # Q8_0 as the file holds it, not planar
    x = tk.Rounded.empty(1, 256, torch.device("cpu"))  # refused before any launch
    with pytest.raises(ValueError, match="row tile of gate/up"):
        tk.gate_up(x, x, case.buffers[0], case.buffers[1], case.w, case.tok, case.slot, case.exp, tile="row")
    with pytest.raises(ValueError, match="row tile of down"):
        tk.down(tk.Rounded.empty(1, 96, "cpu"), case.buffers[2], case.w, case.tok, case.pos, case.slot, case.exp,
                case.weights, torch.zeros(1, *case.x.shape), tile="row")


@interp
@pytest.mark.parametrize("qtypes,n_embd,n_ff,cfg,split", [
    ((QT.Q4_K,) * 3, 1280, 256, tk.TileConfig(64, 4, passes=2), None),
    ((QT.Q6_K,) * 3, 768, 256, tk.TileConfig(64, 4, passes=4), tk.SplitK(2, 2)),
    ((QT.MXFP4,) * 3, 1440, 192, tk.TileConfig(128, 4, passes=2), None)], ids=["Q4_K-2", "Q6_K-4-split", "gpt-oss-2"])
def test_interpreter_gate_up_rows_in_turns(qtypes, n_embd: int, n_ff: int, cfg: tk.TileConfig,
                                           split: tk.SplitK | None) -> None:
    """The row tile's rows taken in turns (each turn's last K steps loaded with the next turn's
    first) give the reference's h, rounded bit-exactly, and the bits of the same rows at once: five
    K steps (a group and a partial one), three split in slices of 2 and 1, gpt-oss's partial last
    step and biases, and a last row block partly past the end (192 rows in blocks of 128)."""
    gpt_oss = qtypes[0] == QT.MXFP4
    w = make_weights(qtypes, n_expert=5, n_embd=n_embd, n_ff=n_ff, activation=SWIGLU_OAI if gpt_oss else SILU,
                     bias=gpt_oss, seed=17)
    check_turns(Case(w, n_tok=1, k=2, device="cpu", seed=11), cfg, SMALL, split)


def check_turns(case: Case, cfg: tk.TileConfig, down_cfg: tk.TileConfig, split: tk.SplitK | None = None) -> None:
    """gate/up's row tile with its rows in turns (cfg.passes) against the reference, and bit for bit
    against the same rows at once."""
    check_case(case, cfg, down_cfg, whole=False, split=split)
    w = case.w
    xg, xu = tk.round_inputs(case.x, w)
    at_once = replace(cfg, passes=1)
    h, hr = tk.gate_up(xg, xu, case.buffers[0], case.buffers[1], w, case.tok, case.slot, case.exp, cfg, split)
    h1, hr1 = tk.gate_up(xg, xu, case.buffers[0], case.buffers[1], w, case.tok, case.slot, case.exp, at_once, split)
    assert torch.equal(h, h1) and torch.equal(hr.padded, hr1.padded) and torch.equal(hr.quants, hr1.quants)


def test_only_the_row_tile_takes_turns_of_whole_rows() -> None:
    w = make_weights((QT.Q4_K, QT.Q4_K, QT.MXFP4), n_expert=2, n_embd=256, n_ff=96, seed=1)
    case = Case(w, n_tok=1, k=1, device="cpu")
    # two tokens of Q4_K take the quantized tile; 96 rows are no whole number of turns of 64
    for cfg, tokens in ((tk.TileConfig(64, 4, passes=2), 2), (tk.TileConfig(64, 4, passes=64), 1)):
        x = tk.Rounded.empty(tokens, 256, torch.device("cpu"))  # refused before any launch
        with pytest.raises(ValueError, match="turns"):
            tk.gate_up(x, x, case.buffers[0], case.buffers[1], case.w, case.tok, case.slot, case.exp, cfg)


@interp
@pytest.mark.parametrize("qtypes,n_ff,split", [((QT.Q4_K,) * 3, 768, None),
                                              ((QT.Q8_0, QT.Q8_0, QT.MXFP4), 640, tk.SplitK(2, 1))],
                         ids=["Q4_K", "MXFP4-down-split"])
def test_interpreter_h_is_rounded_a_k_step_at_a_time(qtypes, n_ff: int, split: tk.SplitK | None) -> None:
    """h of several K steps of the down product (768: three; 640: the third partial): the last
    program to finish of each step's row blocks (4, 4 and 4 or 2 tiles of 64 rows) rounds that
    step, bit-exactly (check_case compares every rounded value)."""
    w = make_weights(qtypes, n_expert=4, n_embd=256, n_ff=n_ff, seed=14)
    check_case(Case(w, n_tok=2, k=2, device="cpu", seed=8), tk.TileConfig(64, 4), SMALL, whole=False, split=split)


@interp
@pytest.mark.parametrize("qtypes,n_embd,n_ff", [
    ((QT.Q4_K,) * 3, 256, 1280), ((QT.Q5_K,) * 3, 256, 768), ((QT.Q4_K, QT.Q4_K, QT.Q6_K), 256, 1280),
    ((QT.MXFP4,) * 3, 256, 1440), ((QT.Q4_K,) * 3, 256, 768), ((QT.Q4_K, QT.Q4_K, QT.Q6_K), 256, 512),
    ((QT.MXFP4,) * 3, 288, 736), ((QT.Q8_0,) * 3, 256, 1280), ((QT.Q8_0,) * 3, 288, 736)],
    ids=["Q4_K", "Q5_K", "Q6_K", "MXFP4", "Q4_K-3", "Q6_K-2", "MXFP4-3", "Q8_0", "Q8_0-3"])
def test_interpreter_one_token_down_with_lanes_along_k(qtypes, n_embd: int, n_ff: int) -> None:
    """down in the lanes-along-K tile ("row", _down_k4_kernel): h of five K steps (a group of four
    and a partial one), and gpt-oss's 1440 (a partial last step; biases, SWIGLU_OAI); and under four
    steps, where each eight lanes take rows of their own: three steps, two, and a partial third over
    288 rows (the last program's rows partly past the end)."""
    gpt_oss = qtypes[2] == QT.MXFP4
    w = make_weights(qtypes, n_expert=5, n_embd=n_embd, n_ff=n_ff, activation=SWIGLU_OAI if gpt_oss else SILU,
                     bias=gpt_oss, seed=16)
    check_case(Case(w, n_tok=1, k=3, device="cpu", seed=10), SMALL, tk.TileConfig(64, 4), down_tile="row")


def row_tiles(case: Case, gate_up_cfg: tk.TileConfig, down_cfg: tk.TileConfig,
              split: tk.SplitK | None = None) -> tuple[torch.Tensor, ...]:
    """h, its rounding and down's output of the case in both row tiles."""
    w = case.w
    xg, xu = tk.round_inputs(case.x, w)
    h, hr = tk.gate_up(xg, xu, case.buffers[0], case.buffers[1], w, case.tok, case.slot, case.exp, gate_up_cfg,
                       split, tile="row")
    out = torch.zeros(case.ids.shape[1], *case.x.shape, device=case.device)
    tk.down(hr, case.buffers[2], w, case.tok, case.pos, case.slot, case.exp, case.weights, out, down_cfg, "row")
    return h, hr.values, out


def check_down_configs(case: Case, cfgs: list[tk.TileConfig]) -> None:
    """down's row tile in each of `cfgs` (on an h of its own, rounded as gate/up rounds it) against
    the reference, and bit for bit against its default config: a row's sum does not depend on the
    rows a program takes."""
    w = case.w
    rng = np.random.default_rng(len(cfgs))
    h = torch.from_numpy(rng.standard_normal((case.tok.numel(), w.down.shape[2])).astype(np.float32)).to(case.device)
    hr = tk.round_rows(h, w.down.qtype)
    want = case.down_reference(h)
    outs = []
    for cfg in [None, *cfgs]:
        outs.append(torch.zeros(case.ids.shape[1], *case.x.shape, device=case.device))
        tk.down(hr, case.buffers[2], w, case.tok, case.pos, case.slot, case.exp, case.weights, outs[-1], cfg, "row")
        assert rel_err(outs[-1], want) < REL_TOL, cfg
        assert torch.equal(outs[-1], outs[0]), f"down in {cfg} differs from its default config"


@interp
def test_interpreter_down_row_tile_in_the_configs_the_sweep_times() -> None:
    """down's row tile in every BLOCK_N `bench kernels --sweep` times (the interpreter runs no warps),
    one token: 256 values a row (eight lanes a row) and gpt-oss's 1440 (a warp a row, a partial step)."""
    block_ns = sorted({block_n for block_n, _ in kb.DOWN_ROW_SWEEP})
    for qtype, n_embd, n_ff in ((QT.Q4_K, 256, 256), (QT.MXFP4, 64, 1440)):
        w = make_weights((qtype,) * 3, n_expert=2, n_embd=n_embd, n_ff=n_ff, seed=22,
                         activation=SWIGLU_OAI if qtype == QT.MXFP4 else SILU, bias=qtype == QT.MXFP4)
        check_down_configs(Case(w, n_tok=1, k=1, device="cpu", seed=22), [tk.TileConfig(b, 1) for b in block_ns])


def check_runs(case: Case, monkeypatch, gate_up_cfg: tk.TileConfig, down_cfg: tk.TileConfig,
               split: tk.SplitK | None = None) -> None:
    """The row tiles over several tokens, a program a run of pairs of one slot (at most the
    configs' `group`), give the bits of a program a pair (RUN_MAX_TOKENS 1)."""
    tokens = case.x.shape[0]
    for cfg in (gate_up_cfg, down_cfg):
        assert tk.run_group("row", cfg, tokens) == min(tokens, cfg.group) > 1
    runs = row_tiles(case, gate_up_cfg, down_cfg, split)
    with monkeypatch.context() as m:
        m.setattr(tk, "RUN_MAX_TOKENS", 1)
        assert tk.run_group("row", gate_up_cfg, tokens) == 1
        pairs = row_tiles(case, gate_up_cfg, down_cfg, split)
    for got, want in zip(runs, pairs):
        assert torch.equal(got, want), f"a run program differs: {(got.float() - want.float()).abs().max():.3e}"


@interp
@pytest.mark.parametrize("qtypes,n_embd,n_ff,n_tok,split", [
    ((QT.Q4_K,) * 3, 512, 256, 8, None), ((QT.Q6_K, QT.Q6_K, QT.Q4_K), 512, 512, 2, tk.SplitK(2, 1)),
    ((QT.MXFP4,) * 3, 1440, 192, 3, None), ((QT.Q8_0, QT.Q8_0, QT.Q5_K), 256, 1024, 4, None)],
    ids=["Q4_K-8", "Q6_K-2-split", "gpt-oss-3", "Q8_0-4"])
def test_interpreter_row_tiles_over_several_tokens_take_a_slot_run_a_program(monkeypatch, qtypes, n_embd: int,
                                                                            n_ff: int, n_tok: int, split) -> None:
    """Over 2-8 tokens the row tiles' programs each serve a run of pairs of one slot (6 experts,
    top-3: runs of up to n_tok pairs), against the reference and bit for bit against a program
    a pair: gate/up's K in one, two (split 1 + 1) and six steps (gpt-oss's: the last partial,
    biases), down's in one, two and four."""
    gpt_oss = qtypes[0] == QT.MXFP4
    w = make_weights(qtypes, n_expert=6, n_embd=n_embd, n_ff=n_ff, activation=SWIGLU_OAI if gpt_oss else SILU,
                     bias=gpt_oss, seed=19)
    case = Case(w, n_tok=n_tok, k=3, device="cpu", seed=13)
    whole = replace(SMALL, group=tk.RUN_MAX_TOKENS)  # runs uncut (the default cuts them at RUN_GROUP)
    check_case(case, whole, whole, split=split, gate_up_tile="row", down_tile="row")
    check_runs(case, monkeypatch, whole, whole, split)


@interp
def test_interpreter_runs_of_at_most_a_config_s_group(monkeypatch) -> None:
    """Runs cut at the configs' `group` pairs a program (fewer accumulators live; --sweep's "runs
    of N"): 8 tokens' pairs in programs of at most 3, cuts inside runs, give a program a pair's bits."""
    w = make_weights((QT.Q4_K,) * 3, n_expert=6, n_embd=512, n_ff=256, seed=19)
    case = Case(w, n_tok=8, k=3, device="cpu", seed=13)
    assert max(torch.unique_consecutive(case.slot, return_counts=True)[1].tolist()) > 3  # a run to cut
    cfg = replace(SMALL, group=3)
    check_runs(case, monkeypatch, cfg, cfg)


@interp
@pytest.mark.parametrize("qtype", [QT.Q6_K, QT.MXFP4], ids=lambda t: t.name)
def test_interpreter_several_tokens_gate_up_takes_turns_by_default(qtype: QT) -> None:
    """Over 2-8 tokens padded Q6_K's and planar MXFP4's gate/up take the row tile in turns by default
    (a pair a program; down in its own default tile: Q6_K's row runs, MXFP4's quantized tile): the
    reference's results (gpt-oss's biases and SWIGLU_OAI for MXFP4; the turns' rows a program raised
    from 8 to 32, a quarter of the interpreter's programs)."""
    gpt_oss = qtype == QT.MXFP4
    w = make_weights((qtype,) * 3, n_expert=4, n_embd=256, n_ff=256, activation=SWIGLU_OAI if gpt_oss else SILU,
                     bias=gpt_oss, seed=21)
    q = laid_out_type(qtype)
    assert tk.expert_tile(q, q, 2) == "row" and tk.gate_up_config("row", q, q, 256) == tk.GATE_UP_ROW_IN_TURNS
    check_case(Case(w, n_tok=2, k=2, device="cpu", seed=16), replace(tk.GATE_UP_ROW_IN_TURNS, block_n=32),
               whole=False)


@interp
def test_interpreter_a_run_longer_than_its_tokens_is_cut_every_group(monkeypatch) -> None:
    """Five pairs of one slot over two tokens (no routing makes them; the kernels must still take
    every pair): programs lead at pairs 0, 2 and 4, each with what follows up to the next; and
    pairs out of slot order, whose runs are shorter."""
    w = make_weights((QT.Q4_K,) * 3, n_expert=3, n_embd=512, n_ff=256, seed=20)
    case = Case(w, n_tok=2, k=3, device="cpu", seed=14)
    keep = torch.arange(5)
    case.tok, case.pos = case.tok[keep].contiguous(), case.pos[keep].contiguous()
    case.slot, case.exp = case.slot[:1].repeat(5), case.exp[:1].repeat(5)
    check_runs(case, monkeypatch, SMALL, SMALL)
    # and against the reference, pair by pair
    h = row_tiles(case, SMALL, SMALL)[0]
    gate, up, _ = case.mats(int(case.exp[0]))
    for p, t in enumerate(case.tok.tolist()):
        xr = case.x[t:t + 1]
        g = round_activation(xr, QT.Q4_K) @ gate.T
        u = round_activation(xr, QT.Q4_K) @ up.T
        assert rel_err(h[p], torch.nn.functional.silu(g[0]) * u[0]) < REL_TOL
    shuffled = Case(w, n_tok=2, k=3, device="cpu", seed=15)
    order = torch.tensor([3, 0, 5, 1, 4, 2])
    shuffled.tok, shuffled.pos, shuffled.slot, shuffled.exp = (
        t[order].contiguous() for t in (shuffled.tok, shuffled.pos, shuffled.slot, shuffled.exp))
    check_runs(shuffled, monkeypatch, SMALL, SMALL)


def test_gate_up_tiles_must_divide_a_k_step() -> None:
    w = make_weights((QT.Q8_0,) * 3, n_expert=2, n_embd=256, n_ff=96, seed=1)
    case = Case(w, n_tok=1, k=1, device="cpu")
    x = tk.Rounded.empty(1, 256, torch.device("cpu"))  # refused before any launch
    with pytest.raises(ValueError, match="divide a K step"):
        tk.gate_up(x, x, case.buffers[0], case.buffers[1], case.w, case.tok, case.slot, case.exp, tk.TileConfig(48, 2))


@interp
def test_interpreter_gpt_oss_gate_up_split_with_biases() -> None:
    w = make_weights((QT.MXFP4,) * 3, n_expert=5, n_embd=576, n_ff=192, activation=SWIGLU_OAI, bias=True, seed=3)
    check_case(Case(w, n_tok=1, k=3, device="cpu", seed=2), SMALL, SMALL, whole=False, split=tk.SplitK(3, 1))


@interp
@pytest.mark.parametrize("name,laid_out,gguf", [("Q4_K-Q4_K-Q6_K", Q6_K_PADDED_BLOCK, 210), ("MXFP4", 144, 136),
                                               ("Q8_0", 288, 272)])
def test_interpreter_kernels_read_experts_in_either_layout(name: str, laid_out: int, gguf: int) -> None:
    """Slot buffers hold Q6_K padded, MXFP4 and Q8_0 planar (LayerSlots); the kernels still read
    the GGUF layout."""
    qtypes, n_embd, n_ff = INTERP_CASES[name]
    w = make_weights(qtypes, n_expert=4, n_embd=n_embd, n_ff=256, seed=9)
    slots = Case(w, n_tok=1, k=2, device="cpu", seed=3)
    file = Case(w, n_tok=1, k=2, device="cpu", seed=3, gguf_layout=True)
    assert slots.buffers[2].shape[-1] == laid_out and file.buffers[2].shape[-1] == gguf
    check_case(file, SMALL, SMALL, whole=False)


@interp
def test_interpreter_gpt_oss_swiglu_with_biases() -> None:
    w = make_weights((QT.MXFP4,) * 3, n_expert=5, n_embd=320, n_ff=192, activation=SWIGLU_OAI, bias=True, seed=3)
    check_case(Case(w, n_tok=2, k=3, device="cpu", seed=2), SMALL, tk.TileConfig(128, 4), whole=False)


@interp
def test_interpreter_shared_experts_and_partial_tiles() -> None:
    # 3 tokens x top-4 of 5 experts: most experts serve several pairs; 96 rows in tiles of 64.
    w = make_weights((QT.Q8_0,) * 3, n_expert=5, n_embd=96, n_ff=64, seed=4)
    check_case(Case(w, n_tok=3, k=4, device="cpu", seed=5), tk.TileConfig(64, 4), tk.TileConfig(64, 4))


@interp
def test_interpreter_pairs_without_a_slot_do_nothing_and_a_second_launch_fills_them() -> None:
    """The decode graph's two launches over one token's pairs (engine/moe/token_step.py): pairs
    marked without a slot (< 0) leave their rows as they were (the programs end before reading
    a byte, split over K or not, in three launches or one); a second launch over other buffers
    (the mapped route: the experts' GGUF rows in host memory, expert ids as slots) writes exactly
    those rows."""
    w = make_weights((QT.Q4_K, QT.Q4_K, QT.Q6_K), n_expert=4, n_embd=256, n_ff=256, seed=6)
    case = Case(w, n_tok=1, k=3, device="cpu", seed=1)
    _, want = case.reference()
    kept = torch.tensor([True, False, True])[case.pos.long()]  # top-k position 1 is "missed"
    rounded = tk.round_inputs(case.x, case.w)  # both launches share x's rounding, as the token step does
    for split, one_launch in ((tk.SplitK(1, 1), False), (None, False), (None, True)):
        out = torch.full_like(want, 7.0)
        slot = torch.where(kept, case.slot, torch.full_like(case.slot, -1))
        tk.experts_forward(case.x, case.buffers, case.w, case.tok, case.pos, slot, case.exp, case.weights, out,
                           SMALL, SMALL, split, rounded=rounded, one_launch=one_launch)
        assert (out[1] == 7.0).all(), "a pair without a slot wrote its row"
        assert rel_err(out[[0, 2]], want[[0, 2]]) < 1e-3
        # the missed pair from the experts as the file holds them, by expert id
        host = [t.raw for t in (w.gate, w.up, w.down)]
        mapped = torch.where(kept, torch.full_like(case.exp, -1), case.exp)
        tk.experts_forward(case.x, host, case.w, case.tok, case.pos, mapped, mapped, case.weights, out, SMALL,
                           SMALL, split, rounded=rounded)
        assert rel_err(out, want) < 1e-3


ONE_LAUNCH_CASES = {
    # one token, lanes along K (rows in two turns), x rounded for gate and up apart, split over K,
    # h of two K steps; down in the quantized tile
    "row Q6_K-MXFP4-Q4_K": ((QT.Q6_K, QT.MXFP4, QT.Q4_K), 1280, 512, 1, tk.TileConfig(64, 4, passes=2),
                            tk.SplitK(2, 3), "tile", SMALL),
    # gpt-oss: a partial last K step, biases, SWIGLU_OAI; down in the row tile (one token's default)
    "row gpt-oss": ((QT.MXFP4,) * 3, 1440, 192, 1, tk.TileConfig(64, 4), None, "row", tk.TileConfig(64, 4)),
    # two tokens in the quantized tile, split; the MXFP4 down's h a partial third K step
    "tile Q8_0-Q6_K-MXFP4": ((QT.Q8_0, QT.Q6_K, QT.MXFP4), 256, 640, 2, SMALL, tk.SplitK(2, 1), "tile", SMALL),
    "tile F16": ((QT.F16,) * 3, 288, 96, 2, SMALL, None, "tile", SMALL),
}


def default_down_tile(case: Case) -> str:
    """The down tile experts_forward takes for this case by default."""
    w = case.w
    return tk.expert_down_tile(tk.kernel_type(w.down.qtype, case.buffers[2], w.down.shape[2]), case.x.shape[0])


def check_one_launch(case: Case, gate_up_cfg: tk.TileConfig | None, down_cfg: tk.TileConfig | None,
                     split: tk.SplitK | None, down_tile: str, rounded: bool = False) -> None:
    """experts_forward(one_launch=True) writes what the three launches write with the same tiles,
    bit for bit, and leaves its state ready for the next launch: the epoch one on, no program
    counted, no wait timed out."""
    w = case.w
    want = torch.full((case.ids.shape[1], *case.x.shape), 7.0, device=case.device)
    got = want.clone()
    args = (case.x, case.buffers, w, case.tok, case.pos, case.slot, case.exp, case.weights)
    tk.experts_forward(*args, want, gate_up_cfg, down_cfg, split, down_tile=down_tile)
    state = tk._step_state(case.x.device, 0)
    epoch = int(state[0])
    tk.experts_forward(*args, got, gate_up_cfg, down_cfg, split, one_launch=True, down_tile=down_tile,
                       rounded=tk.round_inputs(case.x, w) if rounded else None)
    assert torch.equal(got, want), f"one launch differs from three: {(got - want).abs().max():.3e}"
    assert int(state[0]) == epoch + 1 and int(state[1]) == 0
    assert not tk.step_timed_out(case.x.device)


@interp
@pytest.mark.parametrize("name", list(ONE_LAUNCH_CASES))
def test_interpreter_one_launch_step_equals_three_launches(name: str) -> None:
    """The step as one grid (round x, gate/up, down; each waiting on flags the programs before it
    publish) against its three launches; a pair without a slot stays untouched in both; where the
    case is cheap, a second launch on other x over x rounded before (no rounding programs)."""
    qtypes, n_embd, n_ff, n_tok, cfg, split, down_tile, down_cfg = ONE_LAUNCH_CASES[name]
    gpt_oss = qtypes[0] == QT.MXFP4
    w = make_weights(qtypes, n_expert=5, n_embd=n_embd, n_ff=n_ff, activation=SWIGLU_OAI if gpt_oss else SILU,
                     bias=gpt_oss, seed=15)
    case = Case(w, n_tok=n_tok, k=3, device="cpu", seed=9)
    case.slot[1] = -1
    check_one_launch(case, cfg, down_cfg, split, down_tile)
    if n_embd * n_ff <= 1440 * 192:
        case.x = -0.5 * case.x
        check_one_launch(case, cfg, down_cfg, split, down_tile, rounded=True)


def test_one_launch_takes_one_num_warps() -> None:
    w = make_weights((QT.Q8_0,) * 3, n_expert=2, n_embd=256, n_ff=96, seed=1)
    case = Case(w, n_tok=1, k=1, device="cpu")
    out = torch.zeros(1, *case.x.shape)
    with pytest.raises(ValueError, match="one num_warps"):
        tk.experts_forward(case.x, case.buffers, case.w, case.tok, case.pos, case.slot, case.exp, case.weights, out,
                           tk.TileConfig(32, 2), tk.TileConfig(64, 4), one_launch=True)


@pytest.fixture(scope="module")
def aot_report():
    """engine.quant.triton_aot run in a subprocess (the kernels here may be imported for the
    interpreter, which cannot compile): every launch of every standard geometry, for sm_90. With
    TRITON_DEFAULT_FP_FUSION unset, so that the engine's own setting (engine/__init__.py) is what
    compiles them, and Triton's warning that its default is in use (3.9) an error."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_DEFAULT_FP_FUSION")}
    proc = subprocess.run([sys.executable, "-W", "error:TRITON_DEFAULT_FP_FUSION is unset:UserWarning",
                           "-m", "engine.quant.triton_aot", "--json"], capture_output=True, text=True, env=env,
                          timeout=900)
    unfit = "ptxas" in proc.stderr or "backend" in proc.stderr.lower()
    if proc.returncode != 0 and unfit and "TRITON_DEFAULT_FP_FUSION" not in proc.stderr:
        pytest.skip(f"this Triton cannot compile for CUDA here: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not tk.available(), reason="needs Triton")
def test_kernels_compile_for_hopper_without_spills(aot_report) -> None:
    """Every launch compiles for sm_90 (no GPU needed: Triton ships ptxas); the K loops move
    nothing through shared memory, wait at no barrier and spill (next to) nothing; multiply-adds
    fused (FFMA), as the kernels were measured, whatever Triton's default."""
    from engine.quant.triton_aot import STANDARD_GEOMETRIES

    experts = [r for r in aot_report if not r["kernel"].startswith("dense")]
    assert {r["geometry"] for r in experts} == set(STANDARD_GEOMETRIES)
    assert any(r["kernel"] == "gate_up s1" for r in experts) and any(
        r["kernel"].startswith("gate_up s") and r["kernel"] != "gate_up s1" for r in experts)  # both variants
    for r in experts:
        where = f"{r['geometry']} {r['kernel']}"
        assert r["spill_ops"] <= 16 and r["loop_spill_ops"] <= 8, f"{where} spills: {r}"
        if r["kernel"] == "round_x":
            continue
        assert r["ffma"] > 0, f"{where}: no fused multiply-add: {r}"
        if r["kernel"].startswith("step"):
            # the one-launch step: its parts' K loops and the spin loops of its waits, which
            # threads may run apart, so none of them may hold a barrier
            assert r["loop_smem_or_barrier"] == 0, f"{where}: shared memory or barriers in a loop: {r}"
            continue
        # one K loop, one a turn for rows in turns (label "t2" and up); a split over K (label "s2"
        # and up) also loops over the slices' partial sums once, at the end, in a few instructions
        split = r["kernel"].startswith("gate_up s") and r["kernel"] != "gate_up s1"
        turns = next((int(w[1:]) for w in r["kernel"].split() if w[0] == "t" and w[1:].isdigit()), 1)
        loops = [n for n in r["loop_instructions"] if not split or n >= 64]
        assert len(loops) <= turns, f"{where}: {turns} K loops expected, {r['loop_instructions']}"
        assert r["loop_smem_or_barrier"] == 0, f"{where}: shared memory or barriers in the K loop: {r}"
        if not r["loop_instructions"]:  # a short loop the compiler unrolled: barriers only at the end
            assert r["bar_sync"] <= 2, f"{where}: {r['bar_sync']} barriers"
        if r["geometry"] in ("Q4_K", "Q5_K", "Q6_K", "Q4_K_M", "Q8_0"):
            # whole 16-byte loads of the weights (Q6_K: the slots' padded blocks; Q8_0: planar)
            loads = _by_width(r["loads"])
            narrow = {op: n for op, n in loads.items() if op in ("LDG.E.U8", "LDG.E.U16", "LDG.E.S16")}
            assert loads.get("LDG.E.128", 0) > 0 and not narrow, f"{where}: {r['loads']}"


def _by_width(loads: dict[str, int]) -> Counter:
    """A kernel's global loads by width, whatever their eviction hint (weights load evict-first: .EF)."""
    out = Counter()
    for op, n in loads.items():
        out[op.replace(".EF", "")] += n
    return out


@pytest.mark.slow
@pytest.mark.skipif(not tk.available(), reason="needs Triton")
def test_dense_kernel_compiles_for_hopper_without_spills(aot_report) -> None:
    """The split-K dense products compile for sm_90 for every type, split and unsplit, at one
    and at eight rows without spills; the one-row K loops move nothing through shared memory (16-bit
    weights at several rows multiply on tensor cores, their steps staged there)."""
    from engine.quant.triton_aot import DENSE_GEOMETRIES, DENSE_ROWS

    dense = [r for r in aot_report if r["kernel"].startswith("dense")]
    types = [t.name for t in tk.KERNEL_TYPES] + [f"Q6_K/{Q6_K_PADDED_BLOCK}", "MXFP4/planar", "Q8_0/planar"]
    want = {(f"{t} {name}", rows) for t in types for name, _, _ in DENSE_GEOMETRIES for rows in DENSE_ROWS}
    assert {(r["geometry"], int(r["kernel"].split()[1][1:])) for r in dense} == want
    assert any(r["kernel"].endswith("s1") for r in dense) and any(not r["kernel"].endswith("s1") for r in dense)
    for r in dense:
        where = f"{r['geometry']} {r['kernel']}"
        assert r["spill_ops"] == 0, f"{where} spills: {r}"
        if r["geometry"].split()[0] in ("F16", "BF16") and not r["kernel"].startswith("dense r1 "):
            # several rows of 16-bit weights: tensor cores, the steps staged through shared memory
            assert r["mma"] in ("mma.sync", "wgmma") and len(r["loop_instructions"]) <= 1, f"{where}: {r}"
            continue
        # one K loop (ptxas may unroll the 16-bit kernel's short one by four, then a loop takes the rest)
        loops = 2 if r["geometry"].split()[0] in ("F16", "BF16") else 1
        assert len(r["loop_instructions"]) <= loops, f"{where}: one K loop expected, {r['loop_instructions']}"
        assert r["loop_smem_or_barrier"] == 0, f"{where}: shared memory or barriers in the K loop: {r}"
        if r["geometry"].split()[0] in ("Q4_K", "Q5_K", "Q6_K/224", "MXFP4/planar", "Q8_0/planar", "F16", "BF16"):
            # whole 16-byte loads of the weights (Q6_K: padded blocks; MXFP4, Q8_0: planar rows), but
            # planar MXFP4's e8m0 scales in the lanes-along-K tile: a byte a lane, a warp's in one sector
            # (4 load sites: the first steps' and the next steps', in the loop and ptxas's copy of it;
            # quants read a byte at a time, as from GGUF's 17-byte blocks, take 136)
            scale_bytes = 4 if r["geometry"].startswith("MXFP4/planar") else 0
            loads = _by_width(r["loads"])
            narrow = {op: n for op, n in loads.items() if op in ("LDG.E.U16", "LDG.E.S16")
                      or (op == "LDG.E.U8" and n > scale_bytes)}
            assert loads.get("LDG.E.128", 0) > 0 and not narrow, f"{where}: {r['loads']}"


def test_supports_types_and_activations() -> None:
    w = make_weights((QT.Q4_K,) * 3, 2, 256, 256)
    assert tk.supports(w) == tk.available()
    w_q4_0 = ExpertWeights(w.gate, ExpertTensor(w.up.raw, QT.Q4_0, w.up.shape, None), w.down)
    assert not tk.supports(w_q4_0)


# ------------------------------------------------------------------------------ GPU tests

GPU_TYPES = [QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q8_0, QT.MXFP4, QT.F16, QT.BF16]


def _needs_compiled():
    if tk.INTERPRETED:
        pytest.skip("kernels were imported in interpreter mode")


@gpu
@pytest.mark.parametrize("qtype", GPU_TYPES, ids=lambda t: t.name)
def test_gpu_rounding_is_bit_exact(qtype: QT) -> None:
    _needs_compiled()
    K = 2048 if qtype in (QT.Q4_K, QT.Q5_K, QT.Q6_K) else 2880
    for x in rounding_inputs(K, "cuda"):
        check_rounding(qtype, x)


GPU_CASES = {
    # Qwen3-30B-A3B experts: n_embd 2048, n_ff 768, top-8, silu (16 experts suffice here)
    **{f"qwen3-{t.name}": ((t,) * 3, 2048, 768, 16, 8, SILU, False) for t in GPU_TYPES},
    "qwen3-Q4_K_M": ((QT.Q4_K, QT.Q4_K, QT.Q6_K), 2048, 768, 16, 8, SILU, False),
    # gpt-oss-120b experts: 2880 x 2880 MXFP4, top-4, swiglu_oai with biases
    "gpt-oss-MXFP4": ((QT.MXFP4,) * 3, 2880, 2880, 8, 4, SWIGLU_OAI, True),
}


@gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
@pytest.mark.parametrize("n_tok", [1, 8])
def test_gpu_kernels_match_reference(name: str, n_tok: int) -> None:
    _needs_compiled()
    qtypes, n_embd, n_ff, n_expert, k, act, bias = GPU_CASES[name]
    w = make_weights(qtypes, n_expert=n_expert, n_embd=n_embd, n_ff=n_ff, activation=act, bias=bias, seed=n_tok)
    errs = check_case(Case(w, n_tok=n_tok, k=k, device="cuda", seed=n_tok))
    print(name, n_tok, {k_: f"{v:.1e}" for k_, v in errs.items()})


@gpu
@pytest.mark.parametrize("n_tok", [1, 8])
def test_gpu_kernels_read_q6_k_experts_in_the_gguf_layout(n_tok: int) -> None:
    """The slots hold Q6_K padded; buffers of GGUF rows still compute the same."""
    _needs_compiled()
    w = make_weights((QT.Q4_K, QT.Q4_K, QT.Q6_K), n_expert=16, n_embd=2048, n_ff=768, seed=n_tok)
    check_case(Case(w, n_tok=n_tok, k=8, device="cuda", seed=n_tok, gguf_layout=True))


@gpu
@pytest.mark.parametrize("split", [tk.SplitK(8, 1), tk.SplitK(3, 3)], ids=lambda s: f"split{s.split}")
def test_gpu_gate_up_split_over_k_and_replayed_in_a_graph(split: tk.SplitK) -> None:
    """Forced splits compute the reference; the semaphores (a row block's, then its pair's) are
    left at zero by every launch, so a graph replayed many times gives the eager result."""
    _needs_compiled()
    w = make_weights((QT.Q4_K, QT.Q4_K, QT.Q6_K), n_expert=16, n_embd=2048, n_ff=768, seed=3)
    case = Case(w, n_tok=1, k=8, device="cuda", seed=3)
    check_case(case, split=split)
    out = torch.zeros(case.ids.shape[1], *case.x.shape, device="cuda")
    tk.experts_forward(case.x, case.buffers, w, case.tok, case.pos, case.slot, case.exp, case.weights, out,
                       gate_up_split=split)
    want = out.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        tk.experts_forward(case.x, case.buffers, w, case.tok, case.pos, case.slot, case.exp, case.weights, out,
                           gate_up_split=split)
    for _ in range(20):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)


@gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
@pytest.mark.parametrize("n_tok", [1, 8])
def test_gpu_one_launch_step_equals_three_launches_and_replays(name: str, n_tok: int) -> None:
    """At the real shapes the one-launch step writes the three launches' result bit for bit
    (a pair without a slot left alone), in either down tile, and at every default (the engine's
    step: the two forms' defaults agree); a graph of it replayed on changing x gives each x's
    result: the flags of one replay never pass for the next."""
    _needs_compiled()
    qtypes, n_embd, n_ff, n_expert, k, act, bias = GPU_CASES[name]
    w = make_weights(qtypes, n_expert=n_expert, n_embd=n_embd, n_ff=n_ff, activation=act, bias=bias, seed=n_tok)
    case = Case(w, n_tok=n_tok, k=k, device="cuda", seed=n_tok)
    case.slot[1] = -1
    for down_tile in dict.fromkeys(("tile", default_down_tile(case))):
        check_one_launch(case, None, None, None, down_tile)
    xs = [case.x.clone(), -0.5 * case.x]
    wants = []
    for x in xs:
        wants.append(torch.zeros(k, *x.shape, device="cuda"))
        tk.experts_forward(x, case.buffers, case.w, case.tok, case.pos, case.slot, case.exp, case.weights,
                           wants[-1])
    x_in, out = xs[0].clone(), torch.zeros_like(wants[0])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        tk.experts_forward(x_in, case.buffers, case.w, case.tok, case.pos, case.slot, case.exp, case.weights, out,
                           one_launch=True)
    for i in range(20):
        x_in.copy_(xs[i % 2])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, wants[i % 2]), f"replay {i}"
    assert not tk.step_timed_out(torch.device("cuda"))


def check_chain_replays(chained, serial, xs: list[torch.Tensor]) -> None:
    """chained(x) (launches that may overlap the one before) gives serial(x)'s bits (NaN and all)
    eagerly, and captured in a graph replayed 30 times on xs in turn."""
    def bits(x: torch.Tensor) -> torch.Tensor:
        return x.view(torch.int32)

    wants = [bits(serial(x)) for x in xs]
    x_in = xs[0].clone()
    assert torch.equal(bits(chained(x_in)), wants[0])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        result = chained(x_in)
    for i in range(30):
        x_in.copy_(xs[i % 3])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(bits(result), wants[i % 3]), f"replay {i}"


@gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
@pytest.mark.parametrize("n_tok", [1, 8])
def test_gpu_dependent_launches_give_the_serial_launches_bits(name: str, n_tok: int) -> None:
    """Where the device has programmatic dependent launch, gate/up and down start while the
    launch before them ends and must read its results only after its end: a chain of steps (each
    step's x the sum of the last one's outputs), captured in a graph and replayed on changing x,
    gives bit for bit the launches made one at a time with the device synchronized between them.
    (Each x is scaled to a largest value of 1: unscaled, F16's rounding overflows by the third step.)"""
    _needs_compiled()
    if not tk.dependent_launches("cuda"):
        pytest.skip("no programmatic dependent launch on this GPU or Triton")
    qtypes, n_embd, n_ff, n_expert, k, act, bias = GPU_CASES[name]
    w = make_weights(qtypes, n_expert=n_expert, n_embd=n_embd, n_ff=n_ff, activation=act, bias=bias, seed=n_tok)
    case = Case(w, n_tok=n_tok, k=k, device="cuda", seed=n_tok)
    case.slot[1] = -1
    steps = 3

    def unit(x: torch.Tensor) -> torch.Tensor:
        return x / x.abs().amax(dim=1, keepdim=True)

    def serial(x: torch.Tensor) -> torch.Tensor:
        for _ in range(steps):
            xg, xu = tk.round_inputs(x, case.w)
            torch.cuda.synchronize()
            _, hr = tk.gate_up(xg, xu, case.buffers[0], case.buffers[1], case.w, case.tok, case.slot, case.exp)
            torch.cuda.synchronize()
            out = torch.zeros(k, *x.shape, device="cuda")
            tk.down(hr, case.buffers[2], case.w, case.tok, case.pos, case.slot, case.exp, case.weights, out)
            torch.cuda.synchronize()
            x = unit(out.sum(0))
        return x

    def chained(x: torch.Tensor) -> torch.Tensor:
        for _ in range(steps):
            out = torch.zeros(k, *x.shape, device="cuda")
            tk.experts_forward(x, case.buffers, case.w, case.tok, case.pos, case.slot, case.exp, case.weights, out)
            x = unit(out.sum(0))
        return x

    check_chain_replays(chained, serial, [case.x.clone(), -0.5 * case.x, 2.0 * case.x])


OTHER_CONFIGS = [tk.TileConfig(8, 2), tk.TileConfig(16, 1), tk.TileConfig(64, 2, unroll=True),
                 tk.TileConfig(128, 8, num_stages=3)]


@gpu
@pytest.mark.parametrize("cfg", OTHER_CONFIGS,
                         ids=lambda c: f"bn{c.block_n}w{c.num_warps}u{int(c.unroll)}s{c.num_stages}")
@pytest.mark.parametrize("qtypes", [(QT.Q4_K, QT.Q4_K, QT.Q6_K), (QT.MXFP4,) * 3], ids=["Q4_K_M", "MXFP4"])
def test_gpu_other_tile_configs(cfg: tk.TileConfig, qtypes) -> None:
    """Any tile configuration the benchmark sweeps computes the same thing."""
    _needs_compiled()
    w = make_weights(qtypes, n_expert=16, n_embd=2048, n_ff=768, seed=7)
    check_case(Case(w, n_tok=2, k=8, device="cuda", seed=7), cfg, cfg)


@gpu
@pytest.mark.parametrize("cfg", [tk.TileConfig(2, 1), tk.TileConfig(2, 2), tk.TileConfig(8, 8), tk.TileConfig(16, 4)],
                         ids=lambda c: f"bn{c.block_n}w{c.num_warps}")
@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.MXFP4], ids=lambda t: t.name)
def test_gpu_other_row_tiles(cfg: tk.TileConfig, qtype: QT) -> None:
    """The lanes-along-K kernels (one token's gate/up; the one-row dense product) at the tiles the
    benchmark sweeps (MXFP4 at gpt-oss's K = 2880: a partial last K step)."""
    _needs_compiled()
    K = 2880 if qtype == QT.MXFP4 else 2048
    w = make_weights((qtype,) * 3, n_expert=16, n_embd=K, n_ff=768, seed=8)
    check_case(Case(w, n_tok=1, k=8, device="cuda", seed=8), cfg)
    check_dense(qtype, n_out=4096, K=K, rows=1, device="cuda", cfg=cfg, laid_out=True)


@gpu
@pytest.mark.parametrize("K", [2048, 2880])
def test_gpu_planar_q8_0_in_the_row_tiles(K: int) -> None:
    """Planar Q8_0's gate/up and down in the lanes-along-K tiles, one token's default (2880: a
    partial last K step)."""
    _needs_compiled()
    w = make_weights((QT.Q8_0,) * 3, n_expert=16, n_embd=K, n_ff=768, seed=8)
    case = Case(w, n_tok=1, k=8, device="cuda", seed=8)
    assert default_down_tile(case) == "row"
    check_case(case)


@gpu
@pytest.mark.parametrize("n_tok,group,gate_up_rows", [(2, tk.RUN_MAX_TOKENS, None), (8, tk.RUN_MAX_TOKENS, None),
                                                      (8, 3, None), (8, 2, 8)])
@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K, QT.Q8_0, QT.MXFP4], ids=lambda t: t.name)
def test_gpu_row_tiles_take_a_slot_run_a_program(monkeypatch, qtype: QT, n_tok: int, group: int,
                                                 gate_up_rows: int | None) -> None:
    """The row tiles over several tokens at Qwen3's shape (gpt-oss's K for MXFP4), 16 experts top-8
    (runs of up to n_tok pairs, or cut at `group`; gate/up's rows a program as the sweep's second
    form of runs takes them, or the default): the reference's results, a program a pair's bits."""
    _needs_compiled()
    K = 2880 if qtype == QT.MXFP4 else 2048
    w = make_weights((qtype,) * 3, n_expert=16, n_embd=K, n_ff=768, seed=8)
    case = Case(w, n_tok=n_tok, k=8, device="cuda", seed=8)
    gate_up = tk.TileConfig(gate_up_rows, 4) if gate_up_rows else tk.GATE_UP_CONFIG["row"]
    gate_up_cfg = replace(gate_up, group=group)
    down_cfg = replace(tk.DOWN_CONFIG["row"], group=group)
    check_case(case, gate_up_cfg, down_cfg, gate_up_tile="row", down_tile="row")
    check_runs(case, monkeypatch, gate_up_cfg, down_cfg)


@gpu
@pytest.mark.parametrize("cfg", [tk.TileConfig(8, 4, passes=2), tk.TileConfig(16, 4, passes=4)],
                         ids=lambda c: f"bn{c.block_n}w{c.num_warps}t{c.passes}")
@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.MXFP4], ids=lambda t: t.name)
def test_gpu_gate_up_rows_in_turns(cfg: tk.TileConfig, qtype: QT) -> None:
    """One token's gate/up with its rows in turns, as the benchmark sweeps it (MXFP4 at gpt-oss's
    K = 2880: a partial last K step)."""
    _needs_compiled()
    K = 2880 if qtype == QT.MXFP4 else 2048
    w = make_weights((qtype,) * 3, n_expert=16, n_embd=K, n_ff=768, seed=8)
    check_turns(Case(w, n_tok=1, k=8, device="cuda", seed=8), cfg, None)


# ------------------------------------------------------------------------------ the hybrid hook

def _hook_outputs(make_model, arch: str, qtype: QT, device: str, monkeypatch, mode: str) -> tuple:
    """One layer step of HybridExperts (hits and uploads on the accelerator) under
    MOESTUDIO_TRITON=mode, and the same step on the torch path."""
    from engine.models import build_model
    from engine.moe.hybrid import HybridExperts, HybridOptions

    model = build_model(make_model(arch, qtype), device)
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, cfg.n_embd, generator=g).to(device)
    ids = torch.stack([torch.randperm(cfg.n_expert, generator=g)[:cfg.n_expert_used] for _ in range(3)]).to(device)
    weights = torch.rand(3, cfg.n_expert_used, generator=g).to(device)
    outs = []
    calls = []
    forward = tk.experts_forward
    monkeypatch.setattr(tk, "experts_forward", lambda *a, **kw: (calls.append(m), forward(*a, **kw)))
    for m in (mode, "0"):
        monkeypatch.setenv("MOESTUDIO_TRITON", m)
        hybrid = HybridExperts(model.expert_weights, device,
                               HybridOptions(slots_per_layer=cfg.n_expert // 2, miss_fraction=1.0, policy="off"))
        try:
            hybrid.prefill_residency([(layer, e) for layer in hybrid.layer_ids for e in range(cfg.n_expert // 2)])
            layer = hybrid.layer_ids[0]
            outs.append(hybrid(layer, x, ids, weights))
            c = hybrid.counters
            assert c.gpu_hit.sum() > 0 and c.uploaded.sum() > 0 and c.cpu_computed.sum() == 0
        finally:
            hybrid.close()
    assert calls == [mode, mode], "hits and uploads: one Triton launch sequence each, none with MOESTUDIO_TRITON=0"
    return tuple(outs)


@interp
@pytest.mark.parametrize("arch,qtype", [("qwen3moe", QT.Q4_K), ("gpt-oss", QT.MXFP4), ("llama", QT.Q6_K)])
def test_interpreter_hybrid_hook_matches_torch_path(make_model, monkeypatch, arch, qtype) -> None:
    for configs in (tk.GATE_UP_CONFIG, tk.DOWN_CONFIG):  # one program per pair: the interpreter's fastest
        for tile in configs:
            monkeypatch.setitem(configs, tile, tk.TileConfig(256, 4))
    # and for the row tile's turns, which padded Q6_K's and planar MXFP4's gate/up take over 3 tokens
    monkeypatch.setattr(tk, "GATE_UP_ROW_IN_TURNS", replace(tk.GATE_UP_ROW_IN_TURNS, block_n=256))
    got, want = _hook_outputs(make_model, arch, qtype, "cpu", monkeypatch, "force")
    assert rel_err(got, want) < 1e-3, rel_err(got, want)


@gpu
@pytest.mark.parametrize("arch,qtype", [("qwen3moe", QT.Q4_K), ("gpt-oss", QT.MXFP4), ("llama", QT.Q6_K),
                                        ("olmoe", QT.Q8_0)])
def test_gpu_hybrid_hook_matches_torch_path(make_model, monkeypatch, arch, qtype) -> None:
    _needs_compiled()
    pytest.importorskip("llama_cpp", reason="the synthetic models and the CPU pool need llama-cpp-python's ggml")
    got, want = _hook_outputs(make_model, arch, qtype, "cuda", monkeypatch, "1")
    assert rel_err(got, want) < 1e-3, rel_err(got, want)


# ------------------------------------------------------------------------------ dense weights

DENSE_TYPES = [QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q8_0, QT.MXFP4, QT.F16, QT.BF16]


def check_dense(qtype: QT, n_out: int, K: int, rows: int, device: str, cfg: tk.TileConfig | None = None,
                split: tk.SplitK | None = None, laid_out: bool = False, tile: str | None = None) -> float:
    """tk.dense (a dense weight read in its GGUF bytes, or with `laid_out` as kernel_layout lays
    them out: Q6_K padded, MXFP4 and Q8_0 planar; in `tile`, by default dense_tile's) against
    round_activation(x) @ dequantize(W).T."""
    rng = np.random.default_rng(int(qtype) + n_out + rows)
    raw = _random_raw(rng, qtype, (1, n_out, K), K ** -0.5).to(device)
    x = torch.from_numpy(rng.standard_normal((rows, K)).astype(np.float32) * 2.0).to(device)
    want = round_activation(x, qtype) @ dequantize(raw[0], qtype, (n_out, K)).T
    got = tk.dense(x, kernel_layout(raw, qtype) if laid_out else raw, qtype, n_out, cfg, split, tile)
    assert got.shape == want.shape
    err = rel_err(got, want)
    assert err < REL_TOL, (qtype.name, rows, split, err)
    return err


def dense_splits(K: int) -> list[tk.SplitK]:
    """No split; one K step per program; and, where there are 3 or more steps, an uneven
    split (the last slice shorter)."""
    n = -(-K // tk.KSTEP)
    out = [tk.SplitK(1, n), tk.SplitK(n, 1)]
    if n >= 3:
        out.append(tk.SplitK(-(-n // 2), 2))
    return out


@interp
@pytest.mark.parametrize("qtype", DENSE_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3])
def test_interpreter_dense_matches_reference(qtype: QT, rows: int) -> None:
    # 160 output rows in tiles of 128 (a partial tile); K-quants 3 K steps, the others 2,
    # the last one partial (352 = 256 + 96).
    # Q4_K and Q5_K in the tile they take and in the quantized tile, which --sweep times beside it
    K = 768 if qtype in (QT.Q4_K, QT.Q5_K, QT.Q6_K) else 352
    tiles = dict.fromkeys((tk.dense_tile(int(qtype), rows), "tile")) if int(qtype) in tk.ROW_TILE_TYPES else [None]
    for tile in tiles:
        for split in dense_splits(K):
            check_dense(qtype, n_out=160, K=K, rows=rows, device="cpu", cfg=SMALL, split=split, tile=tile)
    if rows == 1 and qtype in (QT.F16, QT.BF16):
        # the one-row 16-bit tile's steps of DENSE16_STEP values: whole ones, split on their bounds
        # or not; a partial last one; slices that end inside a step
        for K, split in ((2048, tk.SplitK(1, 8)), (2048, tk.SplitK(2, 4)), (2400, tk.SplitK(1, 10)),
                         (2400, tk.SplitK(2, 5)), (2400, tk.SplitK(4, 3))):
            check_dense(qtype, n_out=160, K=K, rows=1, device="cpu", cfg=tk.TileConfig(32, 4), split=split)


@interp
@pytest.mark.parametrize("qtype,K", [(QT.Q6_K, 768), (QT.MXFP4, 352), (QT.MXFP4, 512), (QT.Q8_0, 352),
                                     (QT.Q8_0, 768)], ids=lambda v: str(v))
@pytest.mark.parametrize("rows", [1, 3])
def test_interpreter_dense_kernel_layouts(qtype: QT, K: int, rows: int) -> None:
    """Q6_K padded, MXFP4 and Q8_0 planar (a partial last step; whole steps, the scales' padding a
    full 16), in the tile they take and in the quantized tile (which --sweep times beside it)."""
    for tile in dict.fromkeys((tk.dense_tile(laid_out_type(qtype), rows), "tile")):
        for split in dense_splits(K):
            check_dense(qtype, n_out=160, K=K, rows=rows, device="cpu", cfg=SMALL, split=split, laid_out=True,
                        tile=tile)


@interp
@pytest.mark.parametrize("qtype,K", [(QT.Q4_K, 1536), (QT.Q5_K, 1536), (QT.Q6_K, 1536), (QT.MXFP4, 1536),
                                     (QT.MXFP4, 1440)], ids=lambda v: getattr(v, "name", str(v)))
def test_interpreter_one_row_k4_kernel_over_several_step_groups(qtype: QT, K: int) -> None:
    """The one-row Q4_K / Q5_K / padded Q6_K / planar MXFP4 kernel reads four K steps an access:
    6 steps are a whole group and a partial one (unsplit), or groups cut by the split (3 and 2
    steps a slice, 1 step a slice); MXFP4 at K = 1440 ends in a partial step (5 of its 8 blocks)."""
    qw = laid_out_type(qtype)
    assert tk.dense_tile(qw, 1) == tk.dense_tile(qw, tk.DENSE_MAX_ROWS) == "row_kquant"
    assert tk.dense_tile(int(qtype), 1) == ("row_kquant" if qw == int(qtype) else "tile")  # GGUF rows: the tile
    for split in (tk.SplitK(1, 6), tk.SplitK(2, 3), tk.SplitK(3, 2), tk.SplitK(6, 1)):
        check_dense(qtype, n_out=40, K=K, rows=1, device="cpu", cfg=tk.TileConfig(16, 4), split=split, laid_out=True)


@interp
@pytest.mark.parametrize("qtype,K,rows,split", [
    (QT.Q4_K, 1536, 3, None), (QT.Q5_K, 1536, 8, tk.SplitK(2, 3)), (QT.Q6_K, 1536, 2, None),
    (QT.MXFP4, 1440, 8, None), (QT.Q8_0, 1440, 3, tk.SplitK(3, 2)), (QT.Q8_0, 768, 1, None)],
    ids=lambda v: getattr(v, "name", str(v)))
def test_interpreter_k4_dense_over_several_rows(qtype: QT, K: int, rows: int, split: tk.SplitK | None) -> None:
    """The lanes-along-K dense tile ("row_kquant"): 2-8 activation rows on each weight load, planar
    Q8_0 (one row too, where asked), partial last steps (1440) and splits over K."""
    check_dense(qtype, n_out=40, K=K, rows=rows, device="cpu", cfg=tk.TileConfig(16, 4), split=split,
                laid_out=True, tile="row_kquant")


def test_dense_takes_the_k4_tile_only_where_it_reads_the_type() -> None:
    x = torch.zeros(2, 256)
    for raw, qtype in ((torch.zeros(1, 4, 512, dtype=torch.uint8), QT.F16),
                       (torch.zeros(1, 4, 272, dtype=torch.uint8), QT.Q8_0)):  # Q8_0 as the file holds it
        with pytest.raises(ValueError, match="row_kquant"):
            tk.dense(x, raw, qtype, 4, tile="row_kquant")


def check_linear(qtype: QT, n_out: int, K: int, device: str, monkeypatch, decode_rows=(1, 3),
                 prefill_rows: int = 40) -> None:
    """engine.layers.linear.Linear with the kernels (MOESTUDIO_TRITON=force, or 1 on CUDA)
    against the same Linear decoded to float32 (MOESTUDIO_TRITON=0): it keeps one copy of the
    weight, in layout.kernel_layout's layout (Q6_K padded); decode-sized products (the dense
    kernel) and prefill-sized ones (the grouped GEMM) agree to float32 summation order."""
    from engine.layers.linear import Linear

    rng = np.random.default_rng(int(qtype) + n_out + K)
    raw = _random_raw(rng, qtype, (1, n_out, K), K ** -0.5)[0]  # [n_out, row_bytes], as the GGUF holds it
    bias = torch.from_numpy(rng.standard_normal(n_out).astype(np.float32)).to(device)
    monkeypatch.setenv("MOESTUDIO_TRITON", "0")
    ref = Linear(raw, qtype, (n_out, K), bias, device)
    monkeypatch.setenv("MOESTUDIO_TRITON", "force" if device == "cpu" else "1")
    lin = Linear(raw, qtype, (n_out, K), bias, device)
    assert ref.raw is None and lin.weight is None
    assert lin.raw.device.type == torch.device(device).type
    assert torch.equal(lin.raw[0].cpu(), kernel_layout(raw, qtype))
    for rows in decode_rows:
        x = torch.from_numpy(rng.standard_normal((rows, K)).astype(np.float32) * 2.0).to(device)
        err = rel_err(lin(x), ref(x))
        assert err < REL_TOL, (qtype.name, rows, err)
    # the kernel layout decodes to the very weights of the GGUF bytes
    assert torch.equal(dequantize_layout(lin.raw[0], qtype, (n_out, K)), ref.weight)
    x = torch.from_numpy(rng.standard_normal((prefill_rows, K)).astype(np.float32) * 2.0).to(device)
    err = rel_err(lin(x), ref(x))
    assert err < REL_TOL, (qtype.name, prefill_rows, err)


@interp
@pytest.mark.parametrize("qtype", [QT.Q6_K, QT.MXFP4, QT.Q8_0, QT.Q4_K], ids=lambda t: t.name)
def test_interpreter_linear_uses_the_kernel_layout(qtype: QT, monkeypatch) -> None:
    check_linear(qtype, n_out=40, K=768, device="cpu", monkeypatch=monkeypatch)


@interp
@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q8_0, QT.BF16], ids=lambda t: t.name)
def test_interpreter_dense_eight_rows_and_default_split(qtype: QT) -> None:
    check_dense(qtype, n_out=96, K=512, rows=tk.DENSE_MAX_ROWS, device="cpu", cfg=SMALL,
                split=tk.SplitK(2, 1))
    check_dense(qtype, n_out=96, K=512, rows=2, device="cpu", cfg=SMALL)


@interp
@pytest.mark.parametrize("qtype,K", [(QT.Q4_K, 3072), (QT.Q5_K, 3072), (QT.Q6_K, 3072), (QT.MXFP4, 2880),
                                     (QT.Q8_0, 2880)], ids=lambda v: getattr(v, "name", str(v)))
@pytest.mark.parametrize("k_warps", [2, 4])
def test_interpreter_k4_dense_with_warps_along_k(qtype: QT, K: int, k_warps: int) -> None:
    """The lanes-along-K dense tile with its warps side by side along K (4 x k_warps K steps an
    access: 12 steps are whole accesses and a partial one, or cut by the split), 1 and 3 rows."""
    for rows in (1, 3):
        for split in (None, tk.SplitK(2, 6)):
            check_dense(qtype, n_out=6, K=K, rows=rows, device="cpu", split=split, tile="row_kquant",
                        cfg=tk.TileConfig(2, k_warps, programs_per_sm=1, k_warps=k_warps),
                        laid_out=qtype in (QT.Q6_K, QT.MXFP4, QT.Q8_0))


def test_dense_config_gives_one_long_row_warps_along_k() -> None:
    """One row of K-quant weight rows of LONG_ROW_K values or more takes LONG_ROW_CONFIG; shorter
    rows, more activation rows and the other tiles their DENSE_CONFIG; a tile that is none, an error."""
    qw = int(QT.Q4_K)
    assert tk.dense_config(qw, 1, tk.LONG_ROW_K) == tk.LONG_ROW_CONFIG and tk.LONG_ROW_CONFIG.k_warps > 1
    for rows, K in ((1, tk.LONG_ROW_K - tk.KSTEP), (2, tk.LONG_ROW_K), (tk.DENSE_MAX_ROWS, 4 * tk.LONG_ROW_K)):
        assert tk.dense_config(qw, rows, K) == tk.DENSE_CONFIG["row_kquant"]
    assert tk.dense_config(qw, 1, tk.LONG_ROW_K, "tile") == tk.DENSE_CONFIG["tile"]
    assert tk.dense_config(int(QT.F16), 1, tk.LONG_ROW_K) == tk.DENSE_CONFIG["row16"]
    with pytest.raises(ValueError, match="no dense tile 'rows'"):
        tk.dense_config(qw, 1, tk.LONG_ROW_K, "rows")


@interp
def test_interpreter_dense_launches_long_rows_with_warps_along_k(monkeypatch) -> None:
    """tk.dense's default path takes dense_config's long-row config (its kernel launched with the
    warps along K) and gives the reference's product; LONG_ROW_K lowered so the interpreter's
    rows stay short."""
    monkeypatch.setattr(tk, "LONG_ROW_K", 3072)
    launched = []
    real_dense_kernel = tk.dense_kernel
    monkeypatch.setattr(tk, "dense_kernel", lambda qw, rows, cfg, *a, **k: launched.append((rows, cfg.k_warps))
                        or real_dense_kernel(qw, rows, cfg, *a, **k))
    check_dense(QT.Q4_K, n_out=6, K=3072, rows=1, device="cpu")
    check_dense(QT.Q4_K, n_out=6, K=3072, rows=2, device="cpu")
    assert launched == [(1, tk.LONG_ROW_CONFIG.k_warps), (2, 1)]


@interp
@pytest.mark.parametrize("qtype", [QT.F16, QT.BF16], ids=lambda t: t.name)
def test_interpreter_one_row_16_bit_product_rounds_x_itself(qtype: QT, monkeypatch) -> None:
    """One row of 16-bit weights is one launch: dense launches no rounding before it (the tile
    rounds x as round_activation does), and its product refuses x rounded beforehand; more rows
    still take the rounding launch."""
    rng = np.random.default_rng(3)
    raw = _random_raw(rng, qtype, (1, 64, 1024), 1024 ** -0.5)
    x = torch.from_numpy(rng.standard_normal((2, 1024)).astype(np.float32))
    want = round_activation(x, qtype) @ dequantize(raw[0], qtype, (64, 1024)).T
    rounds = []
    real_round_rows = tk.round_rows
    monkeypatch.setattr(tk, "round_rows", lambda *a, **k: rounds.append(a[0].shape) or real_round_rows(*a, **k))
    assert rel_err(tk.dense(x[:1], raw, qtype, 64), want[:1]) < REL_TOL and rounds == []
    assert rel_err(tk.dense(x, raw, qtype, 64), want) < REL_TOL and rounds == [(2, 1024)]
    with pytest.raises(ValueError, match="as it is"):
        tk._dense_product(real_round_rows(x[:1], qtype), raw, qtype, 64)


def test_dense_rejects_more_rows_than_it_takes() -> None:
    x = torch.zeros(tk.DENSE_MAX_ROWS + 1, 256)
    with pytest.raises(ValueError, match="at most"):
        tk.dense(x, torch.zeros(1, 4, 512, dtype=torch.uint8), QT.F16, 4)


@pytest.mark.parametrize("n_out,K,sms,want", [
    (4096, 2048, 132, tk.SplitK(4, 2)),       # Qwen3-30B-A3B q projection
    (512, 2048, 132, tk.SplitK(8, 1)),        # its k / v projections: one step per program
    (2048, 4096, 132, tk.SplitK(8, 2)),       # its o projection
    (151936, 2048, 132, tk.SplitK(1, 8)),     # its output head: no split, no reduction
    (4096, 14336, 132, tk.SplitK(5, 12)),     # Mixtral's down projection
    (4096, 2048, 1, tk.SplitK(1, 8)),         # one SM: nothing to spread
    (8 * 768, 2048, 132, tk.SplitK(3, 3)),    # one token's gate/up (top-8 pairs x 768 rows)
    (64 * 768, 2048, 132, tk.SplitK(1, 8)),   # eight tokens' gate/up: 1,536 row blocks fill the GPU
])
def test_split_heuristic(n_out: int, K: int, sms: int, want) -> None:
    got = tk.SplitK.choose(n_out, K, sms, tk.TileConfig(32, 2))
    assert got == want
    n_steps = -(-K // tk.KSTEP)
    assert (got.split - 1) * got.steps < n_steps <= got.split * got.steps, "every slice has a step"
    if got.split > 1:  # a semaphore per row block, from the ones allocated at once
        assert -(-n_out // 32) < tk.COUNTERS


# Decode shapes of the factory's geometries: (n_out, K).
GPU_DENSE_SHAPES = {
    "qwen3-q": (4096, 2048), "qwen3-kv": (512, 2048), "qwen3-o": (2048, 4096),
    "head-partial-tile": (30016 + 8, 2048), "mixtral-down": (4096, 14336),
}


@gpu
@pytest.mark.parametrize("qtype", DENSE_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 8])  # (3 rows: the interpreter tests)
def test_gpu_dense_matches_reference(qtype: QT, rows: int) -> None:
    _needs_compiled()
    for n_out, K in GPU_DENSE_SHAPES.values():
        check_dense(qtype, n_out=n_out, K=K, rows=rows, device="cuda")
    n_out, K = GPU_DENSE_SHAPES["qwen3-q"]
    for split in dense_splits(K)[1:]:  # forced splits: one K step per program; uneven slices
        check_dense(qtype, n_out=n_out, K=K, rows=rows, device="cuda", split=split)


@gpu
@pytest.mark.parametrize("qtype", [QT.Q6_K, QT.MXFP4, QT.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 8])
def test_gpu_dense_kernel_layouts(qtype: QT, rows: int) -> None:
    _needs_compiled()
    for n_out, K in GPU_DENSE_SHAPES.values():
        check_dense(qtype, n_out=n_out, K=K, rows=rows, device="cuda", laid_out=True)


@gpu
@pytest.mark.parametrize("qtype", DENSE_TYPES, ids=lambda t: t.name)
def test_gpu_linear_uses_the_kernel_layout(qtype: QT, monkeypatch) -> None:
    """The engine's dense layers on CUDA: one copy of each weight (Q6_K padded, MXFP4 planar), the kernel at
    1 and 8 rows, the prefill path exact against the float32 weights."""
    _needs_compiled()
    for n_out, K in (GPU_DENSE_SHAPES["qwen3-q"], GPU_DENSE_SHAPES["head-partial-tile"]):
        check_linear(qtype, n_out=n_out, K=K, device="cuda", monkeypatch=monkeypatch, decode_rows=(1, 8),
                     prefill_rows=32)


@gpu
@pytest.mark.parametrize("cfg", [tk.TileConfig(16, 1), tk.TileConfig(64, 2), tk.TileConfig(64, 4)],
                         ids=lambda c: f"bn{c.block_n}w{c.num_warps}")
@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q8_0, QT.F16], ids=lambda t: t.name)
def test_gpu_dense_other_tile_configs(cfg: tk.TileConfig, qtype: QT) -> None:
    """Any tile the kernel benchmark sweeps computes the same thing (Q4_K in the quantized tile, which
    the sweep times beside the lanes-along-K tile it takes)."""
    _needs_compiled()
    check_dense(qtype, n_out=4096, K=2048, rows=4, device="cuda", cfg=cfg, tile="tile" if qtype == QT.Q4_K else None)


@gpu
@pytest.mark.parametrize("block_n,num_warps", kb.DOWN_ROW_SWEEP, ids=lambda v: str(v))
@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.MXFP4], ids=lambda t: t.name)
def test_gpu_down_row_tile_in_the_configs_the_sweep_times(qtype: QT, block_n: int, num_warps: int) -> None:
    """down's row tile in every config `bench kernels --sweep` times: one token at Qwen3's shape (768
    values a row: eight lanes a row) and gpt-oss's (2880: a warp a row), against the reference, and
    the default config's bits (a row's sum does not depend on the rows a program takes)."""
    _needs_compiled()
    n_embd, n_ff = (2880, 2880) if qtype == QT.MXFP4 else (2048, 768)
    w = make_weights((qtype,) * 3, n_expert=16, n_embd=n_embd, n_ff=n_ff, activation=SWIGLU_OAI if qtype == QT.MXFP4
                     else SILU, bias=qtype == QT.MXFP4, seed=21)
    check_down_configs(Case(w, n_tok=1, k=8, device="cuda", seed=21), [tk.TileConfig(block_n, num_warps)])


@gpu
@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K, QT.MXFP4], ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 8])
def test_gpu_k4_dense_in_the_configs_the_sweep_times(qtype: QT, rows: int) -> None:
    """The lanes-along-K dense tile in every config `bench kernels --sweep` times (warps along K
    too), at Mixtral's 14,336 values a row, against the reference."""
    _needs_compiled()
    qw = laid_out_type(qtype)
    for cfg in [cfg for tile, cfg in kb._dense_sweep(qw, rows, 14336) if tile == "row_kquant"]:
        check_dense(qtype, n_out=4096, K=14336, rows=rows, device="cuda", cfg=cfg, tile="row_kquant",
                    laid_out=qtype != QT.Q4_K)


@gpu
@pytest.mark.parametrize("qtype", [QT.F16, QT.BF16], ids=lambda t: t.name)
def test_gpu_one_row_16_bit_tile_in_the_configs_the_sweep_times(qtype: QT) -> None:
    """The one-row 16-bit tile in every config `bench kernels --sweep` times, at Mixtral's 14,336
    values a row (14 whole steps of DENSE16_STEP), unsplit and in slices of 19 K steps (each ending
    inside a step), against the reference."""
    _needs_compiled()
    for cfg in [cfg for tile, cfg in kb._dense_sweep(int(qtype), 1, 14336) if tile == "row16"]:
        for split in (None, tk.SplitK(3, 19)):
            check_dense(qtype, n_out=4096, K=14336, rows=1, device="cuda", cfg=cfg, split=split)


@gpu
@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.MXFP4, QT.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 8])
def test_gpu_k4_dense_over_several_rows(qtype: QT, rows: int) -> None:
    """The lanes-along-K dense tile at 1-8 rows, planar Q8_0's one row too (MXFP4 and Q8_0 at K = 2880:
    a partial last step)."""
    _needs_compiled()
    K = 2880 if qtype in (QT.MXFP4, QT.Q8_0) else 2048
    check_dense(qtype, n_out=4096, K=K, rows=rows, device="cuda", laid_out=True, tile="row_kquant")


@gpu
def test_gpu_dense_replays_in_a_cuda_graph() -> None:
    """The split-K semaphores are left at zero by every launch: a graph replayed many times
    gives the eager result every time."""
    _needs_compiled()
    rng = np.random.default_rng(0)
    raw = _random_raw(rng, QT.Q4_K, (1, 4096, 2048), 2048 ** -0.5).cuda()
    x = torch.randn(2, 2048, device="cuda")
    want = tk.dense(x, raw, QT.Q4_K, 4096)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tk.dense(x, raw, QT.Q4_K, 4096)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        got = tk.dense(x, raw, QT.Q4_K, 4096)
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want)


@gpu
@pytest.mark.parametrize("qtype, rows", [(QT.Q4_K, 1), (QT.Q6_K, 1), (QT.Q8_0, 1), (QT.MXFP4, 1), (QT.F16, 8),
                                         (QT.BF16, 8), (QT.Q4_K, 8)], ids=lambda v: getattr(v, "name", str(v)))
def test_gpu_dependent_dense_products_read_their_rounding(qtype: QT, rows: int) -> None:
    """Where the device has dependent launches, the product starts while its rounding of x ends
    (one row of 16-bit weights has no rounding launch: its tile rounds x itself): a chain of
    products (each one's x the last one's result), captured in a graph and replayed on changing
    x, gives bit for bit the same products with the device synchronized between the rounding
    and the product."""
    _needs_compiled()
    if not tk.dependent_launches("cuda"):
        pytest.skip("no programmatic dependent launch on this GPU or Triton")
    K, links = 2048, 4
    rng = np.random.default_rng(rows)
    raw = kernel_layout(_random_raw(rng, qtype, (1, K, K), K ** -0.5), qtype).cuda()

    def serial(x: torch.Tensor) -> torch.Tensor:
        for _ in range(links):
            xr = tk.round_rows(x, qtype)
            torch.cuda.synchronize()
            x = tk._dense_product(xr, raw, qtype, K)
            torch.cuda.synchronize()
        return x

    def chained(x: torch.Tensor) -> torch.Tensor:
        for _ in range(links):
            x = tk.dense(x, raw, qtype, K)
        return x

    check_chain_replays(chained, serial, [torch.randn(rows, K, device="cuda") for _ in range(3)])


@interp
def test_interpreter_concatenated_linears_give_each_part_s_rows(monkeypatch) -> None:
    """Linear.concat (q, k and v in one product): the parts' outputs side by side, for decode rows
    (one dense launch; its split over K follows the fused height, so float32 order) and prefill
    rows (the decoded weights are the parts' own: bit-equal on the CPU); a part without a bias
    adds zeros; the parts give their GPU copies up. Q6_K: padded rows concatenate too."""
    from engine.layers.linear import Linear

    qtype = QT.Q6_K
    monkeypatch.setenv("MOESTUDIO_TRITON", "force")
    rng = np.random.default_rng(7)
    K, heights = 512, (64, 16, 16)
    parts = []
    for n, with_bias in zip(heights, (True, False, True)):
        raw = _random_raw(rng, qtype, (1, n, K), K ** -0.5)[0]
        bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32)) if with_bias else None
        parts.append(Linear(raw, qtype, (n, K), bias, "cpu"))
    xs = [torch.from_numpy(rng.standard_normal((rows, K)).astype(np.float32)) for rows in (1, 3, tk.DENSE_MAX_ROWS + 4)]
    expected = [torch.cat([p(x) for p in parts], dim=-1) for x in xs]
    fused = Linear.concat(parts)
    assert fused is not None and fused.shape == (sum(heights), K)
    assert all(p.raw is None for p in parts)
    for x, want in zip(xs[:2], expected[:2]):
        assert rel_err(fused(x), want) < REL_TOL
    assert torch.equal(fused(xs[2]), expected[2])
    monkeypatch.setenv("MOESTUDIO_TRITON", "0")  # decoded to float32: nothing to fuse
    plain = [Linear(_random_raw(rng, qtype, (1, 16, K), 0.1)[0], qtype, (16, K), None, "cpu") for _ in range(2)]
    assert Linear.concat(plain) is None
