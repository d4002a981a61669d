"""Where a decode step's time goes: torch profiler table plus coarse timers, on one model.

python scripts/profile_decode.py MODEL --budget-mib N [--tokens 32] [--out DIR]
Writes profile_<label>.txt (the profiler's top ops by self CPU and CUDA time) and prints
per-token wall time split into MoE executor time and everything else, for load modes
mmap and none (issue 4 asks for that comparison).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def run(model: Path, budget: int | None, tokens: int, load_mode: str, out: Path, threads: int, profile: bool,
        cache: str = "auto") -> dict:
    from engine.moe.hybrid import attach_hybrid
    from engine.runtime.engine import Engine, EngineConfig

    t0 = time.perf_counter()
    engine = Engine.load(model, EngineConfig(device="cuda", n_ctx=tokens + 64, threads=threads,
                                             vram_budget_mib=budget, load_mode=load_mode,
                                             moe_expert_cache_size=cache), attach_experts=attach_hybrid)
    load_s = time.perf_counter() - t0
    m, kv = engine.model, engine.cache
    hybrid = m.experts
    moe_time = [0.0]
    call = hybrid.__call__

    def timed(*a):
        t = time.perf_counter()
        r = call(*a)
        moe_time[0] += time.perf_counter() - t
        return r

    m.experts = timed
    ids = [(i * 7919) % 2000 + 3 for i in range(tokens + 40)]
    m.forward(torch.tensor(ids[:16]), kv, 0)
    for p in range(16, 40):
        m.forward(torch.tensor([ids[p]]), kv, p)
    torch.cuda.synchronize()
    moe_time[0] = 0.0
    t = time.perf_counter()
    for p in range(40, 40 + tokens):
        m.forward(torch.tensor([ids[p]]), kv, p)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    if profile:
        from torch.profiler import ProfilerActivity, profile as prof

        with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as pr:
            for p in range(40 + tokens, 48 + tokens):
                m.forward(torch.tensor([ids[p % len(ids)]]), kv, p)
            torch.cuda.synchronize()
        ka = pr.key_averages()
        (out / f"profile_{load_mode}.txt").write_text(
            ka.table(sort_by="self_cpu_time_total", row_limit=40) + "\n\n"
            + ka.table(sort_by="self_cuda_time_total", row_limit=25))
    c = engine.telemetry.cache
    total = c.gpu_hit.sum() + c.uploaded.sum() + c.cpu_computed.sum()
    r = {"load_mode": load_mode, "load_s": load_s, "decode_tok_s": tokens / wall, "ms_per_token": 1e3 * wall / tokens,
         "moe_ms_per_token": 1e3 * moe_time[0] / tokens, "slots": c.slots_per_layer,
         "hit": float(c.gpu_hit.sum() / total), "uploaded": float(c.uploaded.sum() / total),
         "triton_broken": hybrid._triton_broken, "bytes_uploaded": int(c.bytes_uploaded),
         "peak_vram_mib": torch.cuda.max_memory_allocated() / 2**20}
    hybrid.close()
    del engine, m, kv, hybrid
    import gc

    gc.collect()
    torch.cuda.empty_cache()  # the next load mode's auto-sizing must not see this one's memory
    return r


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model", type=Path)
    p.add_argument("--budget-mib", type=int)
    p.add_argument("--cache", default="auto", help="expert cache size: auto (from the budget), all or N")
    p.add_argument("--load-modes", default="mmap,none")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=16)
    p.add_argument("--out", type=Path, default=Path("."))
    a = p.parse_args()
    results = [run(a.model, a.budget_mib, a.tokens, mode, a.out, a.threads, profile=mode == "mmap", cache=a.cache)
               for mode in a.load_modes.split(",")]
    for r in results:
        print(json.dumps(r))
    (a.out / "profile_decode.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
