"""Where a long prompt's time goes at an emulated VRAM budget, chunk by chunk, by expert route.

    python scripts/prompt_chunks.py MODEL --budget-gib 8 [--geometry qwen3-30b-a3b] [--long 4096] [--chunk 512]

A model that `moestudio bench scenarios` wrote (`--geometry`: the preset it shortened, for the
emulated budget). After the bench's warm-up (its 64 tokens, one decode token) it prefills the
bench's long prompt three times from an empty cache: as the engine routes it, with every
many-row step reading its routing back (no streamed steps), and as the engine routes it again.
One decode token follows each prefill, as a reply's first. Each line: the route, its seconds,
then per chunk (`--chunk`, the engine's prefill_chunk: a larger one streams each missing expert
once for more rows, and its workspace leaves fewer expert slots) its seconds, the GB copied to
the GPU (streamed turns and refills), the (row, expert) pairs that hit, were uploaded, or ran on
the CPU, the CPU pool's busy seconds, the executor's read-back idle estimate after it
(`read_back_s`, ms), the kernels Triton compiled in it (engine/bench/compiles.py) and its MoE
layer steps by route (streamed, resident, read back). Writes chunks.json to --out, and with
--profile torch profiles of a new prompt's fourth chunk as the engine routes it and of its first
chunk read back.
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

import engine.moe.hybrid as hybrid
from engine.bench.compiles import counting_compiles
from engine.bench.engine_runner import warm_up
from engine.bench.scenarios import emulated_budget_mib
from engine.bench.speed import bench_tokens
from engine.runtime.engine import Engine, EngineConfig

BENCH_PROMPT, BENCH_DECODE = 512, 64  # `bench scenarios`' defaults: its long prompt follows their text


def _chunks(engine: Engine, tokens: list[int], sync) -> list[dict]:
    model, kv, c, chunk = engine.model, engine.cache, engine.telemetry.cache, engine.config.prefill_chunk
    engine.forget()
    rows = []
    for start in range(0, len(tokens), chunk):
        steps = dict(c.prompt_steps)
        before = (c.bytes_uploaded, c.gpu_hit.sum(), c.uploaded.sum(), c.cpu_computed.sum())
        cpu_busy = c.cpu_busy_s
        t0 = time.perf_counter()
        with counting_compiles() as compiles:
            model.forward(torch.tensor(tokens[start:start + chunk]), kv, start, last_only=True)
            sync()
        seconds = time.perf_counter() - t0
        moved, hit, up, cpu = (int(a - b) for a, b in zip(
            (c.bytes_uploaded, c.gpu_hit.sum(), c.uploaded.sum(), c.cpu_computed.sum()), before))
        rows.append({"s": round(seconds, 4), "GB": round(moved / 1e9, 3), "hit": hit, "up": up, "cpu": cpu,
                     "cpu_pool_s": round(c.cpu_busy_s - cpu_busy, 4),
                     "read_back_ms": round(model.experts.read_back_s * 1e3, 3), "compiles": compiles.count,
                     **{route: c.prompt_steps[route] - n for route, n in steps.items()}})
    model.forward(torch.tensor(tokens[-1:]), kv, len(tokens))  # a reply's first token: the next prompt is another's
    sync()
    return rows


@contextmanager
def _route(name: str) -> Iterator[None]:
    """The engine's routing ("engine..."), or every many-row step reading its routing back."""
    streams_all = hybrid.streams_all
    hybrid.streams_all = streams_all if name.startswith("engine") else (lambda *a: False)
    try:
        yield
    finally:
        hybrid.streams_all = streams_all


def _profile(engine: Engine, tokens: list[int], chunk: int, sync) -> str:
    """A torch profile of chunk `chunk` of a new prompt (after a decode token): the GPU's
    kernels and copies, then the host's own time."""
    from torch.profiler import ProfilerActivity, profile

    model, kv, size = engine.model, engine.cache, engine.config.prefill_chunk
    engine.forget()
    model.forward(torch.tensor(tokens[-1:]), kv, 0)  # a decode token: the prompt is a new one
    for start in range(0, chunk * size, size):
        model.forward(torch.tensor(tokens[start:start + size]), kv, start, last_only=True)
    sync()
    start = chunk * size
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        model.forward(torch.tensor(tokens[start:start + size]), kv, start, last_only=True)
        sync()
    averages = prof.key_averages()
    return (averages.table(sort_by="cuda_time_total", row_limit=30) + "\n"
            + averages.table(sort_by="self_cpu_time_total", row_limit=30))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="prompt_chunks", description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument("--budget-gib", type=float, required=True)
    p.add_argument("--geometry", default="qwen3-30b-a3b")
    p.add_argument("--long", type=int, default=4096, help="prompt tokens (default 4096)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--threads", type=int, default=16)
    p.add_argument("--chunk", type=int, default=EngineConfig.prefill_chunk, help="prompt tokens per forward pass")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", type=Path, default=Path("."))
    args = p.parse_args(argv)
    if args.profile and args.long < 4 * args.chunk:
        p.error(f"--profile times a fourth chunk: --long must be at least {4 * args.chunk}")

    budget = emulated_budget_mib(args.model, args.geometry, args.budget_gib)
    tokens = bench_tokens(args.model, BENCH_PROMPT, BENCH_DECODE, args.long)
    long = tokens["long"]
    engine = Engine.load(args.model, EngineConfig(device=args.device, n_ctx=len(long) + 16, threads=args.threads,
                                                  moe_expert_cache_size="auto", vram_budget_mib=budget,
                                                  prefill_chunk=args.chunk),
                         attach_experts=hybrid.attach_hybrid)
    sync = (lambda: torch.cuda.synchronize()) if torch.device(args.device).type == "cuda" else (lambda: None)
    warm_up(engine.model, engine.cache, tokens["warmup"], sync)
    c = engine.telemetry.cache
    result = {"budget_mib": budget, "chunk": args.chunk, "slots_per_layer": c.slots_per_layer,
              "tuning": c.miss_fraction_tuning}
    print(f"chunk {args.chunk}: {c.slots_per_layer} expert slots a layer", flush=True)
    for name in ("engine", "read back", "engine again"):
        with _route(name):
            result[name] = _chunks(engine, long, sync)
        print(name, round(sum(r["s"] for r in result[name]), 3), result[name], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "chunks.json").write_text(json.dumps(result, indent=1))
    if args.profile:
        for name, chunk in (("engine", 3), ("read back", 0)):
            with _route(name):
                table = _profile(engine, long, chunk, sync)
            (args.out / f"profile_{name.replace(' ', '_')}_chunk{chunk + 1}.txt").write_text(table)
    engine.model.experts.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
