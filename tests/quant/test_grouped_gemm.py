"""The grouped expert GEMM (engine/quant/grouped_gemm.py) against the torch many-row path.

Without a GPU, Triton's interpreter runs the kernels on CPU tensors at small shapes; on the GPU
machine `python -m pytest -q -m gpu tests/quant/test_grouped_gemm.py` runs them compiled at the
Qwen3-30B-A3B expert shape (2048 x 768, top-8) with 512 tokens, and through the hybrid executor.

The contract (the decode kernels' one): each kernel within 2e-5 of its output's largest
magnitude of the torch path on identical inputs (float32 summation order only: the tensor-core
operands are exact, see the module's docstring); the whole step within 1e-3, since h's float
order may move one rounding step of one activation value.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

pytest.importorskip("triton")

from engine.layers.moe import SILU, SWIGLU_OAI, activate, expert_ffn  # noqa: E402
from engine.quant import grouped_gemm as gg  # noqa: E402
from engine.quant import triton_kernels as tk  # noqa: E402
from engine.quant.activation import round_activation  # noqa: E402
from engine.quant.layout import dequantize_layout, kernel_layout  # noqa: E402
from tests.quant.test_triton_kernels import _random_raw, make_weights, rel_err, weights_to  # noqa: E402

interp = pytest.mark.skipif(not tk.INTERPRETED, reason="interpreter tests run where there is no GPU")
gpu = pytest.mark.gpu
REL_TOL = 2e-5


class Step:
    """A many-row layer step: T tokens x top-k of n_expert experts held in permuted slots."""

    def __init__(self, w, n_tok: int, k: int, device, seed: int = 0, skip: int = 0):
        g = torch.Generator().manual_seed(seed)
        n_expert, n_embd = w.n_expert, w.gate.shape[2]
        self.w = weights_to(w, device)
        self.x = (torch.randn(n_tok, n_embd, generator=g) * 2.0).to(device)
        self.ids = torch.stack([torch.randperm(n_expert, generator=g)[:k] for _ in range(n_tok)])
        self.weights = torch.rand(n_tok, k, generator=g).to(device)
        perm = torch.randperm(n_expert, generator=g)  # slot -> expert
        # laid out as LayerSlots holds them (Q6_K padded to 224-byte blocks)
        self.buffers = [kernel_layout(t.raw[perm].contiguous(), t.qtype).to(device) for t in (w.gate, w.up, w.down)]
        self.slot_of = np.argsort(perm.numpy()).astype(np.int32)
        self.slot_of[:skip] = -1  # experts 0 .. skip - 1: not in this batch (their pairs stay zero)
        self.device = device
        self._mats: dict[int, tuple] = {}

    def mats(self, e: int):
        """Expert e's float32 gate, up and down, dequantized from its slot (once)."""
        if e not in self._mats:
            s = int(self.slot_of[e])
            self._mats[e] = tuple(dequantize_layout(b[s], t.qtype, t.shape[1:])
                                  for b, t in zip(self.buffers, (self.w.gate, self.w.up, self.w.down)))
        return self._mats[e]

    def reference(self) -> torch.Tensor:
        """per_slot [k, T, D] from the torch many-row path (hybrid._run_on_accelerator)."""
        out = torch.zeros(self.ids.shape[1], *self.x.shape, device=self.device)
        for e in np.nonzero(self.slot_of >= 0)[0].tolist():
            tok, pos = torch.nonzero(self.ids == e, as_tuple=True)
            if len(tok):
                tok, pos = tok.to(self.device), pos.to(self.device)
                out[pos, tok] = expert_ffn(self.x[tok], *self.mats(e), self.w, e) * self.weights[tok, pos, None]
        return out

    def h_reference(self, groups: gg.Groups) -> torch.Tensor:
        """h per live padded row, as the torch path forms it."""
        w, tok = self.w, groups.row_tok.long().cpu()
        h = torch.zeros(len(tok), w.gate.shape[1], device=self.device)
        ids = self.ids
        for row in torch.nonzero(tok >= 0)[:, 0].tolist():
            t, j = int(tok[row]), int(groups.row_pos[row])
            e = int(ids[t, j])
            gate, up, _ = self.mats(e)
            xr = self.x[t:t + 1]
            g = round_activation(xr, w.gate.qtype) @ gate.T
            u = round_activation(xr, w.up.qtype) @ up.T
            if w.gate.bias is not None:
                g, u = g + w.gate.bias[e], u + w.up.bias[e]
            h[row] = activate(w.activation, g, u)[0]
        return h

    def down_reference(self, groups: gg.Groups, h: torch.Tensor) -> torch.Tensor:
        """per_slot from the kernel's own h (so down is held to its own tolerance)."""
        w, tok = self.w, groups.row_tok.long().cpu()
        out = torch.zeros(self.ids.shape[1], *self.x.shape, device=self.device)
        for row in torch.nonzero(tok >= 0)[:, 0].tolist():
            t, j = int(tok[row]), int(groups.row_pos[row])
            e = int(self.ids[t, j])
            y = round_activation(h[row:row + 1], w.down.qtype) @ self.mats(e)[2].T
            if w.down.bias is not None:
                y = y + w.down.bias[e]
            out[j, t] = y[0] * self.weights[t, j]
        return out


def check_step(step: Step, cfg: gg.GroupedConfig | None, per_kernel: bool = True) -> float:
    """The whole step, and with per_kernel each kernel on its own inputs; cfg None: the defaults."""
    w = step.w
    out = torch.zeros(step.ids.shape[1], *step.x.shape, device=step.device)
    gg.experts_forward(step.x, step.buffers, w, step.ids.numpy(), step.slot_of, step.weights, out, cfg, cfg)
    err = rel_err(out, step.reference())
    # Each kernel keeps the decode kernels' 2e-5 (below); the whole step compounds their float32
    # order through h's Q8 rounding, where one flipped quant step moves a value: measured
    # 1.1-1.3e-3 at 512 tokens on the H200 (Q4_K, Q5_K, BF16, Q4_K_M experts).
    assert err < 2e-3, f"whole step: relative error {err:.2e}"
    if per_kernel:
        block_m = cfg.block_m if cfg else gg.GATE_UP_CONFIG[w.gate.qtype].block_m
        groups = gg.Groups.build(step.ids.numpy(), step.slot_of, block_m, step.device)
        xg = tk.round_rows(step.x, w.gate.qtype, grouped=True)
        xu = tk.round_rows(step.x, w.up.qtype, grouped=True)
        h = gg.gate_up(xg, xu, step.buffers[0], step.buffers[1], w, groups, cfg)
        live = groups.row_tok >= 0
        err_h = rel_err(h[live], step.h_reference(groups)[live])
        assert err_h < REL_TOL, f"gate/up + activation: relative error {err_h:.2e}"
        out2 = torch.zeros_like(out)
        gg.down(tk.round_rows(h, w.down.qtype, grouped=True), step.buffers[2], w, groups, step.weights, out2, cfg)
        assert torch.equal(out, out2), "experts_forward differs from its parts"
        err_d = rel_err(out2, step.down_reference(groups, h))
        assert err_d < REL_TOL, f"down: relative error {err_d:.2e}"
    return err


# ------------------------------------------------------------------------------ layout

def test_groups_pad_each_slot_run_to_the_tile() -> None:
    ids = np.array([[0, 2], [2, 1], [0, 2], [3, 0]])
    slot_of = np.array([5, -1, 1, 3], np.int32)  # expert 1 not in the batch
    g = gg.Groups.build(ids, slot_of, 2, "cpu")
    # slot 1 (expert 2): 3 rows -> 2 tiles; slot 3 (expert 3): 1 row -> 1 tile; slot 5 (expert 0): 3 -> 2
    assert g.tile_slot.tolist() == [1, 1, 3, 5, 5]
    assert g.tile_exp.tolist() == [2, 2, 3, 0, 0]
    assert g.row_tok.tolist() == [0, 1, 2, -1, 3, -1, 0, 2, 3, -1]
    assert g.row_pos.tolist() == [1, 0, 1, -1, 0, -1, 0, 0, 1, -1]
    empty = gg.Groups.build(ids, np.full(4, -1, np.int32), 2, "cpu")
    assert empty.tiles == 0 and empty.row_tok.numel() == 0


# ------------------------------------------------------------------------------ interpreter tests

SMALL = gg.GroupedConfig(16, 64)
# (gate, up, down) types, (n_embd, n_ff): K tails for the block types whose rows need not fill
# a 256-value step (Q8_0, MXFP4, F16, BF16), partial N tiles everywhere but Q5_K, Q6_K rows of
# two padded blocks (gate/up in "Q6_K", down in "Q4_K-Q4_K-Q6_K").
INTERP_CASES = {
    "Q4_K": ((QT.Q4_K,) * 3, 256, 256),
    "Q5_K": ((QT.Q5_K,) * 3, 256, 256),
    "Q6_K": ((QT.Q6_K,) * 3, 512, 256),
    "Q8_0": ((QT.Q8_0,) * 3, 288, 96),
    "F16": ((QT.F16,) * 3, 288, 80),
    "BF16": ((QT.BF16,) * 3, 288, 80),
    "Q4_K-Q4_K-Q6_K": ((QT.Q4_K, QT.Q4_K, QT.Q6_K), 256, 512),
    "Q8_0-Q6_K-F16": ((QT.Q8_0, QT.Q6_K, QT.F16), 256, 256),
}


@interp
@pytest.mark.parametrize("name", list(INTERP_CASES))
def test_interpreter_matches_torch_path(name: str) -> None:
    qtypes, n_embd, n_ff = INTERP_CASES[name]
    w = make_weights(qtypes, n_expert=4, n_embd=n_embd, n_ff=n_ff, seed=len(name))
    # 9 tokens x top-2 of 4 experts (one left out): runs of 3-7 rows in tiles of 16
    check_step(Step(w, n_tok=9, k=2, device="cpu", seed=1, skip=1), SMALL)


@interp
def test_interpreter_mxfp4_swiglu_with_biases() -> None:
    # MXFP4 runs slowly in the interpreter (its e2m1 table lookups are emulated byte by byte)
    w = make_weights((QT.MXFP4,) * 3, n_expert=3, n_embd=64, n_ff=96, activation=SWIGLU_OAI, bias=True, seed=3)
    check_step(Step(w, n_tok=5, k=2, device="cpu", seed=2), gg.GroupedConfig(16, 64))


@interp
def test_interpreter_runs_longer_than_a_tile() -> None:
    # 40 tokens x top-2 of 3 experts: runs of ~27 rows, two M tiles each, the second partial
    w = make_weights((QT.Q8_0,) * 3, n_expert=3, n_embd=64, n_ff=64, seed=5)
    check_step(Step(w, n_tok=40, k=2, device="cpu", seed=6), gg.GroupedConfig(16, 64), per_kernel=False)


def check_dense(qtype: QT, n_out: int, K: int, rows: int, device: str, cfg: gg.GroupedConfig | None = None) -> float:
    """gg.dense over a dense weight in the kernels' layout (Linear's copy: Q6_K padded) against
    round_activation(x) @ dequantize(W).T."""
    rng = np.random.default_rng(int(qtype) + n_out + rows)
    raw = _random_raw(rng, qtype, (1, n_out, K), K ** -0.5)
    x = torch.from_numpy(rng.standard_normal((rows, K)).astype(np.float32) * 2.0).to(device)
    want = round_activation(x, qtype) @ dequantize_layout(raw[0], qtype, (n_out, K)).to(device).T
    got = gg.dense(x, kernel_layout(raw, qtype).to(device), qtype, cfg)
    assert got.shape == want.shape
    err = rel_err(got, want)
    assert err < REL_TOL, (qtype.name, rows, err)
    return err


@interp
@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q8_0, QT.BF16], ids=lambda t: t.name)
def test_interpreter_dense_matches_reference(qtype: QT) -> None:
    # 40 rows: three tiles of 16, the last partial; 80 output rows: a partial N tile; K-quants
    # two K steps (Q6_K's blocks padded), the others a partial last step
    K = 512 if qtype in (QT.Q4_K, QT.Q5_K, QT.Q6_K) else 352
    check_dense(qtype, n_out=80, K=K, rows=40, device="cpu", cfg=SMALL)


@interp
@pytest.mark.parametrize("n_tok, k, n_expert, n_slots, bm", [(37, 4, 12, 12, 8), (300, 8, 128, 128, 32),
                                                          (5, 2, 6, 9, 16), (130, 6, 200, 200, 32)])
def test_groups_laid_out_on_the_device_as_on_the_host(n_tok, k, n_expert, n_slots, bm) -> None:
    """Groups.on_device (three launches, no read-back of the routing) gives build's tables, then
    dead tiles up to the most a step of these pairs can have, and the rows of each expert: one
    expert no pair goes to (its slot has no tile), slots in another order than the experts, more
    slots than experts (the extra ones empty), pair blocks over many slots. Every table starts on
    a 16-byte boundary, whatever the counts: Triton compiles a kernel variant per alignment."""
    g = torch.Generator().manual_seed(n_tok)
    ids = torch.stack([torch.randperm(n_expert - 1, generator=g)[:k] for _ in range(n_tok)])
    ids[ids >= 1] += 1  # expert 1 has no pair
    exp_of_slot = torch.full((n_slots,), -1, dtype=torch.int32)
    exp_of_slot[torch.randperm(n_slots, generator=g)[:n_expert]] = torch.arange(n_expert, dtype=torch.int32)
    slot_of = torch.zeros(n_expert, dtype=torch.int32)
    slot_of[exp_of_slot[exp_of_slot >= 0].long()] = torch.nonzero(exp_of_slot >= 0).flatten().int()
    host = gg.Groups.build(ids.numpy(), slot_of.numpy(), bm, "cpu")
    dev, expert_rows = gg.Groups.on_device(ids, slot_of, exp_of_slot, bm)
    n, rows = host.tiles, host.tiles * bm
    assert dev.tiles == (n_tok * k + min(n_slots, n_tok * k) * (bm - 1)) // bm >= n
    assert torch.equal(dev.tile_slot[:n], host.tile_slot) and torch.equal(dev.tile_exp[:n], host.tile_exp)
    assert (dev.tile_slot[n:] == -1).all() and (dev.tile_exp[n:] == -1).all()
    assert torch.equal(dev.row_tok[:rows], host.row_tok) and torch.equal(dev.row_pos[:rows], host.row_pos)
    assert (dev.row_tok[rows:] == -1).all() and (dev.row_pos[rows:] == -1).all()
    assert torch.equal(expert_rows, torch.bincount(ids.flatten(), minlength=n_expert).int())
    for groups in (host, dev):
        tables = (groups.row_tok, groups.row_pos, groups.tile_slot, groups.tile_exp)
        assert all(t.data_ptr() % 16 == 0 for t in tables), [t.data_ptr() % 16 for t in tables]
    assert expert_rows.data_ptr() % 16 == 0


@interp
def test_interpreter_groups_on_the_device_compute_the_same() -> None:
    w = make_weights((QT.Q8_0,) * 3, n_expert=4, n_embd=64, n_ff=64, seed=7)
    step = Step(w, n_tok=21, k=2, device="cpu", seed=3)
    cfg = gg.GroupedConfig(16, 64)
    want, got = torch.zeros(2, 21, 64), torch.zeros(2, 21, 64)
    gg.experts_forward(step.x, step.buffers, step.w, step.ids.numpy(), step.slot_of, step.weights, want, cfg, cfg)
    groups, _ = gg.Groups.on_device(step.ids, torch.from_numpy(step.slot_of),
                                    torch.from_numpy(np.argsort(step.slot_of)).int(), cfg.block_m)
    assert groups.tiles > gg.Groups.build(step.ids.numpy(), step.slot_of, 16, "cpu").tiles  # dead tiles return at once
    gg.groups_forward(step.x, step.buffers, step.w, groups, step.weights, got, cfg, cfg)
    assert torch.equal(got, want)


def test_grouped_kernels_refuse_rows_rounded_without_block_sums() -> None:
    w = make_weights((QT.Q4_K,) * 3, 2, 256, 256)
    step = Step(w, 2, 1, "cpu")
    groups = gg.Groups.build(step.ids.numpy(), step.slot_of, 16, "cpu")
    x = tk.round_rows(step.x, QT.Q4_K)  # the decode kernels' rounding: no sums
    with pytest.raises(ValueError, match="grouped=True"):
        gg.gate_up(x, x, step.buffers[0], step.buffers[1], step.w, groups, SMALL)


def test_supports_what_the_decode_kernels_support() -> None:
    w = make_weights((QT.Q4_K,) * 3, 2, 256, 256)
    assert gg.supports(w) == tk.available()
    assert gg.GROUPED_TYPES == tk.KERNEL_TYPES


def test_the_plan_reserves_the_padded_rows_of_these_tiles() -> None:
    from engine.plan.sizing import GROUPED_BLOCK_M

    assert {c.block_m for c in (*gg.GATE_UP_CONFIG.values(), *gg.DOWN_CONFIG.values())} == {GROUPED_BLOCK_M}


def test_tiles_of_gate_up_and_down_must_agree() -> None:
    w = make_weights((QT.Q8_0,) * 3, 2, 64, 64)
    step = Step(w, 2, 1, "cpu")
    with pytest.raises(ValueError, match="block_m"):
        gg.experts_forward(step.x, step.buffers, step.w, step.ids.numpy(), step.slot_of, step.weights,
                           torch.zeros(1, 2, 64), gg.GroupedConfig(16, 32), gg.GroupedConfig(32, 32))


@pytest.mark.slow
def test_kernels_compile_for_hopper_on_tensor_cores_without_spills() -> None:
    """Every grouped launch of every standard geometry compiles for sm_90 (no GPU needed:
    Triton ships ptxas), multiplies on the tensor cores (32-row tiles: mma.sync, not wgmma) and
    spills nothing at its default tile; so do the prompt's dense products at their own tiles and
    the layout kernels at 16 to 512 slots."""
    import json
    import subprocess
    import sys

    from engine.quant.triton_aot import LAYOUT_SLOTS, STANDARD_GEOMETRIES

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "engine.quant.triton_aot", "--grouped", "--json"],
                          capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0 and ("ptxas" in proc.stderr or "backend" in proc.stderr.lower()):
        pytest.skip(f"this Triton cannot compile for CUDA here: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {(r["geometry"], r["kernel"]) for r in rows} == (
        {(g, f"grouped {k}") for g in STANDARD_GEOMETRIES for k in ("gate_up", "down")}
        | {(t.name, "prompt dense") for t, cfg in gg.DENSE_CONFIG.items() if cfg != gg.DOWN_CONFIG[t]}
        | {(f"{ns} slots", f"layout {k}") for ns in LAYOUT_SLOTS for k in ("rank", "plan", "scatter")})
    for r in rows:
        assert r["mma"] or r["kernel"].startswith("layout"), f"{r['geometry']} {r['kernel']}: no tensor-core product"
        assert r["spill_ops"] == 0 and r["local"] == 0, f"{r['geometry']} {r['kernel']} spills: {r}"


# ------------------------------------------------------------------------------ the hybrid hook

def _hook(make_model, arch: str, qtype: QT, device: str, monkeypatch, mode: str, n_tok: int):
    """One many-row layer step of HybridExperts (hits and uploads, at least n_tok tokens) under
    MOESTUDIO_TRITON=mode, and on the torch path; the grouped GEMM's calls are counted."""
    from engine.models import build_model
    from engine.moe.hybrid import TRITON_MAX_PAIRS, HybridExperts, HybridOptions

    model = build_model(make_model(arch, qtype), device)
    cfg = model.config
    # hits and uploads (about half the pairs each: 96 of 192, sd 7) both beyond the decode kernels' batch
    n_tok = max(n_tok, 3 * TRITON_MAX_PAIRS // cfg.n_expert_used)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n_tok, cfg.n_embd, generator=g).to(device)
    ids = torch.stack([torch.randperm(cfg.n_expert, generator=g)[:cfg.n_expert_used]
                       for _ in range(n_tok)]).to(device)
    weights = torch.rand(n_tok, cfg.n_expert_used, generator=g).to(device)
    calls, outs = [], []
    forward = gg.experts_forward
    monkeypatch.setattr(gg, "experts_forward", lambda *a, **kw: (calls.append(mode), forward(*a, **kw)))
    for m in (mode, "0"):
        monkeypatch.setenv("MOESTUDIO_TRITON", m)
        hybrid = HybridExperts(model.expert_weights, device,
                               HybridOptions(slots_per_layer=cfg.n_expert // 2, miss_fraction=1.0, policy="off"))
        try:
            hybrid.prefill_residency([(layer, e) for layer in hybrid.layer_ids for e in range(cfg.n_expert // 2)])
            outs.append(hybrid(hybrid.layer_ids[0], x, ids, weights))
            c = hybrid.counters
            assert c.gpu_hit.sum() > 0 and c.uploaded.sum() > 0 and c.cpu_computed.sum() == 0
        finally:
            hybrid.close()
    assert len(calls) >= 2, "hits and uploads: through the grouped GEMM (none with MOESTUDIO_TRITON=0)"
    return outs


@pytest.fixture
def small_q8_0_tiles(monkeypatch):
    """16-row tiles for Q8_0: the interpreter's hybrid steps stay a few tiles."""
    monkeypatch.setitem(gg.GATE_UP_CONFIG, QT.Q8_0, gg.GroupedConfig(16, 64))
    monkeypatch.setitem(gg.DOWN_CONFIG, QT.Q8_0, gg.GroupedConfig(16, 64))


@interp
@pytest.mark.slow
def test_interpreter_hybrid_many_rows_match_torch_path(make_model, monkeypatch, small_q8_0_tiles) -> None:
    got, want = _hook(make_model, "qwen3moe", QT.Q8_0, "cpu", monkeypatch, "force", n_tok=48)
    assert rel_err(got, want) < 1e-3, rel_err(got, want)


def _steps_without_read_back(make_model, device: str, monkeypatch, mode: str, resident: int) -> list[torch.Tensor]:
    """Both MoE layers of a tiny model (8 experts, 8 staging slots) with `resident` experts in
    slots, at a step large enough that every expert is all but certain to be chosen: under
    MOESTUDIO_TRITON=mode each layer is laid out on the device and reads nothing back, streaming
    the experts it lacks in turns of 4 (half the staging slots), the second layer's first turn
    copied during the first layer's step; then on the torch path (read-back, misses routed by
    cost). The counters (hits, uploads) are learnt by the last MoE layer. Returns both paths'
    outputs of the two layers."""
    from engine.models import build_model
    from engine.moe.hybrid import HybridExperts, HybridOptions
    from engine.moe.tune import RouteCosts

    model = build_model(make_model("qwen3moe", QT.Q8_0), device)
    cfg = model.config
    n_tok = 40  # 80 pairs: the grouped GEMM's, 10 an expert on average
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n_tok, cfg.n_embd, generator=g).to(device)
    ids = torch.stack([torch.randperm(cfg.n_expert, generator=g)[:cfg.n_expert_used] for _ in range(n_tok)])
    weights = torch.rand(n_tok, cfg.n_expert_used, generator=g).to(device)
    costs = RouteCosts(upload_s=1e-5, cpu_s=1e-3, cpu_row_s=1e-4, gpu_s=1e-5)  # streaming pays
    outs = []
    for m in (mode, "0"):
        monkeypatch.setenv("MOESTUDIO_TRITON", m)
        hybrid = HybridExperts(model.expert_weights, device, HybridOptions(
            slots_per_layer=resident, miss_fraction=1.0, policy="lru", top_k=cfg.n_expert_used, route_costs=costs))
        first, last = hybrid.layer_ids[0], hybrid.layer_ids[-1]
        read_backs, staged = [], []
        read_back = hybrid._read_back
        monkeypatch.setattr(hybrid, "_read_back", lambda *a: (read_backs.append(1), read_back(*a))[1])
        for layer in (first, last):
            slots = hybrid.layers[layer].slots
            stage = slots.stage_async
            monkeypatch.setattr(slots, "stage_async", lambda e, first=0, stage=stage, layer=layer: (
                staged.append((layer, sorted(e))), stage(e, first))[1])
        try:
            hybrid.prefill_residency([(layer, e) for layer in hybrid.layer_ids for e in range(resident)])
            outs.append(hybrid(first, x, ids.to(device), weights))
            turns = [list(range(a, min(a + 4, cfg.n_expert))) for a in range(resident, cfg.n_expert, 4)]
            if m == mode:
                assert staged == [(first, t) for t in turns] + [(last, t) for t in turns[:1]]  # the last: ahead
                assert not read_backs and hybrid.counters.gpu_hit.sum() == hybrid.counters.uploaded.sum() == 0
            outs.append(hybrid(last, x, ids.to(device), weights))
            c = hybrid.counters
            if m == mode:
                assert not read_backs and staged == [(layer, t) for layer in (first, last) for t in turns]
                rows = np.bincount(ids.reshape(-1).numpy(), minlength=cfg.n_expert)
                assert c.gpu_hit.tolist() == [int(rows[:resident].sum())] * 2
                assert c.uploaded.tolist() == [int(rows[resident:].sum())] * 2 and c.cpu_computed.sum() == 0
                route = "resident" if resident == cfg.n_expert else "streamed"
                assert c.prompt_steps == {"streamed": 0, "resident": 0, "read back": 0, route: 2}
                L = hybrid.layers[first]
                if resident < cfg.n_expert:  # a refill, as a policy makes after a learnt step: once landed,
                    hybrid.copier.wait(L.slots.load([(0, cfg.n_expert - 1)]))  # the next step serves it
                    staged.clear()
                    again = hybrid(first, x, ids.to(device), weights)
                    streamed = sorted(e for layer, turn in staged if layer == first for e in turn)
                    assert not L.slots.pending and streamed == np.flatnonzero(L.slots.resident < 0).tolist()
                    assert rel_err(again, outs[0]) < 1e-6
        finally:
            hybrid.close()
    return outs


@interp
@pytest.mark.slow
def test_interpreter_large_steps_do_not_read_the_routing_back(make_model, monkeypatch, small_q8_0_tiles) -> None:
    """Two turns streamed beside the resident experts (the GPU test also runs all resident and one turn)."""
    outs = _steps_without_read_back(make_model, "cpu", monkeypatch, "force", resident=2)
    for got, want in zip(outs[:2], outs[2:]):
        assert rel_err(got, want) < 1e-3, rel_err(got, want)


@interp
@pytest.mark.slow  # five interpreted launches of 128 rows
def test_interpreter_routing_costs_time_the_grouped_gemm(make_model, monkeypatch) -> None:
    """measure_costs (engine/moe/tune.py) times the accelerator's side of a many-row step through
    the path that step takes: with the grouped GEMM on, GROUPED_EXPERTS experts of MANY_ROWS rows
    in one launch, laid out once (two experts here, still beyond the decode kernels' pairs: the
    interpreter is slow)."""
    from engine.models import build_model
    from engine.moe import tune
    from engine.moe.cpu_pool import CpuExpertPool
    from engine.moe.tune import MANY_ROWS, measure_costs

    GROUPED_EXPERTS = 2
    monkeypatch.setattr(tune, "GROUPED_EXPERTS", GROUPED_EXPERTS)

    calls = []
    forward = gg.groups_forward
    monkeypatch.setattr(gg, "groups_forward", lambda *a, **kw: (calls.append(a[0].shape[0]), forward(*a, **kw)))
    monkeypatch.setitem(gg.GATE_UP_CONFIG, QT.Q8_0, gg.GroupedConfig(64, 64))
    monkeypatch.setitem(gg.DOWN_CONFIG, QT.Q8_0, gg.GroupedConfig(64, 64))
    monkeypatch.setenv("MOESTUDIO_TRITON", "force")
    model = build_model(make_model("qwen3moe", QT.Q8_0))
    layer = min(model.expert_weights)
    pool = CpuExpertPool(model.expert_weights, 1)
    try:
        t = measure_costs(layer, model.expert_weights[layer], torch.device("cpu"), pool)
    finally:
        pool.close()
    assert calls and set(calls) == {GROUPED_EXPERTS * MANY_ROWS}, calls  # rows of one launch
    assert t["gpu_s"] > 0


# ------------------------------------------------------------------------------ GPU tests

GPU_TYPES = [QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q8_0, QT.MXFP4, QT.F16, QT.BF16]
GPU_CASES = {
    # Qwen3-30B-A3B experts: 2048 x 768, top-8, silu; 32 experts so runs are ~128 rows at 512 tokens
    **{f"qwen3-{t.name}": ((t,) * 3, 2048, 768, 32, 8, SILU, False) for t in GPU_TYPES},
    "qwen3-Q4_K_M": ((QT.Q4_K, QT.Q4_K, QT.Q6_K), 2048, 768, 32, 8, SILU, False),
    "gpt-oss-MXFP4": ((QT.MXFP4,) * 3, 2880, 2880, 16, 4, SWIGLU_OAI, True),
}


def _needs_compiled():
    if tk.INTERPRETED:
        pytest.skip("kernels were imported in interpreter mode")


@gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_matches_torch_path(name: str) -> None:
    _needs_compiled()
    qtypes, n_embd, n_ff, n_expert, k, act, bias = GPU_CASES[name]
    w = make_weights(qtypes, n_expert=n_expert, n_embd=n_embd, n_ff=n_ff, activation=act, bias=bias, seed=1)
    # the per-row references of h and down loop in Python: 64 tokens for them, 512 for the whole step
    check_step(Step(w, n_tok=64, k=k, device="cuda", seed=1, skip=1), None)
    print(name, f"{check_step(Step(w, 512, k, 'cuda', seed=2), None, per_kernel=False):.1e}")


@gpu
@pytest.mark.parametrize("qtype", GPU_TYPES, ids=lambda t: t.name)
def test_gpu_dense_matches_reference(qtype: QT) -> None:
    """A prompt chunk's dense products at Qwen3-30B-A3B shapes: the fused q/k/v (2048 -> 5120)
    and the output projection (4096 -> 2048), 512 rows and a partial tile's 77."""
    _needs_compiled()
    for n_out, K in ((5120, 2048), (2048, 4096)):
        for rows in (512, 77):
            check_dense(qtype, n_out, K, rows, "cuda")


@gpu
@pytest.mark.parametrize("cfg", [gg.GroupedConfig(32, 64, 4), gg.GroupedConfig(64, 128, 8),
                                 gg.GroupedConfig(128, 64, 8)],
                         ids=lambda c: f"m{c.block_m}n{c.block_n}w{c.num_warps}")
@pytest.mark.parametrize("qtypes", [(QT.Q4_K, QT.Q4_K, QT.Q6_K), (QT.Q8_0,) * 3], ids=["Q4_K_M", "Q8_0"])
def test_gpu_other_tiles(cfg: gg.GroupedConfig, qtypes) -> None:
    """Any tile the benchmark sweeps computes the same thing."""
    _needs_compiled()
    w = make_weights(qtypes, n_expert=16, n_embd=2048, n_ff=768, seed=7)
    check_step(Step(w, n_tok=256, k=8, device="cuda", seed=7), cfg, per_kernel=False)


@gpu
@pytest.mark.parametrize("arch,qtype", [("qwen3moe", QT.Q4_K), ("gpt-oss", QT.MXFP4), ("llama", QT.Q6_K),
                                        ("olmoe", QT.Q8_0)])
def test_gpu_hybrid_many_rows_match_torch_path(make_model, monkeypatch, arch, qtype) -> None:
    _needs_compiled()
    pytest.importorskip("llama_cpp", reason="the synthetic models and the CPU pool need llama-cpp-python's ggml")
    got, want = _hook(make_model, arch, qtype, "cuda", monkeypatch, "1", n_tok=64)
    assert rel_err(got, want) < 1e-3, rel_err(got, want)


@gpu
@pytest.mark.parametrize("resident", [8, 6, 2], ids=["all resident", "one turn streamed", "two turns streamed"])
def test_gpu_large_steps_do_not_read_the_routing_back(make_model, monkeypatch, resident) -> None:
    _needs_compiled()
    pytest.importorskip("llama_cpp", reason="the synthetic models and the CPU pool need llama-cpp-python's ggml")
    outs = _steps_without_read_back(make_model, "cuda", monkeypatch, "1", resident)
    for got, want in zip(outs[:2], outs[2:]):
        assert rel_err(got, want) < 1e-3, rel_err(got, want)
