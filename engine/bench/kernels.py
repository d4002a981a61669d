"""`moestudio bench kernels`: the GPU decode kernels alone, at the factory's real shapes.

For every kernel of one-token and small-batch decode, each weight type the engine loads on the
GPU and 1, 2, 4, 8 activation rows:
- dense products (engine/quant/triton_kernels.dense: attention projections, output head,
  shared experts, dense FFNs), the split-K kernel (`new`) next to the kernel it replaced
  (`old`: the expert down kernel with one pair per row), so the speedup is a same-run ratio;
- one MoE layer's expert step (round x; gate/up + activation; down x routing weight) from slot
  buffers laid out as engine/moe/slots.LayerSlots holds them.
Each figure is GPU time per call from a CUDA graph of many calls replayed (no launch gaps), the
bytes of weights read, GB/s, and the share of the device-to-device copy bandwidth measured in
the same run. Consecutive calls read other copies of the weights (at least 4x the L2 cache in
all), so the weights come from HBM, not L2.

`--only grouped`: the prefill expert step, the grouped GEMM (engine/quant/grouped_gemm.py) over
a Qwen3-30B-A3B layer (128 experts, top-8, 2048 x 768; MXFP4: gpt-oss-120b's, 128 experts,
top-4, 2880 x 2880, biases) at 512 and 4,096 tokens (`--tokens`):
achieved TFLOP/s of its four launches from a replayed graph, the whole call eager (with the
host's grouping of pairs), and beside them the torch path it replaces (each expert dequantized,
then matmul; eager: it reads the routing on the host). Results: JSON and markdown tables (kernels.json is
saved after each row group, `"partial": true` until the run ends).

`--only prompt`: a prompt's dense products (grouped_gemm.dense: Qwen3-30B-A3B's fused q/k/v
and output projection) at the same prompt lengths: TFLOP/s from a replayed graph, beside cuBLAS's
bf16 product of the same shape (the route of a dequantize-to-bf16 scratch, the decode of W not
counted) and the exact float32 product; `--sweep` times taller tiles.

`--llama-ops PATH` (or MOESTUDIO_LLAMA_OPS): llama.cpp's test-backend-ops then times its own
MUL_MAT / MUL_MAT_ID perf cases that have one of our rows' type, shape and row count
(engine/bench/llama_ops.py), printed beside ours with the ratio per byte.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from gguf import GGMLQuantizationType as QT

from engine.bench import llama_ops
from engine.errors import UserError
from engine.quant.layout import CHANGED_LAYOUTS
from engine.runtime.device_time import graph_us

if TYPE_CHECKING:
    import torch

KINDS = ("dense", "experts", "grouped", "prompt")
ALL_TYPES = (QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q8_0, QT.MXFP4, QT.F16, QT.BF16)
ROWS = (1, 2, 4, 8)

# Dense products at decode: (geometry, tensor) -> (output rows, K).
DENSE_SHAPES: dict[str, tuple[int, int]] = {
    "qwen3-30b-a3b attn_q": (4096, 2048),
    "qwen3-30b-a3b attn_k/v": (512, 2048),
    "qwen3-30b-a3b attn_output": (2048, 4096),
    "qwen3-30b-a3b output": (151936, 2048),
    # llama.cpp's test-backend-ops perf cases, so that `--llama-ops` compares like for like:
    "mixtral ffn_down": (4096, 14336),  # MUL_MAT 4096 x 14336, every type, n = 1, 2, 3, 4, 5, 8
    "mixtral ffn_up": (14336, 4096),  # MUL_MAT 14336 x 4096, Q4_K, n = 1, 2, 3, 4, 8
}


# The prefill expert step: the routed experts of a layer (Qwen3-30B-A3B's and gpt-oss-120b's: 128), and the
# prompt lengths timed.
GROUPED_EXPERTS = 128
GROUPED_TOKENS = (512, 4096)

# A prompt's dense products (grouped_gemm.dense): Qwen3-30B-A3B's fused q/k/v and its output
# projection -> (output rows, K).
PROMPT_DENSE_SHAPES: dict[str, tuple[int, int]] = {
    "qwen3-30b-a3b attn_qkv": (4096 + 2 * 512, 2048),
    "qwen3-30b-a3b attn_output": (2048, 4096),
}


@dataclass(frozen=True)
class ExpertScenario:
    qtypes: tuple[QT, QT, QT]  # gate, up, down
    n_embd: int
    n_ff: int
    top_k: int
    activation: str
    bias: bool


def expert_scenarios() -> dict[str, ExpertScenario]:
    """The expert steps `bench kernels` times, by name (scripts/ncu_expert_step.py profiles them too)."""
    from engine.layers.moe import SILU, SWIGLU_OAI

    out = {f"qwen3-30b-a3b {t.name}": ExpertScenario((t,) * 3, 2048, 768, 8, SILU, False)
           for t in ALL_TYPES if t != QT.MXFP4}
    out["qwen3-30b-a3b Q4_K_M"] = ExpertScenario((QT.Q4_K, QT.Q4_K, QT.Q6_K), 2048, 768, 8, SILU, False)
    out["gpt-oss-120b MXFP4"] = ExpertScenario((QT.MXFP4,) * 3, 2880, 2880, 4, SWIGLU_OAI, True)
    return out


def random_weight(rng: np.random.Generator, qtype: QT, rows: int, cols: int) -> np.ndarray:
    """Valid GGUF rows [rows, row_bytes] of a random weight (std 1/sqrt(cols))."""
    from engine.synth.randblocks import random_blocks

    std = cols ** -0.5
    if qtype == QT.F16:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * std).astype(np.float16).view(np.uint8)
    if qtype == QT.BF16:
        bits = (rng.standard_normal((rows, cols), dtype=np.float32) * std).view(np.uint32) >> 16
        return bits.astype(np.uint16).view(np.uint8)
    return random_blocks(rng, qtype, (rows, cols), std).reshape(rows, -1)


def legacy_dense(x: torch.Tensor, raw: torch.Tensor, qtype: QT, n_out: int) -> torch.Tensor:
    """The dense product as the engine ran it before the split-K kernel: the expert down
    kernel with one slot and one pair per activation row (one program per 32 weight rows and
    row, the whole K each). Kept here only as the benchmark's baseline. The down kernel is
    today's: for Q8_0 rows of whole K steps it too loads 16 bytes at a time now, so there the
    ratio counts the split over K and the shared weight reads only."""
    import torch

    from engine.quant import triton_kernels as tk

    T, K = x.shape
    out = torch.empty((1, T, n_out), dtype=torch.float32, device=x.device)
    hr = tk.round_rows(x, qtype)
    tok = torch.arange(T, dtype=torch.int32, device=x.device)
    zero = torch.zeros(T, dtype=torch.int32, device=x.device)
    cfg = tk.DOWN_CONFIG["tile"]
    tk._down_kernel[(T, math.ceil(n_out / cfg.block_n))](
        hr.padded, hr.quants, hr.scales, raw, raw.stride(0), raw.stride(1), hr.padded, hr.padded, 0,
        out, out.stride(0), out.stride(1), tok, zero, zero, zero, n_out,
        K=K, QD=int(qtype), HAS_BIAS=False, WEIGHTED=False, BLOCK_N=cfg.block_n, UNROLL=cfg.unroll,
        INTERP=tk.INTERPRETED, REV=tk.reversed_ties(), PDL=False, **tk._launch_opts(cfg))
    return out[0]


# ------------------------------------------------------------------------------ timing

def copy_gbps(dev: torch.device) -> float:
    """Device-to-device copy of 2 GiB: bytes read + written per second (best of 5), in GB/s."""
    import torch
    n = 1 << 31
    a = torch.empty(n, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        b.copy_(a)
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n / best / 1e9


def rate(nbytes: float, us: float, copy: float) -> dict:
    gbps = nbytes / us / 1e3
    return {"us": round(us, 2), "GBps": round(gbps, 1), "of_copy_bw": round(gbps / copy, 3)}


def cold_copies(nbytes: int, l2_bytes: int) -> int:
    """Copies of a weight to rotate among so that the set read is at least 4x the L2 cache."""
    return max(1, math.ceil(4 * l2_bytes / nbytes))


# ------------------------------------------------------------------------------ dense products

def bench_dense(name: str, n_out: int, K: int, qtype: QT, rows: list[int], dev: torch.device, copy: float,
                l2_bytes: int, replays: int, sweep: bool) -> list[dict]:
    import torch

    from engine.quant import triton_kernels as tk
    from engine.quant.layout import kernel_layout

    rng = np.random.default_rng(int(qtype) + n_out + K)
    # Up to 4096 distinct random rows, repeated to n_out (drawing an output head's 150k rows
    # in numpy takes longer than timing it; what the rows hold does not change the time).
    unique = torch.from_numpy(np.ascontiguousarray(random_weight(rng, qtype, min(n_out, 4096), K)))
    one = unique.repeat(math.ceil(n_out / unique.shape[0]), 1)[:n_out]
    n_copies = cold_copies(one.numel(), l2_bytes)
    weights = one.to(dev).unsqueeze(0).repeat(n_copies, 1, 1)  # [copies, n_out, row_bytes]
    raws = [weights[i:i + 1] for i in range(n_copies)]
    # a type whose GPU copy changes layout: timed in both
    laid_out = kernel_layout(weights, qtype) if qtype in CHANGED_LAYOUTS else None
    engine_raws = raws if laid_out is None else [laid_out[i:i + 1] for i in range(n_copies)]
    qw = tk.kernel_type(qtype, engine_raws[0], K)
    calls_per_graph = max(n_copies, 8)
    out = []
    for t in rows:
        x = torch.randn(t, K, device=dev)
        new = tk.dense(x, raws[0], qtype, n_out)
        old = legacy_dense(x, raws[0], qtype, n_out)
        err = ((new - old).abs().max() / old.abs().max()).item()
        split = tk.SplitK.choose(n_out, K, tk.sm_count(str(dev)), tk.dense_config(qw, t, K))

        def calls(fn, rs, *extra):  # one graph's calls, each on the next copy of the weight
            return [lambda i=i: fn(x, rs[i % n_copies], qtype, n_out, *extra) for i in range(calls_per_graph)]

        row = {"kind": "dense", "shape": name, "n_out": n_out, "K": K, "type": qtype.name, "rows": t,
               "MB": round(one.numel() / 1e6, 2), "copies": n_copies, "split": [split.split, split.steps],
               "max_rel_diff_new_old": float(f"{err:.2e}"),
               "new": rate(one.numel(), graph_us(calls(tk.dense, raws), replays), copy),
               "old": rate(one.numel(), graph_us(calls(legacy_dense, raws), replays), copy)}
        row["speedup"] = round(row["old"]["us"] / row["new"]["us"], 2)
        if laid_out is not None:  # the same product from kernel_layout's layout, per byte of GGUF rows
            tk.dense(x, engine_raws[0], qtype, n_out)
            row["new_laid_out"] = rate(one.numel(), graph_us(calls(tk.dense, engine_raws), replays), copy)
        # As llama.cpp's test-backend-ops times a product: one weight tensor every call, so that
        # where it fits in L2 part of it comes from there (only for the comparison with it).
        row["new_one_tensor"] = rate(one.numel(), graph_us(
            [lambda: tk.dense(x, engine_raws[0], qtype, n_out)] * calls_per_graph, replays), copy)
        if sweep:
            row["sweep"] = []
            for tile, cfg in _dense_sweep(qw, t, K):  # in the engine's layout
                sp = tk.SplitK.choose(n_out, K, tk.sm_count(str(dev)), cfg)
                tk.dense(x, engine_raws[0], qtype, n_out, cfg, sp, tile)
                us = graph_us(calls(tk.dense, engine_raws, cfg, sp, tile), replays)
                row["sweep"].append({"config": f"{tile} {cfg_name(cfg)}",
                                     "split": [sp.split, sp.steps], **rate(one.numel(), us, copy)})
            best = min(row["sweep"], key=lambda r: r["us"])
            print(f"       sweep best {best['config']} split {best['split']}: {best['us']} us {best['GBps']} GB/s",
                  flush=True)
        out.append(row)
        print(dense_line(row), flush=True)
    del weights, raws, laid_out
    torch.cuda.empty_cache()
    return out


# ------------------------------------------------------------------------------ the expert step

class ExpertLayer:
    """Slot buffers [slots, rows, row_bytes] whose slots are copies of one random expert
    (valid blocks at distinct addresses), enough of them to be 4x the L2 cache and to draw
    top-k distinct experts; laid out as the engine's slots are (Q6_K padded, MXFP4 and Q8_0 planar), while the bytes
    counted are the GGUF ones (what llama.cpp reads for the same experts)."""

    def __init__(self, sc: ExpertScenario, dev: torch.device, l2_bytes: int, n_slots: int = 0):
        import torch

        from engine.layers.moe import ExpertTensor, ExpertWeights
        from engine.quant.layout import kernel_layout

        rng = np.random.default_rng(0)
        shapes = ((sc.n_ff, sc.n_embd), (sc.n_ff, sc.n_embd), (sc.n_embd, sc.n_ff))
        ones = [torch.from_numpy(np.ascontiguousarray(random_weight(rng, q, r, c)))
                for q, (r, c) in zip(sc.qtypes, shapes)]
        self.expert_bytes = sum(o.numel() for o in ones)
        self.n_slots = n_slots or max(2 * sc.top_k, cold_copies(self.expert_bytes, l2_bytes))
        self.buffers, tensors = [], []
        for one, qtype, (rows, cols) in zip(ones, sc.qtypes, shapes):
            self.buffers.append(kernel_layout(one, qtype).to(dev).unsqueeze(0).repeat(self.n_slots, 1, 1))
            b = torch.randn(self.n_slots, rows, device=dev) * 0.1 if sc.bias else None
            tensors.append(ExpertTensor(self.buffers[-1], qtype, (self.n_slots, rows, cols), b))
        self.w = ExpertWeights(*tensors, activation=sc.activation)


class ExpertStep:
    """One decode step's routing: x, top-k slots and weights per token, the pairs sorted by
    slot (as the hybrid executor sends them), and the bytes of the distinct experts read."""

    def __init__(self, layer: ExpertLayer, n_tok: int, k: int, g: torch.Generator, dev: torch.device):
        import torch
        self.x = torch.randn(n_tok, layer.w.gate.shape[2], generator=g).to(dev)
        ids = torch.stack([torch.randperm(layer.n_slots, generator=g)[:k] for _ in range(n_tok)]).numpy()
        self.weights = torch.rand(n_tok, k, generator=g).to(dev)
        tok, pos = np.nonzero(np.ones(ids.shape, dtype=bool))
        slot = ids[tok, pos]
        order = np.argsort(slot, kind="stable")
        meta = np.stack([tok[order], pos[order], slot[order], slot[order]]).astype(np.int32)
        self.tok, self.pos, self.slot, self.exp = torch.from_numpy(meta).to(dev)
        self.out = torch.zeros(k, n_tok, self.x.shape[1], device=dev)
        self.bytes = len(set(slot.tolist())) * layer.expert_bytes


def bench_experts(name: str, sc: ExpertScenario, rows: list[int], dev: torch.device, copy: float, l2_bytes: int,
                  replays: int, n_steps: int, sweep: bool) -> list[dict]:
    import torch

    from engine.quant import triton_kernels as tk

    layer = ExpertLayer(sc, dev, l2_bytes)
    w = layer.w
    qg, qu = (tk.kernel_type(t.qtype, b, t.shape[2]) for t, b in zip((w.gate, w.up), layer.buffers))
    out = []
    for t in rows:
        g = torch.Generator().manual_seed(t)
        steps = [ExpertStep(layer, t, sc.top_k, g, dev) for _ in range(n_steps)]
        tile = tk.expert_tile(qg, qu, t)
        qd = tk.kernel_type(w.down.qtype, layer.buffers[2], sc.n_ff)
        same_tiles = tk.expert_down_tile(qd, t) == tile == "tile"

        def run(s: ExpertStep, cfg=None) -> None:  # a swept tile for gate/up, and for down where it is the same kind
            tk.experts_forward(s.x, layer.buffers, layer.w, s.tok, s.pos, s.slot, s.exp, s.weights, s.out, cfg,
                               cfg if same_tiles else None)

        run(steps[0])
        eager = steps[0].out.clone()
        us = graph_us([lambda s=s: run(s) for s in steps], replays)
        if not torch.equal(eager, steps[0].out):
            raise RuntimeError(f"{name}: the graph replay and the eager launch of the expert step differ")
        t0 = time.perf_counter()
        for s in steps:
            run(s)
        host = (time.perf_counter() - t0) * 1e6 / len(steps)
        torch.cuda.synchronize()
        nbytes = sum(s.bytes for s in steps) / len(steps)
        row = {"kind": "experts", "shape": name, "types": [q.name for q in sc.qtypes], "n_embd": sc.n_embd,
               "n_ff": sc.n_ff, "top_k": sc.top_k, "rows": t, "MB": round(nbytes / 1e6, 2),
               "slots": layer.n_slots, "new": rate(nbytes, us, copy), "host_us_eager": round(host, 1),
               "launches_us": expert_step_launches(layer, steps, replays)}
        # As llama.cpp's test-backend-ops times MUL_MAT_ID: one routing every call (its ids stay as drawn),
        # so the experts it picks are read again and part of them comes from L2 (only for the comparison
        # with it; ours then reads gate, up and down, three times the bytes of its one projection, and so
        # finds less of them in L2 than its case does)
        row["new_one_tensor"] = rate(steps[0].bytes, graph_us([lambda: run(steps[0])] * len(steps), replays), copy)
        # the one launch as the engine takes it (down in the three launches' tile, so the same bits),
        # and where down's other tile reads the type, in that one too
        down_tiles = _down_tiles(qd, t)
        row["one_launch"], *others = [
            {"down_tile": d, **rate(nbytes, one_launch_us(name, layer, steps, replays, None, d), copy)}
            for d in down_tiles]
        if others:
            row["one_launch_other_down"] = others[0]
        if sweep:
            row["sweep"] = []
            default = tk.gate_up_config(tile, qg, qu, sc.n_ff)
            for cfg in [c for c in _expert_sweep(tile) if c != default]:
                run(steps[0], cfg)
                row["sweep"].append({"config": cfg_name(cfg),
                                     **rate(nbytes, graph_us([lambda s=s: run(s, cfg) for s in steps], replays),
                                            copy)})
            best = min(row["sweep"], key=lambda r: r["us"])
            # the default timed again after its rivals: how far one config's two timings in this run
            # lie apart, the least difference between configs that says anything
            row["new_again"] = rate(nbytes, graph_us([lambda s=s: run(s) for s in steps], replays), copy)
            print(f"       sweep best {best['config']}: {best['us']} us {best['GBps']} GB/s; the default again "
                  f"{row['new_again']['us']} us (first {row['new']['us']})", flush=True)
            row["step_tiles"] = {name: rate(nbytes, graph_us(
                [lambda s=s, kw=kw: tk.experts_forward(s.x, layer.buffers, w, s.tok, s.pos, s.slot, s.exp,
                                                       s.weights, s.out, **kw) for s in steps], replays), copy)
                for name, kw in _other_step_tiles(qg, qu, qd, t).items()}
            print("       the step in other tiles: " + ", ".join(f"{k} {r['us']} us"
                                                                 for k, r in row["step_tiles"].items()), flush=True)
            row["down_sweep"] = [{"config": name, **rate(nbytes, graph_us(
                [lambda s=s, c=c: tk.experts_forward(s.x, layer.buffers, w, s.tok, s.pos, s.slot, s.exp, s.weights,
                                                     s.out, down_cfg=c) for s in steps], replays), copy)}
                for name, c in _down_sweep(qd, t).items()]
            best = min(row["down_sweep"], key=lambda r: r["us"])
            print(f"       down sweep best {best['config']}: {best['us']} us {best['GBps']} GB/s", flush=True)
            variants = [(replace(default, maxnreg=n), d) for d in down_tiles for n in ONE_LAUNCH_MAXNREG]
            row["one_launch_sweep"] = [
                {"config": f"{cfg_name(cfg)} down {d}",
                 **rate(nbytes, one_launch_us(name, layer, steps, replays, cfg, d), copy)} for cfg, d in variants]
            print("       one launch: " + ", ".join(f"{r['config']} {r['us']} us" for r in row["one_launch_sweep"]),
                  flush=True)
        out.append(row)
        print(expert_line(row), flush=True)
    del layer
    torch.cuda.empty_cache()
    return out


def _tiles(default: str, *types: int) -> list[str]:
    """The expert tiles that read weights of kernel types `types`, `default` first."""
    from engine.quant import triton_kernels as tk

    return list(dict.fromkeys((default, "tile", *(("row",) if set(types) <= set(tk.ROW_TILE_TYPES) else ()))))


def _down_tiles(qd: int, tokens: int) -> list[str]:
    """down's tiles over weights of kernel type `qd` at `tokens` tokens: the default first."""
    from engine.quant import triton_kernels as tk

    return _tiles(tk.expert_down_tile(qd, tokens), qd)


def _other_step_tiles(qg: int, qu: int, qd: int, tokens: int) -> dict[str, dict]:
    """experts_forward's tile arguments for the step in every other pair of gate/up and down tiles
    that read its weights (the row tiles over several tokens; the quantized ones at one), by name;
    over several tokens also both row tiles in runs of 2, 4 and `tokens` pairs of a slot a program
    (gate/up's rows at once, which runs take, where its default takes rows in turns)."""
    from engine.quant import triton_kernels as tk

    default = tk.expert_tile(qg, qu, tokens)
    gate_ups = _tiles(default, qg, qu)
    downs = _down_tiles(qd, tokens)
    out = {f"gate/up {g}, down {d}": {"gate_up_tile": g, "down_tile": d}
           for g in gate_ups for d in downs if (g, d) != (default, downs[0])}
    if tokens > 1 and "row" in gate_ups and "row" in downs:
        for group in sorted({n for n in (2, 4, tokens) if n <= tokens}):
            out[f"gate/up row, down row, runs of {group}"] = row_runs(qd, group)
            out[f"gate/up row bn{RUN_ROWS}, down row, runs of {group}"] = row_runs(qd, group, RUN_ROWS)
    return out


# gate/up's rows a run program takes in the sweep's second form of runs (on 4 warps): twice the row
# tile's default, so that the program's end (activation, h and its rounding's semaphores), the same
# for any number of rows, is paid half as often (sm_90, gpt-oss's runs of 2: loop 264 -> 477
# instructions, 64 -> 96 registers, no spills)
RUN_ROWS = 8


def row_runs(qd: int, group: int, gate_up_rows: int | None = None) -> dict:
    """experts_forward's tile arguments for both row tiles in runs of `group` pairs of a slot a
    program, down's weights of kernel type `qd`; gate/up's row tile at `gate_up_rows` rows a
    program on 4 warps, or its default."""
    from engine.quant import triton_kernels as tk

    gate_up = tk.TileConfig(gate_up_rows, 4) if gate_up_rows else tk.GATE_UP_CONFIG["row"]
    return {"gate_up_tile": "row", "down_tile": "row", "gate_up_cfg": replace(gate_up, group=group),
            "down_cfg": replace(tk.down_config("row", qd), group=group)}


# --sweep's register caps for the one-launch step (occupancy against spills; sm_90 compiles, one token: 48-72
# registers with down in the row tile, 80-102 with down in the quantized tile)
ONE_LAUNCH_MAXNREG = (64, 72)


def one_launch_us(name: str, layer: ExpertLayer, steps: list[ExpertStep], replays: int, cfg, down_tile: str) -> float:
    """The step as one launch (experts_forward(one_launch=True); gate/up's tile `cfg` or its
    default, down's tile `down_tile`), µs per step from a replayed graph, after checking that it
    gives the three launches' result with the same tiles bit for bit and that none of its waits
    timed out."""
    import torch

    from engine.quant import triton_kernels as tk

    def run(s: ExpertStep, one_launch: bool = True) -> None:
        tk.experts_forward(s.x, layer.buffers, layer.w, s.tok, s.pos, s.slot, s.exp, s.weights, s.out, cfg,
                           one_launch=one_launch, down_tile=down_tile)

    run(steps[0], one_launch=False)
    eager = steps[0].out.clone()
    steps[0].out.zero_()
    run(steps[0])
    if not torch.equal(eager, steps[0].out):
        raise RuntimeError(f"{name}: the expert step in one launch differs from its three launches")
    us = graph_us([lambda s=s: run(s) for s in steps], replays)
    if tk.step_timed_out(steps[0].x.device) or not torch.equal(eager, steps[0].out):
        raise RuntimeError(f"{name}: the one-launch step's graph replays waited in vain or differ")
    return us


def expert_step_launches(layer: ExpertLayer, steps: list[ExpertStep], replays: int) -> dict[str, float]:
    """The expert step's launches each timed alone, in a graph of its own, on the inputs the
    launch before it made (µs per step): where the step's time goes. The three together take
    longer than the step, each graph paying its own first launch. At one token of the types
    the lanes-along-K tile reads, also down in that tile ("down row", checked against the
    quantized tile's result)."""
    import torch

    from engine.quant import triton_kernels as tk

    w = layer.w
    rounded = [tk.round_inputs(s.x, w) for s in steps]
    hrs = [tk.gate_up(*r, layer.buffers[0], layer.buffers[1], w, s.tok, s.slot, s.exp)[1]
           for r, s in zip(rounded, steps)]

    def down(tile: str) -> float:
        return round(graph_us([lambda hr=hr, s=s: tk.down(hr, layer.buffers[2], w, s.tok, s.pos, s.slot, s.exp,
                                                          s.weights, s.out, tile=tile)
                               for hr, s in zip(hrs, steps)], replays), 2)

    out = {
        "round x": round(graph_us([lambda s=s: tk.round_inputs(s.x, w) for s in steps], replays), 2),
        "gate/up": round(graph_us([lambda r=r, s=s: tk.gate_up(*r, layer.buffers[0], layer.buffers[1], w,
                                                               s.tok, s.slot, s.exp)
                                   for r, s in zip(rounded, steps)], replays), 2),
        "down": down("tile")}
    qd = tk.kernel_type(w.down.qtype, layer.buffers[2], w.down.shape[2])
    if steps[0].x.shape[0] == 1 and qd in tk.ROW_TILE_TYPES:
        s = steps[0]
        want = s.out.clone()  # the quantized tile's, from the last replay
        tk.down(hrs[0], layer.buffers[2], w, s.tok, s.pos, s.slot, s.exp, s.weights, s.out, tile="row")
        diff = ((s.out - want).abs().max() / want.abs().max()).item()
        if diff > 1e-4:
            raise RuntimeError(f"down in the row tile differs from the quantized tile's by {diff:.1e}")
        out["down row"] = down("row")
    return out


# ------------------------------------------------------------------------------ the prefill expert step

def torch_many_rows(x: torch.Tensor, layer: ExpertLayer, ids: torch.Tensor, weights: torch.Tensor,
                    out: torch.Tensor) -> None:
    """The many-row step as hybrid.HybridExperts._run_on_accelerator runs it, expert by expert:
    dequantize the slot's weights (slots.LayerSlots.weights), then expert_ffn (matmuls)."""
    import torch

    from engine.layers.moe import expert_ffn
    from engine.quant.layout import dequantize_layout

    w = layer.w
    for e in range(layer.n_slots):
        tok, pos = torch.nonzero(ids == e, as_tuple=True)
        if len(tok):
            mats = [dequantize_layout(b[e], t.qtype, t.shape[1:])
                    for b, t in zip(layer.buffers, (w.gate, w.up, w.down))]
            out[pos, tok] = expert_ffn(x[tok], *mats, w, e) * weights[tok, pos, None]


def _eager_us(fn, repeats: int) -> float:
    """Wall microseconds per call, synchronized (the best of `repeats` after one warm call)."""
    import torch
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) * 1e6)
    return best


def _grouped_sweep() -> list:
    """The tiles `--sweep` times beside the defaults. 16-row tiles are left out: on the H200 two
    sweeps ended in an illegal memory access at a 16-row tile (session 8, not yet understood;
    the same tile alone ran clean), which also ends every measurement after it."""
    from engine.quant import grouped_gemm as gg

    return [gg.GroupedConfig(m, n, w, s) for m, n, w, s in
            ((32, 64, 4, 2), (32, 64, 4, 3), (32, 64, 8, 2), (32, 128, 4, 2), (64, 32, 4, 1), (64, 64, 4, 2),
             (64, 64, 8, 1), (64, 64, 8, 2), (64, 128, 8, 2), (128, 64, 8, 2))]


def bench_grouped(name: str, sc: ExpertScenario, tokens: list[int], dev: torch.device, replays: int,
                  sweep: list | None) -> list[dict]:
    import torch

    from engine.quant import grouped_gemm as gg

    layer = ExpertLayer(sc, dev, 0, n_slots=GROUPED_EXPERTS)
    w, out = layer.w, []
    for t in tokens:
        g = torch.Generator().manual_seed(t)
        x = torch.randn(t, sc.n_embd, generator=g).to(dev)
        ids_host = torch.stack([torch.randperm(GROUPED_EXPERTS, generator=g)[:sc.top_k] for _ in range(t)]).numpy()
        ids = torch.from_numpy(ids_host).to(dev)
        weights = torch.rand(t, sc.top_k, generator=g).to(dev)
        slot_of = np.arange(GROUPED_EXPERTS, dtype=np.int32)
        per_slot = torch.zeros(sc.top_k, t, sc.n_embd, device=dev)
        ref = torch.zeros_like(per_slot)
        flops = 6.0 * t * sc.top_k * sc.n_embd * sc.n_ff  # gate, up, down: 2 x D x F each per pair

        def kernels(cfg=None):  # cfg: one tile for both kernels (the sweep); None: the defaults
            gu_cfg, dn_cfg = cfg or gg.GATE_UP_CONFIG[w.gate.qtype], cfg or gg.DOWN_CONFIG[w.down.qtype]
            groups = gg.Groups.build(ids_host, slot_of, gu_cfg.block_m, dev)

            def call() -> None:  # the four launches (grouping done): what a graph replays
                gg.groups_forward(x, layer.buffers, w, groups, weights, per_slot, gu_cfg, dn_cfg)
            return call

        def tflops(us: float) -> float:
            return round(flops / us / 1e6, 1)

        grouped = gg.experts_forward
        grouped(x, layer.buffers, w, ids_host, slot_of, weights, per_slot)
        torch_many_rows(x, layer, ids, weights, ref)
        err = ((per_slot - ref).abs().max() / ref.abs().max()).item()
        g_us = graph_us([kernels()], replays)
        e_us = _eager_us(lambda: grouped(x, layer.buffers, w, ids_host, slot_of, weights, per_slot), replays)
        t_us = _eager_us(lambda: torch_many_rows(x, layer, ids, weights, ref), max(1, replays // 2))
        row = {"kind": "grouped", "shape": name, "types": [q.name for q in sc.qtypes], "n_embd": sc.n_embd,
               "n_ff": sc.n_ff, "top_k": sc.top_k, "experts": GROUPED_EXPERTS, "tokens": t,
               "GFLOP": round(flops / 1e9, 1),
               "max_rel_diff_grouped_torch": float(f"{err:.2e}"),
               "grouped": {"us": round(g_us, 1), "TFLOPs": tflops(g_us)},
               "grouped_eager": {"us": round(e_us, 1), "TFLOPs": tflops(e_us)},
               "torch": {"us": round(t_us, 1), "TFLOPs": tflops(t_us)}}
        row["speedup"] = round(t_us / e_us, 1)
        if sweep:
            row["sweep"] = []
            for cfg in sweep:
                call = kernels(cfg)
                call()
                us = graph_us([call], replays)
                row["sweep"].append({"config": f"m{cfg.block_m}n{cfg.block_n}w{cfg.num_warps}s{cfg.num_stages}",
                                     "us": round(us, 1),
                                     "TFLOPs": tflops(us)})
            best = min(row["sweep"], key=lambda r: r["us"])
            print(f"       sweep best {best['config']}: {best['us']} us {best['TFLOPs']} TFLOP/s", flush=True)
        out.append(row)
        print(grouped_line(row), flush=True)
    del layer
    torch.cuda.empty_cache()
    return out


def _prompt_dense_sweep() -> list:
    """The tiles `--sweep` times for a prompt's dense products: one weight for every row, so
    taller tiles pad nothing and decode each weight tile for more rows."""
    from engine.quant import grouped_gemm as gg

    return [gg.GroupedConfig(m, n, w, s) for m, n, w, s in
            ((32, 64, 4, 3), (64, 64, 4, 3), (64, 64, 8, 3), (64, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 3),
             (64, 64, 4, 2), (128, 64, 4, 2))]


def bench_prompt_dense(name: str, n_out: int, K: int, qtype: QT, tokens: list[int], dev: torch.device,
                       replays: int, sweep: list | None) -> list[dict]:
    """grouped_gemm.dense (round x, the int8 tensor-core product) over the weight as the engine
    keeps it (Q6_K padded, MXFP4 and Q8_0 planar) at a prompt's rows, beside what a dequantize-to-bf16 scratch would
    leave to cuBLAS (the bf16 product alone: the decode of W into the scratch comes on top) and
    the exact torch route (float32 product). A prompt's product reuses each weight tile across
    its rows, so one copy of the weight serves (L2 does not decide its time)."""
    import torch

    from engine.quant import grouped_gemm as gg
    from engine.quant.activation import round_activation
    from engine.quant.dequant import dequantize
    from engine.quant.layout import kernel_layout

    rng = np.random.default_rng(int(qtype) + n_out + K)
    raw = torch.from_numpy(np.ascontiguousarray(random_weight(rng, qtype, n_out, K))).to(dev).unsqueeze(0)
    w32 = dequantize(raw[0], qtype, (n_out, K))
    raw = kernel_layout(raw, qtype)
    w16 = w32.to(torch.bfloat16)
    out = []
    for t in tokens:
        x = torch.randn(t, K, generator=torch.Generator().manual_seed(t)).to(dev)
        x16 = x.to(torch.bfloat16)
        flops = 2.0 * t * n_out * K

        def tflops(us: float) -> float:
            return round(flops / us / 1e6, 1)

        ref = round_activation(x, qtype) @ w32.T  # what the kernel computes, up to summation order
        err = ((gg.dense(x, raw, qtype) - ref).abs().max() / ref.abs().max()).item()
        row = {"kind": "prompt_dense", "shape": name, "qtype": qtype.name, "n_out": n_out, "K": K, "tokens": t,
               "GFLOP": round(flops / 1e9, 1), "max_rel_diff_dense_fp32": float(f"{err:.2e}")}
        for key, fn in (("dense", lambda: gg.dense(x, raw, qtype)), ("cublas_bf16", lambda: x16 @ w16.T),
                        ("torch_fp32", lambda: x @ w32.T)):
            fn()
            us = graph_us([fn], replays)
            row[key] = {"us": round(us, 1), "TFLOPs": tflops(us)}
        if sweep:
            row["sweep"] = []
            for cfg in sweep:
                name_cfg = f"m{cfg.block_m}n{cfg.block_n}w{cfg.num_warps}s{cfg.num_stages}"
                try:  # a tile that does not fit (shared memory, registers) is reported, not fatal
                    gg.dense(x, raw, qtype, cfg)
                except Exception as e:  # noqa: BLE001 (triton's resource errors have no common base)
                    row["sweep"].append({"config": name_cfg, "error": f"{type(e).__name__}: {e}"[:200]})
                    continue
                us = graph_us([lambda cfg=cfg: gg.dense(x, raw, qtype, cfg)], replays)
                row["sweep"].append({"config": name_cfg, "us": round(us, 1), "TFLOPs": tflops(us)})
            best = min((c for c in row["sweep"] if "us" in c), key=lambda r: r["us"])
            print(f"       sweep best {best['config']}: {best['us']} us {best['TFLOPs']} TFLOP/s", flush=True)
        print(f"prompt dense {name} {qtype.name} x{t}: ours {row['dense']['us']} us {row['dense']['TFLOPs']} TFLOP/s"
              f" (rel diff {err:.1e}), cuBLAS bf16 {row['cublas_bf16']['TFLOPs']}, torch fp32 "
              f"{row['torch_fp32']['TFLOPs']} TFLOP/s", flush=True)
        out.append(row)
    del raw, w32, w16
    torch.cuda.empty_cache()
    return out


# ------------------------------------------------------------------------------ llama.cpp beside ours

def ggml_type_name(qtype: QT) -> str:
    """ggml's name of a type, as test-backend-ops prints it (q4_K, q8_0, mxfp4, bf16)."""
    name = qtype.name.lower()
    return name[:-2] + "_K" if name.endswith("_k") else name


def llama_case_key(row: dict) -> tuple | None:
    """What a llama.cpp perf case must match to stand beside one of our rows: (op, type, m, k,
    n, n_used). Dense rows: MUL_MAT of the same type and shape (m = our n_out, k = our K) at as
    many activation rows. Expert steps of one type: MUL_MAT_ID of one gate-shaped projection
    (m = n_ff, k = n_embd) with the same top-k; its expert count may differ (gpt-oss-20b's 32
    against gpt-oss-120b's 128) and ours is gate, up and down, so the two compare per byte of the
    experts read. Mixed-type steps (Q4_K_M) have no llama.cpp case."""
    if row["kind"] == "dense":
        return ("MUL_MAT", QT[row["type"]], row["n_out"], row["K"], row["rows"], None)
    if row["kind"] == "experts" and len(set(row["types"])) == 1:
        return ("MUL_MAT_ID", QT[row["types"][0]], row["n_ff"], row["n_embd"], row["rows"], row["top_k"])
    return None


def _record_key(r: llama_ops.OpPerf) -> tuple:
    return (r.op, r.qtype, r.m, r.k, r.n, r.n_used)


def llama_params_regex(results: list[dict]) -> str | None:
    """A `test-backend-ops -p` regex that selects only the perf cases some row can stand beside
    (every case runs for at least a second: the whole MUL_MAT list would take minutes); None
    when no row has one."""
    alts = set()
    for row in results:
        key = llama_case_key(row)
        if key is None:
            continue
        op, qtype, m, k, n, n_used = key
        if op == "MUL_MAT":  # one weight matrix: no broadcast batches, no permuted or strided views
            alts.add(rf"type_a={ggml_type_name(qtype)},type_b=f32,m={m},n={n},k={k},bs=\[1,1\],nr=\[1,1\],"
                     rf"per=\[0,1,2,3\],k_v=0,")
        else:
            alts.add(rf"type_a={ggml_type_name(qtype)},type_b=f32,n_mats=\d+,n_used={n_used},b=0,m={m},n={n},k={k},")
    return "^(" + "|".join(sorted(alts)) + ")" if alts else None


def attach_llama(results: list[dict], records: list[llama_ops.OpPerf], copy: float) -> int:
    """Put llama.cpp's figure beside each of our rows that one of its perf cases matches
    (llama_case_key): `llama` (its case, µs, GB/s of weights read, share of our copy bandwidth)
    and `ours_per_llama_per_byte` (our GB/s over its GB/s: above 1, ours reads faster). Returns
    how many rows got one."""
    by_key: dict[tuple, llama_ops.OpPerf] = {}
    for r in records:
        if r.weight_bytes is not None and (r.op != "MUL_MAT" or r.experts_read == 1):
            by_key.setdefault(_record_key(r), r)  # the first of equal cases (the list has none today)
    matched = 0
    for row in results:
        key = llama_case_key(row)
        rec = by_key.get(key) if key else None
        if rec is None:
            continue
        gbps = rec.gbps
        row["llama"] = {"case": rec.case, "backend": rec.backend, "us": rec.us,
                        "MB": round(rec.weight_bytes / 1e6, 2), "GBps": round(gbps, 1),
                        "of_copy_bw": round(gbps / copy, 3), "printed": rec.printed}
        row["ours_per_llama_per_byte"] = round(engine_figure(row)["GBps"] / gbps, 2)
        if "new_one_tensor" in row:
            row["ours_one_tensor_per_llama_per_byte"] = round(row["new_one_tensor"]["GBps"] / gbps, 2)
        if "one_launch" in row:
            row["one_launch_per_llama_per_byte"] = round(row["one_launch"]["GBps"] / gbps, 2)
        matched += 1
    return matched


def engine_figure(row: dict) -> dict:
    """Our timing of a row in the layout the engine keeps on the GPU (Q6_K padded, MXFP4 and Q8_0 planar:
    `new_laid_out`; else `new`), weights from HBM."""
    return row.get("new_laid_out", row["new"])


def add_llama(result: dict, binary: Path, backend: str, out: Path) -> None:
    """Run llama.cpp's perf cases that our rows can stand beside and attach its figures to the
    rows (attach_llama); its raw output into out/llama_ops.txt. A failure of the binary leaves
    our figures as they are and is kept as `llama_ops_error` (run() then exits 1)."""
    regex = llama_params_regex(result["results"])
    if regex is None:
        print("llama.cpp: none of its perf cases has these rows' shapes and types", flush=True)
        return
    try:
        records, text = llama_ops.run_perf(binary, backend, params_regex=regex)
    except UserError as e:
        result["llama_ops_error"] = str(e)
        print(f"llama.cpp's figures missing: {e}", flush=True)
        return
    (out / "llama_ops.txt").write_text(text)
    result["llama_ops"] = f"{binary} perf -b {backend}"
    matched = attach_llama(result["results"], records, result["copy_GBps"])
    for r in result["results"]:
        if "llama" in r:
            print(llama_line(r), flush=True)
    print(f"llama.cpp: {len(records)} perf cases, {matched} of our rows beside one", flush=True)


def llama_case_label(rec: dict) -> str:
    """A short name of the llama.cpp case a row was compared with."""
    p = llama_ops.split_params(rec["case"][rec["case"].index("(") + 1:-1])
    op = rec["case"][:rec["case"].index("(")]
    if op == "MUL_MAT_ID":
        return f"MUL_MAT_ID {p['type_a']} {p['m']} x {p['k']}, {p['n_used']} of {p['n_mats']}, n={p['n']}"
    return f"MUL_MAT {p['type_a']} {p['m']} x {p['k']}, n={p['n']}"


def llama_line(row: dict) -> str:
    ll, ours = row["llama"], engine_figure(row)
    same = (f"; one tensor as llama.cpp times it {row['new_one_tensor']['us']:.2f} us, "
            f"x{row['ours_one_tensor_per_llama_per_byte']}" if "new_one_tensor" in row else "")
    if "one_launch" in row:
        same += f"; one launch {row['one_launch']['us']:.2f} us, x{row['one_launch_per_llama_per_byte']}"
    return (f"llama.cpp {llama_case_label(ll):44s} {ll['us']:8.2f} us {ll['GBps']:7.0f} GB/s  beside "
            f"{row['kind']} {row['shape']} rows={row['rows']}: ours {ours['us']:.2f} us "
            f"{ours['GBps']:.0f} GB/s, x{row['ours_per_llama_per_byte']} per byte{same}")


# ------------------------------------------------------------------------------ report

# programs an SM (SplitK.choose's target) at which --sweep also times the quantized gate/up tile
EXPERT_SPLIT_TARGETS = (8, 16, 32)


def _expert_sweep(tile: str) -> list:
    """Tiles --sweep times for the expert step whose gate/up takes `tile` (triton_kernels.expert_tile)."""
    from engine.quant import triton_kernels as tk

    if tile == "row":
        # at its 64 registers 4 rows on 4 warps fit 8 programs an SM, so one token's Qwen3 gate/up
        # (1,536 programs) ran in 1.45 waves (Nsight Compute, H200). Register caps: 40 fit them in
        # one, at the cost of a stack (sm_90: 112 bytes for Q4_K, 208 for Q6_K). Turns: 8 rows a
        # program in two turns of 4 (sm_90: 64 registers, Q4_K and Q6_K; no stack) fit them in 0.73
        # of one; 16 in four (72) in 0.42
        return [tk.TileConfig(2, 1), tk.TileConfig(2, 2), tk.TileConfig(4, 2), tk.TileConfig(4, 4),
                tk.TileConfig(8, 4), tk.TileConfig(8, 8), tk.TileConfig(16, 4), tk.TileConfig(4, 4, maxnreg=48),
                tk.TileConfig(4, 4, maxnreg=40), tk.TileConfig(8, 4, passes=2), tk.TileConfig(16, 4, passes=4)]
    # and gate/up split over K for more programs an SM (SplitK.choose's target): Qwen3's Q4_K gate/up over
    # 4-8 tokens runs unsplit, 768-1,536 programs of 32 rows on 132 SMs (a wave and its uneven tail). On
    # the H100 the split lost (session 43: 15-33% slower at 2-4 tokens, at best even at 8); kept for GPUs of
    # other SM counts
    return _sweep_tiles() + [replace(tk.GATE_UP_CONFIG["tile"], programs_per_sm=n) for n in EXPERT_SPLIT_TARGETS]


# --sweep's configs of down's row tile (BLOCK_N rows on num_warps warps; under four K steps a warp
# takes four times BLOCK_N / num_warps rows, eight lanes a row)
DOWN_ROW_SWEEP = [(2, 1), (2, 2), (4, 2), (8, 4), (8, 8), (16, 4)]


def _down_sweep(qd: int, tokens: int) -> dict:
    """down's configs --sweep times in the tile it takes over weights of kernel type `qd` at
    `tokens` tokens (gate/up in its default), by name, the default left out."""
    from engine.quant import triton_kernels as tk

    tile = tk.expert_down_tile(qd, tokens)
    cfgs = [tk.TileConfig(*c) for c in DOWN_ROW_SWEEP] if tile == "row" else _sweep_tiles()
    return {f"{tile} {cfg_name(c)}": c for c in cfgs if c != tk.down_config(tile, qd)}


def _sweep_tiles() -> list:
    """Tiles --sweep times: a row per lane pair (BLOCK_N = 16 x warps) or two (32 x warps), and the
    default under register caps (Nsight Compute, H100, 8 tokens of Qwen3's step: Q6_K's gate/up tile
    at 168 registers a thread fits 6 programs an SM, 18% occupancy, and waits on memory at 54% of DRAM)."""
    from engine.quant import triton_kernels as tk

    return [tk.TileConfig(16, 1), tk.TileConfig(32, 2), tk.TileConfig(64, 4), tk.TileConfig(32, 1),
            tk.TileConfig(64, 2), tk.TileConfig(128, 4), tk.TileConfig(32, 2, maxnreg=128),
            tk.TileConfig(32, 2, maxnreg=96)]


def _dense_sweep(qw: int, rows: int, K: int) -> list[tuple[str, object]]:
    """(tile, config) pairs --sweep times for the dense product of weights of kernel type `qw`
    (triton_kernels.kernel_type) at `rows` activation rows of K values: configs of the tile it takes
    (triton_kernels.dense_tile: lanes along K take BLOCK_N rows on num_warps warps; tensor
    cores a BLOCK_N of at least 16), the default at several programs per SM (its split); and
    where the type is laid out for the lanes-along-K tile of four K steps an access, the configs of
    whichever of that tile and the quantized one it does not take."""
    from engine.quant import triton_kernels as tk

    tile = tk.dense_tile(qw, rows)
    pairs = [(tile, cfg) for cfg in _dense_tile_sweep(tile, tk.dense_config(qw, rows, K, tile))]
    if qw in tk.ROW_TILE_TYPES:
        other = "tile" if tile == "row_kquant" else "row_kquant"
        pairs += [(other, cfg) for cfg in _dense_tile_sweep(other, tk.dense_config(qw, rows, K, other))]
    return pairs


def _dense_tile_sweep(tile: str, default) -> list:
    """Configs of dense tile `tile` that --sweep times, its `default` last at several programs
    per SM."""
    from engine.quant import triton_kernels as tk

    if tile == "mma":
        tiles = [tk.TileConfig(16, 4, num_stages=3), tk.TileConfig(64, 4, num_stages=3),
                 tk.TileConfig(32, 4, num_stages=2), tk.TileConfig(32, 4, num_stages=4),
                 tk.TileConfig(32, 2, num_stages=3), tk.TileConfig(64, 8, num_stages=3)]
    elif tile == "row":
        tiles = [tk.TileConfig(4, 4), tk.TileConfig(8, 8), tk.TileConfig(16, 8), tk.TileConfig(4, 2),
                 tk.TileConfig(2, 2), tk.TileConfig(16, 4)]
    elif tile == "row16":  # (a step of DENSE16_STEP values on any number of warps)
        tiles = [tk.TileConfig(2, 4, programs_per_sm=1), tk.TileConfig(4, 4, programs_per_sm=1),
                 tk.TileConfig(1, 8, programs_per_sm=1), tk.TileConfig(2, 8, programs_per_sm=1),
                 tk.TileConfig(1, 2, programs_per_sm=1), tk.TileConfig(8, 4, programs_per_sm=1)]
    elif tile == "row_kquant":  # (the k configs: warps side by side along K)
        tiles = [tk.DENSE_CONFIG[tile], tk.TileConfig(2, 2, programs_per_sm=1), tk.TileConfig(4, 2, programs_per_sm=1),
                 tk.TileConfig(4, 4, programs_per_sm=1), tk.TileConfig(8, 4, programs_per_sm=1),
                 tk.TileConfig(1, 2, programs_per_sm=1, k_warps=2), tk.TileConfig(2, 2, programs_per_sm=1, k_warps=2),
                 tk.TileConfig(1, 4, programs_per_sm=1, k_warps=4), tk.TileConfig(2, 4, programs_per_sm=1, k_warps=4)]
    else:
        tiles = _sweep_tiles()
    return [t for t in tiles if t != default] + [replace(default, programs_per_sm=n) for n in (1, 2, 4, 8, 16)]


def cfg_name(cfg) -> str:
    """A TileConfig's label; its split-K target (programs an SM) where not the default's."""
    return (f"bn{cfg.block_n}w{cfg.num_warps}" + (f"s{cfg.num_stages}" if cfg.num_stages > 1 else "")
            + ("u" if cfg.unroll else "") + (f"r{cfg.maxnreg}" if cfg.maxnreg else "")
            + (f"t{cfg.passes}" if cfg.passes > 1 else "")
            + (f"g{cfg.group}" if cfg.group != type(cfg).group else "")
            + (f"k{cfg.k_warps}" if cfg.k_warps > 1 else "")
            + (f" {cfg.programs_per_sm}/SM" if cfg.programs_per_sm != type(cfg).programs_per_sm else ""))


def dense_line(r: dict) -> str:
    return (f"dense  {r['shape']:27s} {r['type']:5s} rows={r['rows']}  {r['MB']:8.2f} MB  "
            f"new {r['new']['us']:8.2f} us {r['new']['GBps']:7.0f} GB/s ({r['new']['of_copy_bw']:.2f} of copy)  "
            f"old {r['old']['us']:8.2f} us {r['old']['GBps']:7.0f} GB/s  x{r['speedup']}  split {r['split']}"
            + (f"  {CHANGED_LAYOUTS[QT[r['type']]]} {r['new_laid_out']['us']:.2f} us "
               f"{r['new_laid_out']['GBps']:.0f} GB/s" if "new_laid_out" in r else ""))


def expert_line(r: dict) -> str:
    return (f"experts {r['shape']:26s} rows={r['rows']}  {r['MB']:8.2f} MB  {r['new']['us']:8.2f} us "
            f"{r['new']['GBps']:7.0f} GB/s ({r['new']['of_copy_bw']:.2f} of copy)  host {r['host_us_eager']} us eager"
            f"  alone: {launches(r)}; one launch" + "".join(
                f" (down {one['down_tile']}) {one['us']:.2f} us {one['GBps']:.0f} GB/s"
                for one in (r["one_launch"], r.get("one_launch_other_down")) if one))


def launches(r: dict) -> str:
    return ", ".join(f"{name} {us}" for name, us in r["launches_us"].items()) + " us"


def grouped_line(r: dict) -> str:
    g, e, t = r["grouped"], r["grouped_eager"], r["torch"]
    return (f"grouped {r['shape']:26s} tokens={r['tokens']:<5d} {r['GFLOP']:7.1f} GFLOP  grouped {g['us']:9.1f} us "
            f"{g['TFLOPs']:6.1f} TFLOP/s  eager {e['us']:9.1f} us  torch {t['us']:10.1f} us {t['TFLOPs']:6.1f} "
            f"TFLOP/s  x{r['speedup']}  diff {r['max_rel_diff_grouped_torch']:.1e}")


def markdown(result: dict) -> str:
    """The results as markdown tables (dense products; expert steps)."""
    head = (f"{result['device']}, torch {result['torch']}, triton {result['triton']}; device-to-device copy "
            f"{result['copy_GBps']:.0f} GB/s (read + write). GPU time per call from a replayed CUDA graph; "
            f"weights from HBM. `share` = GB/s / copy GB/s. cuBLAS's workspace (its baselines): "
            f"{result.get('cublas_workspace') or 'torch default'}.\n")
    lines = [head, "| dense product | n_out x K | type | rows | MB | new µs | new GB/s | new share | old µs | "
             "old GB/s | old share | speedup | split x steps |", "|" + "---|" * 13]
    for r in result["results"]:
        if r["kind"] == "dense":
            n, o = r["new"], r["old"]
            lines.append(f"| {r['shape']} | {r['n_out']} x {r['K']} | {r['type']} | {r['rows']} | {r['MB']} | "
                         f"{n['us']} | {n['GBps']:.0f} | {n['of_copy_bw']:.2f} | {o['us']} | {o['GBps']:.0f} | "
                         f"{o['of_copy_bw']:.2f} | {r['speedup']}x | {r['split'][0]} x {r['split'][1]} |")
            if "new_laid_out" in r:  # GB/s of the GGUF bytes, so that it compares with the line above
                n = r["new_laid_out"]
                lines.append(f"| {r['shape']} | {r['n_out']} x {r['K']} | {r['type']} "
                             f"{CHANGED_LAYOUTS[QT[r['type']]]} | {r['rows']} | {r['MB']} | {n['us']} | "
                             f"{n['GBps']:.0f} | {n['of_copy_bw']:.2f} | {o['us']} | {o['GBps']:.0f} | "
                             f"{o['of_copy_bw']:.2f} | {o['us'] / n['us']:.2f}x | {r['split'][0]} x {r['split'][1]} |")
    lines += ["", "| expert step | types | n_embd x n_ff, top-k | rows | MB | µs | GB/s | share | host µs eager | "
              "launches alone, µs | one launch µs | one launch GB/s |", "|" + "---|" * 12]
    for r in result["results"]:
        if r["kind"] == "experts":
            n, one = r["new"], r.get("one_launch")  # (kernels.json of session 28 and before: none)
            lines.append(f"| {r['shape']} | {'/'.join(r['types'])} | {r['n_embd']} x {r['n_ff']}, {r['top_k']} | "
                         f"{r['rows']} | {r['MB']} | {n['us']} | {n['GBps']:.0f} | {n['of_copy_bw']:.2f} | "
                         f"{r['host_us_eager']} | {launches(r)} | "
                         + (f"{one['us']} | {one['GBps']:.0f} |" if one else "- | - |"))
    lines += ["", "| prefill expert step | types | experts, top-k, n_embd x n_ff | tokens | GFLOP | grouped µs | "
              "grouped TFLOP/s | grouped eager µs | torch µs | torch TFLOP/s | speedup (eager) | max rel diff |",
              "|" + "---|" * 12]
    for r in result["results"]:
        if r["kind"] == "grouped":
            g, e, t = r["grouped"], r["grouped_eager"], r["torch"]
            lines.append(f"| {r['shape']} | {'/'.join(r['types'])} | {r['experts']}, {r['top_k']}, {r['n_embd']} x "
                         f"{r['n_ff']} | {r['tokens']} | {r['GFLOP']} | {g['us']} | {g['TFLOPs']} | {e['us']} | "
                         f"{t['us']} | {t['TFLOPs']} | {r['speedup']}x | {r['max_rel_diff_grouped_torch']:.1e} |")
    lines += ["", "| prompt dense product | type | n_out x K | tokens | GFLOP | ours µs | ours TFLOP/s | "
              "cuBLAS bf16 TFLOP/s (W decoded beforehand) | torch fp32 TFLOP/s | best tile | max rel diff |",
              "|" + "---|" * 11]
    for r in result["results"]:
        if r["kind"] == "prompt_dense":
            best = min((c for c in r.get("sweep", []) if "us" in c), key=lambda c: c["us"], default=None)
            best_tile = f"{best['config']} {best['TFLOPs']}" if best else "-"
            lines.append(f"| {r['shape']} | {r['qtype']} | {r['n_out']} x {r['K']} | {r['tokens']} | {r['GFLOP']} | "
                         f"{r['dense']['us']} | {r['dense']['TFLOPs']} | {r['cublas_bf16']['TFLOPs']} | "
                         f"{r['torch_fp32']['TFLOPs']} | {best_tile} | {r['max_rel_diff_dense_fp32']:.1e} |")
    beside = [r for r in result["results"] if "llama" in r]
    if beside:
        lines += ["", f"llama.cpp's own kernels ({result.get('llama_ops', 'test-backend-ops perf')}), its "
                  "weights' bytes per run (MUL_MAT_ID: the experts drawn, in expectation) over its µs per run; "
                  "a case repeats one weight tensor, so where it fits in L2 part of it comes from there. "
                  "`ours/llama` = our GB/s (weights from HBM, the engine's GPU layout) over its GB/s; "
                  "`one tensor`: ours timed as llama.cpp times its cases.\n",
                  "| ours | type | rows | ours µs | ours GB/s | llama.cpp case | llama.cpp µs | llama.cpp GB/s | "
                  "llama.cpp share | ours/llama per byte | one tensor: ours µs, ours/llama |", "|" + "---|" * 11]
        for r in beside:
            n, ll = engine_figure(r), r["llama"]
            what = (f"dense {r['shape']} ({r['n_out']} x {r['K']})" if r["kind"] == "dense"
                    else f"expert step {r['shape']} (gate, up, down)")
            same = (f"{r['new_one_tensor']['us']}, {r['ours_one_tensor_per_llama_per_byte']:.2f}x"
                    if "new_one_tensor" in r else "-")
            lines.append(f"| {what} | {r.get('type') or r['types'][0]} | {r['rows']} | {n['us']} | "
                         f"{n['GBps']:.0f} | {llama_case_label(ll)} | {ll['us']} | {ll['GBps']:.0f} | "
                         f"{ll['of_copy_bw']:.2f} | {r['ours_per_llama_per_byte']:.2f}x | {same} |")
    return "\n".join(lines) + "\n"


def _csv(kind, choices=None):
    def parse(text: str):
        items = [kind(v.strip()) for v in text.split(",") if v.strip()]
        if choices is not None:
            bad = [v for v in items if v not in choices]
            if bad:
                raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(map(str, choices))}")
        return items
    return parse


def run(args: argparse.Namespace) -> int:
    import torch

    from engine.quant import triton_kernels as tk

    llama_bin = llama_ops.resolve(args.llama_ops)
    if llama_bin is not None:  # before minutes of timing ours
        llama_ops.require(llama_bin)
    if not torch.cuda.is_available():
        raise UserError("bench kernels needs a CUDA GPU (this torch sees none); run it on the GPU machine")
    if tk.INTERPRETED or not tk.available():
        raise UserError("bench kernels needs Triton compiling for the GPU: install triton and unset TRITON_INTERPRET")
    import triton

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    l2_bytes = getattr(props, "L2_cache_size", 0) or 50 * 2**20
    result = {"device": props.name, "sm_count": props.multi_processor_count, "l2_bytes": l2_bytes,
              "torch": torch.__version__, "triton": triton.__version__, "copy_GBps": round(copy_gbps(dev), 1),
              # the cuBLAS baselines run with this workspace: the engine's none (engine/__init__.py) unless set
              "cublas_workspace": os.environ.get("CUBLAS_WORKSPACE_CONFIG"), "results": []}
    copy = result["copy_GBps"]
    print(f"{result['device']} ({result['sm_count']} SMs, L2 {l2_bytes >> 20} MiB)  torch {result['torch']}  "
          f"triton {result['triton']}  device copy {copy} GB/s (read + write)", flush=True)
    types = [QT[t] for t in args.types]
    args.out.mkdir(parents=True, exist_ok=True)

    def add(rows: list[dict]) -> None:  # saved as they come: a run stopped by a time limit keeps them
        result["results"] += rows
        (args.out / "kernels.json").write_text(json.dumps({**result, "partial": True}, indent=1))

    if "dense" in args.only:
        for name in args.shapes:
            n_out, K = DENSE_SHAPES[name]
            for qtype in types:
                add(bench_dense(name, n_out, K, qtype, args.rows, dev, copy, l2_bytes, args.replays, args.sweep))
    if "experts" in args.only:
        for name, sc in expert_scenarios().items():
            if set(sc.qtypes) <= set(types):
                add(bench_experts(name, sc, args.rows, dev, copy, l2_bytes, args.replays, args.steps, args.sweep))
    if "grouped" in args.only:
        for name, sc in expert_scenarios().items():
            if set(sc.qtypes) <= set(types):
                add(bench_grouped(name, sc, args.tokens, dev, args.replays, _grouped_sweep() if args.sweep else None))
    if "prompt" in args.only:
        for name, (n_out, K) in PROMPT_DENSE_SHAPES.items():
            for qtype in types:
                add(bench_prompt_dense(name, n_out, K, qtype, args.tokens, dev, args.replays,
                                       _prompt_dense_sweep() if args.sweep else None))
    if llama_bin is not None:
        torch.cuda.empty_cache()  # its own process needs the GPU memory this one no longer uses
        add_llama(result, llama_bin, args.llama_backend, args.out)
    (args.out / "kernels.json").write_text(json.dumps(result, indent=1))
    table = markdown(result)
    (args.out / "kernels.md").write_text(table)
    print(table)
    print(f"wrote {args.out / 'kernels.json'} and {args.out / 'kernels.md'}")
    return 1 if "llama_ops_error" in result else 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("kernels", help="the GPU decode kernels alone at real shapes: GB/s, share of HBM, "
                       "the dense kernel against the one it replaced; the prefill grouped GEMM's TFLOP/s",
                       description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for kernels.json and kernels.md")
    p.add_argument("--only", type=_csv(str, KINDS), default=list(KINDS),
                   help=f"any of {', '.join(KINDS)} (default all)")
    p.add_argument("--types", type=_csv(str, [t.name for t in ALL_TYPES]), default=[t.name for t in ALL_TYPES],
                   help="weight types (default all the engine loads on the GPU)")
    p.add_argument("--shapes", type=_csv(str, list(DENSE_SHAPES)), default=list(DENSE_SHAPES),
                   help="dense shapes (default all)")
    p.add_argument("--rows", type=_csv(int, list(range(1, 9))), default=list(ROWS),
                   help="activation rows, 1 to 8 (default 1,2,4,8)")
    p.add_argument("--steps", type=int, default=24, help="routing draws per expert-step graph")
    p.add_argument("--tokens", type=_csv(int), default=list(GROUPED_TOKENS),
                   help="prompt tokens of the grouped (prefill) expert step (default 512,4096)")
    p.add_argument("--replays", type=int, default=5, help="graph replays; the best counts")
    p.add_argument("--sweep", action="store_true", help="also time other tiles (and, for dense products, splits); "
                   "the best of each line is printed, and for the expert step the default timed again after them")
    p.add_argument("--llama-ops", metavar="PATH", default=None,
                   help="llama.cpp's test-backend-ops binary (default: $" + llama_ops.ENV + "): also run its "
                   "MUL_MAT / MUL_MAT_ID perf cases of our shapes and print its figures beside ours")
    p.add_argument("--llama-backend", default="CUDA0", help="test-backend-ops backend (default CUDA0)")
    p.set_defaults(run=run)
