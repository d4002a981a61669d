"""Times the grouped GEMM's tiles on one MoE layer step, each tile in a plain loop of CUDA events
(no CUDA graph), fastest first: the numbers behind engine/quant/grouped_gemm.py's defaults.

    python scripts/grouped_tiles.py --scenario "qwen3-30b-a3b Q4_K" --tokens 512,4096 \\
        --tiles 32,64,4,3 32,64,4,2 64,64,8,2

A tile is block_m,block_n,num_warps,num_stages, used by both kernels. The layer is
`moestudio bench kernels`'s (engine/bench/kernels.ExpertLayer: 128 experts in slots laid out as
the engine's, random top-k routing); the four launches of a step are timed together (round x;
gate/up + activation; round h; down x routing weight). Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

from engine.bench.kernels import GROUPED_EXPERTS, ExpertLayer, ExpertScenario, _expert_scenarios
from engine.quant import grouped_gemm as gg
from engine.quant import triton_kernels as tk


def time_tile(sc: ExpertScenario, layer: ExpertLayer, cfg: gg.GroupedConfig, n_tok: int, repeats: int = 5) -> float:
    """Best of three loops' mean µs for one layer step of n_tok tokens at tile `cfg`."""
    w, dev = layer.w, torch.device("cuda")
    g = torch.Generator().manual_seed(n_tok)
    x = torch.randn(n_tok, sc.n_embd, generator=g).to(dev)
    ids = torch.stack([torch.randperm(GROUPED_EXPERTS, generator=g)[:sc.top_k] for _ in range(n_tok)]).numpy()
    weights = torch.rand(n_tok, sc.top_k, generator=g).to(dev)
    out = torch.zeros(sc.top_k, n_tok, sc.n_embd, device=dev)
    groups = gg.Groups.build(ids, np.arange(GROUPED_EXPERTS, dtype=np.int32), cfg.block_m, dev)

    def step() -> None:
        xg = tk.round_rows(x, w.gate.qtype)
        h = gg.gate_up(xg, xg, layer.buffers[0], layer.buffers[1], w, groups, cfg)
        gg.down(tk.round_rows(h, w.down.qtype), layer.buffers[2], w, groups, weights, out, cfg)

    step()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            step()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / repeats)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", default="qwen3-30b-a3b Q4_K", help="an expert scenario of bench kernels")
    ap.add_argument("--tokens", default="512,4096")
    ap.add_argument("--tiles", nargs="+", default=["32,64,4,3", "32,64,4,2", "64,64,8,2"])
    args = ap.parse_args()
    sc = _expert_scenarios()[args.scenario]
    layer = ExpertLayer(sc, torch.device("cuda"), 0, n_slots=GROUPED_EXPERTS)
    for n_tok in map(int, args.tokens.split(",")):
        flops = 6.0 * n_tok * sc.top_k * sc.n_embd * sc.n_ff
        rows = []
        for tile in args.tiles:
            cfg = gg.GroupedConfig(*map(int, tile.split(",")))
            us = time_tile(sc, layer, cfg, n_tok)
            rows.append((us, f"m{cfg.block_m}n{cfg.block_n}w{cfg.num_warps}s{cfg.num_stages}"))
        rows.sort()
        print(args.scenario, n_tok, " ".join(f"{name}:{us:.0f}us/{flops / us / 1e6:.1f}TF" for us, name in rows),
              flush=True)


if __name__ == "__main__":
    main()
