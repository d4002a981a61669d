"""Whether a prompt waits for the host or for the GPU: the prompt as `bench scenarios` times it.

    python scripts/time_prompt.py MODEL LABEL [--repeats 7] [--prompt 512] [--graphs on,off]
                                  [--budget-mib M] [--host-profile]

Loads MODEL (every expert resident unless --budget-mib), runs the bench's warm-up, then prefills
the bench's prompt REPEATS times from an empty cache (engine.forget, then engine.prefill, as
engine/bench/engine_runner.py times a time to first token) and once more under the torch
profiler. With --graphs on,off each repeat runs the prompt once per setting of
MOESTUDIO_CUDA_GRAPHS, in turn (full chunks replayed as CUDA graphs, engine/runtime/prompt_runner.py,
or launched one by one), so that a slow stretch of the host hits both alike; each setting first
runs the prompt twice untimed (a chunk start's first chunk is captured after running eagerly).
Prints one JSON line per setting: LABEL, the load's seconds, each prompt's wall ms, their fastest
and median, `enqueued_ms` (median time until the host first waits for a CUDA stream, which a
resident eager prompt does only at its last MoE layer: its launches issued by then; NaN where it
never waits), the profiled prompt's GPU busy ms (the union of its kernels' intervals) and kernel
count, `graph_replays` (the chunks replayed over the whole run) and, before each prompt, two fixed
probes: `host_probe_ms`, a pure-Python loop, and `gpu_probe_ms`, ten 4096x4096 bf16 products
timed by CUDA events (one thread's speed and the GPU's clocks: whether a slow prompt came with a
slow host or a slow GPU); then the first setting's profiled top kernels and, with --host-profile,
one more prompt's top Python functions under cProfile (by own time). With enqueued close to wall
and busy well under it, the host's launches set the prompt's pace. Compare code versions each in
its own process.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

GRAPH_SETTINGS = {"on": "1", "off": "0"}  # --graphs names -> MOESTUDIO_CUDA_GRAPHS


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
    p.add_argument("--graphs", default=None,
                   help="comma-separated MOESTUDIO_CUDA_GRAPHS settings run in turn: on, off (default: as set)")
    p.add_argument("--budget-mib", type=int, help="VRAM budget (default: every expert resident)")
    p.add_argument("-t", "--threads", type=int, default=16)
    p.add_argument("--host-profile", action="store_true", help="also the host's Python functions under cProfile")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("time_prompt needs a CUDA GPU")
    settings = args.graphs.split(",") if args.graphs else [None]
    if any(g is not None and g not in GRAPH_SETTINGS for g in settings):
        sys.exit(f"--graphs takes {', '.join(GRAPH_SETTINGS)}")
    t0 = time.perf_counter()
    tokens = bench_tokens(args.model, args.prompt, 8, 0)
    cache = "auto" if args.budget_mib else "all"
    engine = Engine.load(args.model, EngineConfig(device="cuda", n_ctx=4112, threads=args.threads,
                                                  moe_expert_cache_size=cache, vram_budget_mib=args.budget_mib),
                         attach_experts=attach_hybrid)
    load_s = time.perf_counter() - t0
    warm_up(engine.model, engine.cache, tokens["warmup"], torch.cuda.synchronize)

    def use(setting: str | None) -> None:
        if setting is not None:
            os.environ["MOESTUDIO_CUDA_GRAPHS"] = GRAPH_SETTINGS[setting]

    def prompt() -> None:
        engine.forget()
        torch.cuda.synchronize()
        engine.prefill(tokens["prompt"])
        torch.cuda.synchronize()

    for setting in settings:
        use(setting)
        prompt()
        prompt()
    waits: list[float] = []
    synchronize = torch.cuda.Stream.synchronize

    def marked(stream):
        waits.append(time.perf_counter())
        return synchronize(stream)

    runs = {s: {"walls": [], "enqueued": [], "host_probe": [], "gpu_probe": []} for s in settings}
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.Stream.synchronize = marked
    try:
        for _ in range(args.repeats):
            for setting in settings:
                use(setting)
                r = runs[setting]
                engine.forget()
                r["host_probe"].append(_host_probe_ms())
                r["gpu_probe"].append(_gpu_probe_ms(a))
                waits.clear()
                torch.cuda.synchronize()
                t = time.perf_counter()
                engine.prefill(tokens["prompt"])
                torch.cuda.synchronize()
                r["walls"].append(time.perf_counter() - t)
                r["enqueued"].append(waits[0] - t if waits else float("nan"))
    finally:
        torch.cuda.Stream.synchronize = synchronize
    replays = getattr(engine.model._prompt_runner, "replays", 0)
    for i, setting in enumerate(settings):
        use(setting)
        engine.forget()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.prefill(tokens["prompt"])
            torch.cuda.synchronize()
        timeline = gpu_timeline(prof, n_tokens=1)
        r = runs[setting]
        print(json.dumps({"label": args.label, "graphs": setting, "load_s": round(load_s, 1),
                          "wall_ms": [round(1e3 * w, 2) for w in r["walls"]],
                          "fastest_ms": round(1e3 * min(r["walls"]), 2),
                          "median_ms": round(1e3 * statistics.median(r["walls"]), 2),
                          "enqueued_ms": round(1e3 * statistics.median(r["enqueued"]), 2),
                          "busy_ms": round(timeline["busy_us"] / 1e3, 2), "kernels": int(timeline["kernels"]),
                          "graph_replays": replays,
                          "host_probe_ms": [round(t, 2) for t in r["host_probe"]],
                          "gpu_probe_ms": [round(t, 2) for t in r["gpu_probe"]]}), flush=True)
        if i == 0:
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=50))
    if args.host_profile:
        use(settings[0])
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
