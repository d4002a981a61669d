"""Where a decode token's time goes, on one model: the token graph's host phases and the CPU pool.

python scripts/profile_decode.py MODEL [--budget-mib N] [--tokens 64] [--ctx 4096] [--out DIR] [--profile]
Runs `bench speed`'s order (warm-up, the prompt, then decode) and prints: the load's time and the
Triton compiles in it (an empty Triton cache: the first load's cost); the prompt's time and
the CPU pool's share of it (what `bench` reports as time to first token), each of the first 32
tokens after the prompt (wall time, CPU-computed selections: the residency's adaptation); then per
token of the next TOKENS: wall time, host time in each phase of the token step (engine/moe/token_step.py:
map push, mailbox serving, and after_launch, whose excess over serving is the learning the
serving's waits did not hide), the CPU pool's calls, experts and time, and the spin the
host spends waiting for the GPU to reach the next layer; then one-row CPU pool timings for 1-8
experts at several thread counts; and the 512-token prompt again, warm: its wall time, the CPU
pool's share and (with --profile) the GPU's busy time and top kernels, the host's top CUDA
runtime calls and its top Python functions (cProfile). With --profile, the torch profiler's
tables go to DIR.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import torch


def _timed(obj, name: str, into: dict, count_experts: bool = False) -> None:
    fn = getattr(obj, name)

    def wrapper(*a, **k):
        t = time.perf_counter()
        r = fn(*a, **k)
        into[name] += time.perf_counter() - t
        into[name + "_calls"] += 1
        if count_experts:
            into["experts"] += len(a[-1])
        return r

    setattr(obj, name, wrapper)


def _stage(what: str, t0: float) -> None:
    """Progress on stderr as it happens: a run stopped by a time limit still says how far it got."""
    print(f"[{time.perf_counter() - t0:7.1f} s] {what}", file=sys.stderr, flush=True)


def gpu_timeline(pr, n_tokens: int) -> dict:
    """Per token: GPU kernels launched, their busy time (the union of their intervals) with and
    without the collect kernel's waits for the host, and the span from first kernel to last."""
    kernels = [(e.time_range.start, e.time_range.end, e.name) for e in pr.events()
               if e.device_type.name == "CUDA" and "Memcpy" not in e.name and "Memset" not in e.name]
    if not kernels:
        return {}
    kernels.sort()

    def union(iv) -> float:
        total, end = 0.0, float("-inf")
        for a, b, _ in iv:
            if b > end:
                total += b - max(a, end)
                end = b
        return total

    span = kernels[-1][1] - kernels[0][0]
    waits = [k for k in kernels if "collect" in k[2]]
    return {"kernels": len(kernels) / n_tokens, "span_us": span / n_tokens, "busy_us": union(kernels) / n_tokens,
            "busy_without_collect_us": union([k for k in kernels if "collect" not in k[2]]) / n_tokens,
            "collect_us": sum(b - a for a, b, _ in waits) / n_tokens}


def host_functions(fn, rows: int = 30) -> str:
    """`fn` (then a device sync) under cProfile: the functions with the most time of their own."""
    import cProfile
    import io
    import pstats

    with cProfile.Profile() as cp:
        fn()
        torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(cp, stream=text).sort_stats("tottime").print_stats(rows)
    return text.getvalue()


def _prefill(m, kv, ids: list[int], profile: bool, t0: float) -> dict:
    """The 512-token prompt again, warm, as the engine runs it (the last row's logits): wall time
    and the CPU pool's share; with the profiler the GPU's busy time and its share of the wall
    time (how much of a prompt the GPU spends waiting), the top kernels and the host's top
    calls and functions."""
    phases: dict = defaultdict(float)
    pool = m.experts.pool
    pool.__dict__.pop("compute", None)  # the decode figures' timer stays out of the prompt's
    _timed(pool, "compute", phases, count_experts=True)
    prompt = torch.tensor(ids[:512])
    torch.cuda.synchronize()
    t = time.perf_counter()
    m.forward(prompt, kv, 0, last_only=True)
    torch.cuda.synchronize()
    r = {"wall_s": time.perf_counter() - t, "pool_s": phases["compute"], "pool_calls": phases["compute_calls"],
         "pool_pairs": phases["experts"]}
    if profile:
        from torch.profiler import ProfilerActivity, profile as prof

        with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as pr:
            m.forward(prompt, kv, 0, last_only=True)
            torch.cuda.synchronize()
        r["gpu_timeline"] = gpu_timeline(pr, n_tokens=1)
        # the GPU's busy time over the unprofiled wall time: far below 1, the host's launches bind
        # the prompt (holding the GPU behind a sleep kernel cannot tell: a prompt's ~1,200
        # launches fill the launch queue, and the host then waits for the GPU anyway)
        r["gpu_busy_share"] = r["gpu_timeline"]["busy_us"] / 1e6 / r["wall_s"]
        ka = pr.key_averages()
        r["top_kernels"] = ka.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60)
        # the host's side: CUDA runtime calls (a long cudaStreamSynchronize or allocation is a wait
        # inside the prompt) and, under cProfile, the Python functions that launch the kernels
        r["top_host_ops"] = ka.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)
        r["top_host_functions"] = host_functions(lambda: m.forward(prompt, kv, 0, last_only=True))
    pool.__dict__.pop("compute", None)
    _stage("prefill profiled", t0)
    return r


def run(model: Path, budget: int | None, tokens: int, threads: int, ctx: int, out: Path, profile: bool) -> dict:
    from engine.bench.compiles import counting_compiles
    from engine.moe.hybrid import attach_hybrid
    from engine.runtime.engine import Engine, EngineConfig
    from engine.runtime.tokenizer import tokenize_text
    from engine.synth.corpus import stdlib_text

    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with counting_compiles() as load_compiles:
        engine = Engine.load(model, EngineConfig(device="cuda", n_ctx=max(ctx, tokens + 600), threads=threads,
                                                 vram_budget_mib=budget), attach_experts=attach_hybrid)
    load = {"seconds": time.perf_counter() - t0, "compiles": load_compiles.count,
            "compiles_by_kernel": dict(Counter(load_compiles.kernels).most_common())}
    m, kv = engine.model, engine.cache
    ids = tokenize_text(model, stdlib_text(max_chars=(tokens + 600) * 8))  # the stream `bench speed` decodes
    _stage("loaded", t0)
    # `bench speed`'s order: a short warm-up and the graph's capture, then the prompt, then decode
    m.forward(torch.tensor(ids[:8]), kv, 0, last_only=True)
    m.forward(torch.tensor(ids[8:9]), kv, 8)
    torch.cuda.synchronize()
    first_prompt: dict = defaultdict(float)  # the time to first token `bench` measures
    _timed(m.experts.pool, "compute", first_prompt, count_experts=True)
    t = time.perf_counter()
    m.forward(torch.tensor(ids[:512]), kv, 0, last_only=True)
    torch.cuda.synchronize()
    first_prompt["wall"] = time.perf_counter() - t
    m.experts.pool.__dict__.pop("compute")
    _stage("warm-up, graph capture, prompt (a kernel the load's warm-up missed compiles here)", t0)
    c = engine.telemetry.cache
    first_ms, first_cpu = [], []  # each of the first 32 tokens after the prompt: adaptation shows here
    for p in range(512, 544):
        torch.cuda.synchronize()
        t, cpu = time.perf_counter(), c.cpu_computed.sum()
        m.forward(torch.tensor([ids[p]]), kv, p)
        torch.cuda.synchronize()
        first_ms.append(round(1e3 * (time.perf_counter() - t), 2))
        first_cpu.append(int(c.cpu_computed.sum() - cpu))  # the telemetry trails the GPU by one token
    _stage("the first 32 tokens after the prompt", t0)
    tx = m._runner.token_experts
    phases: dict = defaultdict(float)
    if tx is not None:
        for name in ("_push_map", "after_launch"):  # after_launch - serve: learning the serving's waits did not hide
            _timed(tx, name, phases)
        _timed(tx.mailbox, "serve", phases)
    _timed(m.experts.pool, "compute", phases, count_experts=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for p in range(544, 544 + tokens):
        m.forward(torch.tensor([ids[p]]), kv, p)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    _stage(f"{tokens} timed tokens", t0)
    if profile:
        from torch.profiler import ProfilerActivity, profile as prof

        with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as pr:
            for p in range(544 + tokens, 552 + tokens):
                m.forward(torch.tensor([ids[p]]), kv, p)
            torch.cuda.synchronize()
        ka = pr.key_averages()
        (out / "profile_decode.txt").write_text(ka.table(sort_by="self_cuda_time_total", row_limit=60,
                                                          max_name_column_width=70))
        timeline = gpu_timeline(pr, n_tokens=8)
        _stage("profiled", t0)
    r_prefill = _prefill(m, kv, ids, profile, t0)
    total = c.gpu_hit.sum() + c.uploaded.sum() + c.cpu_computed.sum()
    per_token = {k: (1e3 * v / tokens if not k.endswith("_calls") and k != "experts" else v / tokens)
                 for k, v in phases.items()}
    r = {"decode_tok_s": tokens / wall, "ms_per_token": 1e3 * wall / tokens, "slots": c.slots_per_layer,
         "hit": float(c.gpu_hit.sum() / total), "graph": tx is not None, "per_token_ms_or_count": per_token,
         "cpu_ms_per_expert": 1e3 * phases["compute"] / max(1, phases["experts"]),
         "peak_vram_mib": torch.cuda.max_memory_allocated() / 2**20}
    if profile:
        r["gpu_timeline_per_token"] = timeline
    r["prefill_512"] = r_prefill
    r["first_tokens"] = {"ms": first_ms, "cpu_selections": first_cpu}
    r["first_prompt_s"] = dict(first_prompt)
    r["load"] = load
    pool_w = m.experts.pool
    layer = min(m.expert_weights)
    x = np.random.default_rng(0).standard_normal((1, m.config.n_embd)).astype(np.float32)
    m.experts.close()
    from engine.moe.cpu_pool import CpuExpertPool

    bench = {}
    layers = sorted(m.expert_weights)
    rng = np.random.default_rng(1)
    n_expert = m.expert_weights[layer].n_expert
    for n_threads in (8, 16):
        with CpuExpertPool(m.expert_weights, n_threads) as pool:
            for n in (1, 2, 4, 8):
                experts = np.arange(n, dtype=np.int32) * 3
                pool.compute(layer, x, np.zeros(n, np.int32), experts)
                t = time.perf_counter()
                for _ in range(50):  # the same experts: warm in the L3 cache
                    pool.compute(layer, x, np.zeros(n, np.int32), experts + 1)
                bench[f"t{n_threads}_e{n}_warm_us"] = 1e6 * (time.perf_counter() - t) / 50
                t = time.perf_counter()
                for _ in range(3):  # layer after layer, random experts: from DRAM, as a decode token reads them
                    for lay in layers:
                        pool.compute(lay, x, np.zeros(n, np.int32),
                                     rng.choice(n_expert, n, replace=False).astype(np.int32))
                bench[f"t{n_threads}_e{n}_cold_us"] = 1e6 * (time.perf_counter() - t) / (3 * len(layers))
            # one expert every 5 ms, as a decode token's rare misses come: the pool's threads
            # sleep in between unless OpenMP keeps them spinning
            spent = 0.0
            for lay in layers:
                time.sleep(0.005)
                t = time.perf_counter()
                pool.compute(lay, x, np.zeros(1, np.int32), rng.choice(n_expert, 1).astype(np.int32))
                spent += time.perf_counter() - t
            bench[f"t{n_threads}_e1_gap5ms_us"] = 1e6 * spent / len(layers)
    r["pool_one_row"] = bench
    del pool_w
    return r


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model", type=Path)
    p.add_argument("--budget-mib", type=int)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=16)
    p.add_argument("--ctx", type=int, default=4096,
                   help="the engine's context (attention reads it; default: the product's)")
    p.add_argument("--out", type=Path, default=Path("."))
    p.add_argument("--profile", action="store_true")
    a = p.parse_args()
    r = run(a.model, a.budget_mib, a.tokens, a.threads, a.ctx, a.out, a.profile)
    print(json.dumps(r, indent=1))
    (a.out / "profile_decode.json").write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
