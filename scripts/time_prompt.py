"""Whether a prompt waits for the host or for the GPU: the prompt as `bench scenarios` times it.

    python scripts/time_prompt.py MODEL LABEL [--repeats 7] [--prompt 512] [--budget-mib M] [--host-profile]

Loads MODEL (every expert resident unless --budget-mib), runs the bench's warm-up, then prefills
the bench's prompt REPEATS times from an empty cache (engine.forget, then engine.prefill, as
engine/bench/engine_runner.py times a time to first token) and once more under the torch
profiler. Prints one JSON line: LABEL, the load's seconds, each prompt's wall ms and their
median, `enqueued_ms` (median time until the host first waits for a CUDA stream, which a
resident eager prompt does only at its last MoE layer: its launches issued by then; NaN where it
never waits, as a prompt replayed as CUDA graphs), the profiled prompt's GPU busy ms (the union of
its kernels' intervals) and kernel count, and `graph_replays`, the chunks replayed as CUDA graphs
(engine/runtime/prompt_runner.py; MOESTUDIO_CUDA_GRAPHS=0 runs them eagerly); before each
prompt, two fixed probes: `host_probe_ms`, a pure-Python loop, and
`gpu_probe_ms`, ten 4096x4096 bf16 products timed by CUDA events (one thread's speed and the
GPU's clocks: whether a slow prompt came with a slow host or a slow GPU); then the profiled
prompt's top kernels and, with --host-profile, one more prompt's top Python functions under
cProfile (by own time). With enqueued close to wall and busy well under it, the host's launches
set the prompt's pace. Run each version to compare in its own process.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def main() -> int:
    from torch.profiler import ProfilerActivity, profile

    # this folder's: the profiled kernels' busy time; the host's top functions under cProfile
    from profile_decode import gpu_timeline, host_functions

    from engine.bench.engine_runner import warm_up
    from engine.bench.speed import bench_tokens
    from engine.moe.hybrid import attach_hybrid
    from engine.runtime.engine import Engine, EngineConfig

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("label")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens (default 512)")
    p.add_argument("--budget-mib", type=int, help="VRAM budget (default: every expert resident)")
    p.add_argument("-t", "--threads", type=int, default=16)
    p.add_argument("--host-profile", action="store_true", help="also the host's Python functions under cProfile")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("time_prompt needs a CUDA GPU")
    t0 = time.perf_counter()
    tokens = bench_tokens(args.model, args.prompt, 8, 0)
    cache = "auto" if args.budget_mib else "all"
    engine = Engine.load(args.model, EngineConfig(device="cuda", n_ctx=4112, threads=args.threads,
                                                  moe_expert_cache_size=cache, vram_budget_mib=args.budget_mib),
                         attach_experts=attach_hybrid)
    load_s = time.perf_counter() - t0
    warm_up(engine.model, engine.cache, tokens["warmup"], torch.cuda.synchronize)
    waits: list[float] = []
    synchronize = torch.cuda.Stream.synchronize

    def marked(stream):
        waits.append(time.perf_counter())
        return synchronize(stream)

    walls, enqueued, host_probe, gpu_probe = [], [], [], []
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.Stream.synchronize = marked
    try:
        for _ in range(args.repeats):
            engine.forget()
            host_probe.append(_host_probe_ms())
            gpu_probe.append(_gpu_probe_ms(a))
            waits.clear()
            torch.cuda.synchronize()
            t = time.perf_counter()
            engine.prefill(tokens["prompt"])
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t)
            enqueued.append(waits[0] - t if waits else float("nan"))
    finally:
        torch.cuda.Stream.synchronize = synchronize
    engine.forget()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.prefill(tokens["prompt"])
        torch.cuda.synchronize()
    timeline = gpu_timeline(prof, n_tokens=1)
    print(json.dumps({"label": args.label, "load_s": round(load_s, 1), "wall_ms": [round(1e3 * w, 2) for w in walls],
                      "median_ms": round(1e3 * statistics.median(walls), 2),
                      "enqueued_ms": round(1e3 * statistics.median(enqueued), 2),
                      "busy_ms": round(timeline["busy_us"] / 1e3, 2), "kernels": int(timeline["kernels"]),
                      "graph_replays": getattr(engine.model._prompt_runner, "replays", 0),
                      "host_probe_ms": [round(t, 2) for t in host_probe],
                      "gpu_probe_ms": [round(t, 2) for t in gpu_probe]}), flush=True)
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=50))
    if args.host_profile:
        engine.forget()
        torch.cuda.synchronize()
        print(host_functions(lambda: engine.prefill(tokens["prompt"])))
    return 0


def _host_probe_ms() -> float:
    """A fixed pure-Python loop's ms: the launching thread's own speed."""
    t = time.perf_counter()
    total = 0
    for i in range(200_000):
        total += i & 7
    return 1e3 * (time.perf_counter() - t)


def _gpu_probe_ms(a: torch.Tensor) -> float:
    """Ten products of `a` by itself, GPU ms between two events: the GPU's speed, not the host's."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(10):
        a @ a
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


if __name__ == "__main__":
    raise SystemExit(main())
