"""Times this engine on a token stream, in a process of its own.

`python -m engine.bench.engine_runner MODEL TOKENS.json --device D [--budget-mib N] --cache C
-t THREADS --ctx N --load-mode M` prints one JSON line: after the warm-up (the "warmup" tokens as
a prompt, then one decode token), prefill tok/s on the prompt (the engine's chunked prefill, as
a request runs it, with the GB/s its expert uploads reached over PCIe and its MoE layer steps
by route; the fastest of PREFILL_REPEATS runs when every expert is resident), then teacher-forced
decode tok/s on the stream, with the expert cache's hit shares and the spread of the tokens'
times; then, when given, the same prefill figures for the "long" prompt (`long_*`); and the
kernels Triton compiled inside these timed runs (`timed_jit_compiles`, engine/bench/compiles.py:
any there means a variant the warm-up missed, its compile in a figure).
A process per configuration, as a user runs the engine: no run inherits another's state (the
CPU pool's OpenMP team, pinned host memory, the CUDA and pinned caching allocators). On the
H200, `bench scenarios` ran its configurations in one process and the 16 GiB hybrid run, the
fourth engine in it, decoded at 154 tok/s where scripts/profile_decode.py, in a fresh process,
decoded the same prompt and token order at ~200.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from engine.bench.compiles import counting_compiles
from engine.config import FIELDS


def token_times(seconds: list[float]) -> dict[str, float]:
    """Milliseconds per decode token: the first eight after the prompt (the expert cache still
    adapting to it), the median and the 90th percentile of all."""
    ms = sorted(1e3 * s for s in seconds)
    return {"first8_ms": round(1e3 * sum(seconds[:8]) / len(seconds[:8]), 3),
            "median_ms": round(ms[len(ms) // 2], 3), "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 3)}


# Timed runs of a prompt where the weights' placement cannot change between them (every expert
# resident here; llama.cpp's runs): the figure is the fastest, what the engine does when nothing
# else slows it. What varies between runs only adds time: on the H200's machine the host runs
# stretches at half speed, which a host-paced prompt follows (64 ms, then 91-108 ms, for a resident
# 512-token prompt, docs/BENCHMARKS.md, sessions 21-22), and llama.cpp's all-GPU 512-token prompt
# took 29.5 ms once and 59.5-65.0 ms in its next four runs (session 22); their median gave it half
# its speed. One run where the expert cache learns from the prompt: a repeat would see the cache
# the first run adapted to that very text.
PREFILL_REPEATS = 5


def _timed_prefill(engine, prompt: list[int], sync, repeats: int) -> tuple[list[float], float, dict[str, int] | None]:
    """Seconds of each of `repeats` prefills of `prompt` from an empty cache, the GB/s the first
    one's expert uploads (the staging slots' streamed misses, the refills) reached over PCIe, and
    its MoE layer steps by route (telemetry's prompt_steps)."""
    c = engine.telemetry.cache
    uploaded_before = c.bytes_uploaded if c is not None else 0
    steps_before = dict(c.prompt_steps) if c is not None else None
    runs, moved, steps = [], 0, None
    for i in range(repeats):
        engine.forget()
        t0 = time.perf_counter()
        engine.prefill(prompt)
        sync()
        runs.append(time.perf_counter() - t0)
        if i == 0 and c is not None:  # the first run's uploads and routes
            steps = {route: c.prompt_steps[route] - n for route, n in steps_before.items()}
            moved = c.bytes_uploaded - uploaded_before
    return runs, moved / runs[0] / 1e9, steps


def prefill_figures(runs: list[float], n_tokens: int, prefix: str = "") -> dict:
    """A prompt's timed runs as the bench reports them: the fastest's seconds and tok/s, each run's."""
    fastest = min(runs)
    return {f"{prefix}prefill_tokens_per_s": n_tokens / fastest, f"{prefix}ttft_s": fastest,
            f"{prefix}prefill_runs_s": [round(r, 4) for r in runs]}


def warm_up(model, kv, warmup: list[int], sync) -> None:
    """The warm-up every timed run starts with, llama.cpp's as well (llama_runner.py): `warmup` as
    a prompt, then one decode token. On CUDA the engine's load has already launched every kernel
    (Engine.warm_up, which learns nothing); this one, like llama.cpp's, also lets the expert cache
    see text other than the timed prompt's, and wakes the CPU pool's threads."""
    import torch

    model.forward(torch.tensor(warmup), kv, 0, last_only=True)
    model.forward(torch.tensor(warmup[-1:]), kv, len(warmup))
    sync()


def time_engine(path: Path, tokens: dict[str, list[int]], *, device: str, budget_mib: int | None,
                cache: str, threads: int, n_ctx: int, load_mode: str = "auto") -> dict:
    import torch

    from engine.moe.hybrid import attach_hybrid
    from engine.runtime.engine import Engine, EngineConfig

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    engine = Engine.load(path, EngineConfig(device=device, n_ctx=n_ctx, threads=threads,
                                            moe_expert_cache_size=cache, vram_budget_mib=budget_mib,
                                            load_mode=load_mode), attach_experts=attach_hybrid)
    model, kv = engine.model, engine.cache
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    warm_up(model, kv, tokens["warmup"], sync)
    with counting_compiles() as compiles:
        out = _timed_runs(engine, tokens, sync)
    out["timed_jit_compiles"] = compiles.as_dict()
    out["peak_vram_mib"] = torch.cuda.max_memory_allocated(dev) / 2**20 if dev.type == "cuda" else None
    if hasattr(model.experts, "close"):
        model.experts.close()  # the CPU pool's threads and the copier
    return out


def _timed_runs(engine, tokens: dict[str, list[int]], sync) -> dict:
    """The timed part of time_engine: the prompt, the stream and, when given, the long prompt."""
    import torch

    model, kv = engine.model, engine.cache
    prompt, stream = tokens["prompt"], tokens["stream"]
    c = engine.telemetry.cache
    repeats = PREFILL_REPEATS if c is None or c.slots_per_layer >= c.n_expert else 1  # every expert resident
    prefill_runs, prefill_pcie, prefill_steps = _timed_prefill(engine, prompt, sync, repeats)
    before = None if c is None else (c.gpu_hit.sum(), c.uploaded.sum(), c.cpu_computed.sum(), c.bytes_uploaded,
                                     c.gpu_mapped.sum())
    times = []
    pos = len(prompt)
    for tok in stream:  # a step returns once its token is done (the graph's replay is waited for)
        t0 = time.perf_counter()
        model.forward(torch.tensor([tok]), kv, pos)
        sync()
        times.append(time.perf_counter() - t0)
        pos += 1
    decode_s = sum(times)
    out = {**prefill_figures(prefill_runs, len(prompt)), "prefill_pcie_gb_per_s": prefill_pcie,
           "prefill_steps": prefill_steps, "decode_tokens_per_s": len(stream) / decode_s, **token_times(times)}
    if c is not None:
        out["load_mode"] = c.load_mode
        out["miss_fraction"] = c.miss_fraction
        out["miss_fraction_tuning"] = c.miss_fraction_tuning
        out["miss_routes"] = c.miss_routes
        out["decode_expert_step"] = c.decode_expert_step
        hit, up, cpu, moved, mapped = (a - b for a, b in zip((c.gpu_hit.sum(), c.uploaded.sum(), c.cpu_computed.sum(),
                                                              c.bytes_uploaded, c.gpu_mapped.sum()), before))
        total = hit + up + cpu + mapped
        out.update(slots_per_layer=c.slots_per_layer, gpu_hit=hit / total, uploaded=up / total, cpu=cpu / total,
                   mapped=mapped / total,
                   pcie_mb_per_s=moved / decode_s / 1e6, uploaded_bytes_per_token=moved / len(stream))
    if tokens.get("long"):
        long_runs, long_pcie, long_steps = _timed_prefill(engine, tokens["long"], sync, repeats)
        out.update(prefill_figures(long_runs, len(tokens["long"]), "long_"), long_prefill_pcie_gb_per_s=long_pcie,
                   long_prefill_steps=long_steps)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="engine_runner")
    p.add_argument("model", type=Path)
    p.add_argument("tokens", type=Path, help='JSON {"warmup": [...], "prompt": [...], "stream": [...], '
                   '"long": [...] (optional)}')
    p.add_argument("--device", required=True)
    p.add_argument("--budget-mib", type=int, help="the VRAM budget to emulate (none: the whole device)")
    p.add_argument("--cache", default="auto", help=FIELDS["moe_expert_cache_size"].help)
    p.add_argument("-t", "--threads", type=int, default=4)
    p.add_argument("--ctx", type=int, required=True, help=FIELDS["ctx"].help)
    p.add_argument("--load-mode", default="auto", help=FIELDS["load_mode"].help)
    args = p.parse_args(argv)
    toks = json.loads(args.tokens.read_text())
    print(json.dumps(time_engine(args.model, toks, device=args.device,
                                 budget_mib=args.budget_mib, cache=args.cache, threads=args.threads,
                                 n_ctx=args.ctx, load_mode=args.load_mode), default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
