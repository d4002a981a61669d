"""`moestudio bench speed`: this engine against llama.cpp, side by side, in one run.

Same GGUF, same token stream, same VRAM budget. Decode is teacher-forced on real text (every
engine routes the same tokens), prefill runs a fixed prompt (and, with --long-prompt-tokens, a
long one). Each engine first runs the same warm-up, WARMUP_TOKENS of other text as one prompt and
one decode token: the prompt's kernels (batched products, attention over many rows) load there,
not inside the timed prompt. Configurations, each timed in a process of its own
(engine/bench/engine_runner.py, llama_runner.py):
  hybrid        this engine with its defaults at the budget
  hybrid-mmap   the same with --load-mode mmap (experts read from the memory map, not pinned RAM)
  resident      this engine with every expert on the GPU (budget ignored)
  llama-split   llama.cpp with the fewest --n-cpu-moe layers whose GPU bytes fit the budget
  llama-gpu     llama.cpp with every expert on the GPU (budget ignored)
Reports tok/s, TTFT, hit rates, bytes read from host RAM per token, PCIe MB/s, peak VRAM and
the share of the bandwidth bound reached (bound = RAM bytes / RAM bandwidth + VRAM bytes /
HBM bandwidth per token, both bandwidths measured here).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from engine.config import FIELDS, Config, resolve_device
from engine.plan.sizing import resolve_ctx

if TYPE_CHECKING:
    import torch

MiB = 2**20
# The warm-up's prompt: long enough that every engine takes its many-row paths (this engine's
# grouped expert GEMM starts above 64 token-expert pairs), short enough to cost little.
WARMUP_TOKENS = 64


def measure_bandwidths(device: torch.device, threads: int) -> dict[str, float]:
    """GB/s of a host memory read (numpy sums over 2 GiB, on `threads` threads, as the CPU pool
    reads), of a pinned host-to-device copy, and of a device-to-device copy."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    host = np.ones(2**29, np.float32)
    chunks = np.array_split(host, threads)
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(np.sum, chunks))
        t = time.perf_counter()
        for _ in range(3):
            list(ex.map(np.sum, chunks))  # numpy releases the GIL while it sums
        ram = 3 * host.nbytes / (time.perf_counter() - t) / 1e9
    out = {"ram_read_gbs": ram, "ram_threads": threads}
    if device.type == "cuda":
        a = torch.empty(2**30, dtype=torch.uint8, device=device)
        b = torch.empty_like(a)
        b.copy_(a)
        torch.cuda.synchronize(device)
        t = time.perf_counter()
        for _ in range(10):
            b.copy_(a)
        torch.cuda.synchronize(device)
        out["hbm_gbs"] = 10 * 2 * a.numel() / (time.perf_counter() - t) / 1e9
        pinned = torch.empty(2**28, dtype=torch.uint8).pin_memory()
        b[:pinned.numel()].copy_(pinned, non_blocking=True)
        torch.cuda.synchronize(device)
        t = time.perf_counter()
        for _ in range(5):
            b[:pinned.numel()].copy_(pinned, non_blocking=True)
        torch.cuda.synchronize(device)
        out["h2d_pinned_gbs"] = 5 * pinned.numel() / (time.perf_counter() - t) / 1e9
        del a, b, pinned
        torch.cuda.empty_cache()  # the engines' processes size their caches from the free memory
    return out


def _geometry(path: Path) -> dict[str, int]:
    from engine.gguf.check import open_model

    mf = open_model(path)
    expert = sum(t.n_bytes for t in mf.tensors.values() if "_exps." in t.name)
    n_layer = int(mf.arch_key("block_count"))
    moe_layers = sorted({int(t.name.split(".")[1]) for t in mf.tensors.values() if "_exps." in t.name})
    n_expert = int(mf.arch_key("expert_count"))
    n_head = int(mf.arch_key("attention.head_count"))
    n_head_kv = int(mf.arch_key("attention.head_count_kv", n_head))
    head_k = int(mf.arch_key("attention.key_length", int(mf.arch_key("embedding_length")) // n_head))
    return {"n_layer": n_layer, "n_moe_layers": len(moe_layers), "first_moe_layer": moe_layers[0],
            "n_expert": n_expert, "k": int(mf.arch_key("expert_used_count")),
            "expert_bytes": expert // (len(moe_layers) * n_expert),
            "dense_bytes": sum(t.n_bytes for t in mf.tensors.values()) - expert,
            # llama.cpp's default f16 KV cache, per token of context, for its layer split's fit
            "kv_bytes_per_token_f16": 2 * n_layer * n_head_kv * (head_k + int(mf.arch_key("attention.value_length", head_k))),
            "n_ctx_train": int(mf.arch_key("context_length"))}


def run_engine(path: Path, tokens: dict[str, list[int]], *, device: str, budget_mib: int | None,
               cache: str, threads: int, n_ctx: int, load_mode: str = "auto") -> dict:
    """engine/bench/engine_runner.py in a process of its own, as a user runs the engine."""
    args = ["--device", device, "--cache", cache, "-t", str(threads), "--ctx", str(n_ctx), "--load-mode", load_mode]
    if budget_mib is not None:
        args += ["--budget-mib", str(budget_mib)]
    return _run_timer("engine.bench.engine_runner", path, tokens, args, dict(os.environ))


def run_llama(path: Path, tokens: dict[str, list[int]], *, n_cpu_moe: int, threads: int, n_ctx: int) -> dict:
    """engine/bench/llama_runner.py in a subprocess; MOESTUDIO_LLAMA_SITE names a site dir with a
    GPU build of llama-cpp-python to put first on its path."""
    env = dict(os.environ)
    if env.get("MOESTUDIO_LLAMA_SITE"):
        env["PYTHONPATH"] = os.pathsep.join([env["MOESTUDIO_LLAMA_SITE"], env.get("PYTHONPATH", "")])
    return _run_timer("engine.bench.llama_runner", path, tokens,
                      ["--n-cpu-moe", str(n_cpu_moe), "-t", str(threads), "--ctx", str(n_ctx)], env)


def _run_timer(module: str, path: Path, tokens: dict[str, list[int]], args: list[str], env: dict) -> dict:
    """`python -m module MODEL TOKENS.json ARGS`, which prints its result as one JSON line last;
    TOKENS.json holds `tokens` ({"warmup", "prompt", "stream", optionally "long"}: token ids)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(tokens, f)
    try:
        r = subprocess.run([sys.executable, "-m", module, str(path), f.name, *args],
                           capture_output=True, text=True, env=env, timeout=600)
    finally:
        os.unlink(f.name)
    if r.returncode != 0:
        raise RuntimeError(f"{module} {' '.join(args)} failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def fitting_split(geo: dict[str, int], budget_mib: float, kv_mib: float, workspace_mib: float = 1024) -> int:
    """Fewest leading MoE layers whose experts must stay in RAM for llama.cpp to fit the budget."""
    per_layer = geo["expert_bytes"] * geo["n_expert"]
    room = budget_mib * MiB - geo["dense_bytes"] - (kv_mib + workspace_mib) * MiB
    on_gpu = max(0, int(room // per_layer))
    return max(0, geo["n_moe_layers"] - on_gpu) + (geo["first_moe_layer"] if on_gpu < geo["n_moe_layers"] else 0)


RUNS = ("hybrid", "hybrid-mmap", "resident", "llama-split", "llama-gpu")


def bench_tokens(path: Path, n_prompt: int, n_decode: int, n_long: int = 0) -> dict[str, list[int]]:
    """The bench's token streams, from stdlib docstrings: the prompt, the decode stream after it,
    then other text for the warm-up (WARMUP_TOKENS: it must not teach the expert cache the
    prompt) and, with `n_long`, the long prompt after the warm-up's text."""
    from engine.runtime.tokenizer import tokenize_text
    from engine.synth.corpus import stdlib_text

    text = tokenize_text(path, stdlib_text(max_chars=(n_prompt + n_decode + WARMUP_TOKENS + n_long) * 8))
    rest = text[n_prompt + n_decode:]
    long = rest[WARMUP_TOKENS:WARMUP_TOKENS + n_long]
    if len(long) < n_long:
        raise ValueError(f"the text holds {len(text)} tokens, too few for a {n_long}-token prompt beside the others")
    tokens = {"warmup": rest[:WARMUP_TOKENS], "prompt": text[:n_prompt], "stream": text[n_prompt:n_prompt + n_decode]}
    if long:
        tokens["long"] = long
    return tokens


def bench(path: Path, budget_mib: int, *, device: str, threads: int, n_prompt: int, n_decode: int, ctx: int,
          n_long: int = 0, runs: tuple[str, ...] = RUNS, result: dict | None = None,
          on_run: Callable[[dict], None] | None = None) -> dict:
    """Adds `runs` to `result` (a new one by default). A run that fails is recorded with its
    error and the others go on: one broken configuration must not cost the whole sweep.
    `n_long`: also time the prefill of a prompt of that many tokens (other text; the context
    grows to hold it). `on_run(result)` after each run: a sweep cut short by a time limit keeps
    the runs that finished."""
    import torch

    tokens = bench_tokens(path, n_prompt, n_decode, n_long)
    prompt, stream, long = tokens["prompt"], tokens["stream"], tokens.get("long", [])
    geo = _geometry(path)
    # Both engines hold the context a user runs (the product's default unless told): its length is
    # what each decode token's attention and the KV cache's VRAM cost.
    n_ctx = max(resolve_ctx(ctx, geo["n_ctx_train"]), len(prompt) + len(stream) + 16, len(long) + 16)
    tokens["warmup"] = tokens["warmup"][:n_ctx - 1]
    dev = torch.device(device)
    if result is None:
        result = {"model": path.name, "budget_mib": budget_mib, "geometry": geo,
                  "bandwidth": measure_bandwidths(dev, threads),
                  "tokens": {"prompt": len(prompt), "decode": len(stream), "long": len(long), "ctx": n_ctx},
                  "runs": {}}
    split = fitting_split(geo, budget_mib, kv_mib=n_ctx * geo["kv_bytes_per_token_f16"] / MiB)
    todo = {
        "hybrid": lambda: run_engine(path, tokens, device=device, budget_mib=budget_mib, cache="auto",
                                     threads=threads, n_ctx=n_ctx),
        "hybrid-mmap": lambda: run_engine(path, tokens, device=device, budget_mib=budget_mib,
                                          cache="auto", threads=threads, n_ctx=n_ctx, load_mode="mmap"),
        "resident": lambda: run_engine(path, tokens, device=device, budget_mib=None, cache="all",
                                       threads=threads, n_ctx=n_ctx),
        "llama-split": lambda: run_llama(path, tokens, n_cpu_moe=split, threads=threads, n_ctx=n_ctx),
        "llama-gpu": lambda: run_llama(path, tokens, n_cpu_moe=0, threads=threads, n_ctx=n_ctx),
    }
    for name in runs:
        if name.startswith("llama") and dev.type != "cuda":
            continue
        try:
            result["runs"][name] = todo[name]()
        except Exception as e:  # noqa: BLE001 - recorded in the result, the sweep goes on
            result["runs"][name] = {"error": f"{type(e).__name__}: {str(e)[-1500:]}"}
        _bounds(result)
        if on_run is not None:
            on_run(result)
    return result


def _bounds(result: dict) -> None:
    """Adds bytes per token and the share of the bandwidth bound reached to each run."""
    geo, bw = result["geometry"], result["bandwidth"]
    ram, hbm = bw["ram_read_gbs"] * 1e9, bw.get("hbm_gbs", bw["ram_read_gbs"]) * 1e9
    per_token_experts = geo["n_moe_layers"] * geo["k"] * geo["expert_bytes"]
    for name, run in result["runs"].items():
        if "error" in run:
            continue
        if "cpu" in run:
            host = per_token_experts * (run["cpu"] + run["uploaded"])
        elif "n_cpu_moe" in run:
            host = per_token_experts * run["n_cpu_moe"] / geo["n_moe_layers"]
        else:
            continue
        device_bytes = geo["dense_bytes"] + per_token_experts - host
        bound_s = host / ram + device_bytes / hbm
        run["host_bytes_per_token"] = host
        run["bound_tokens_per_s"] = 1 / bound_s
        run["share_of_bound"] = run["decode_tokens_per_s"] * bound_s


def add_long_argument(p: argparse.ArgumentParser, default: int) -> None:
    p.add_argument("--long-prompt-tokens", type=int, default=default,
                   help=f"also time the prefill of a prompt this long, other text (0: none; default {default})")


def add_ctx_argument(p: argparse.ArgumentParser) -> None:
    """The engines' context in a benchmark: the setting's own default and meaning (config.py)."""
    p.add_argument("-c", "--ctx", type=int, default=Config.ctx, help=FIELDS["ctx"].help)


def _runs(value: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    unknown = [n for n in names if n not in RUNS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown run(s) {unknown or value!r}; choose from {', '.join(RUNS)}")
    return names


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("speed", help="decode/prefill speed against llama.cpp at a VRAM budget")
    p.add_argument("model", type=Path)
    p.add_argument("--vram-budget-mib", type=int, required=True, help="the VRAM budget to emulate (MiB)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: cuda when there is one)")
    p.add_argument("-t", "--threads", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=64)
    add_long_argument(p, 0)
    add_ctx_argument(p)
    p.add_argument("--runs", type=_runs, default=RUNS,
                   help=f"comma-separated configurations to run (default: all of {','.join(RUNS)})")
    p.add_argument("--out", type=Path, help="write the JSON result here too (after each run)")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    def save(result: dict) -> None:
        args.out.write_text(json.dumps(result, indent=2, default=float))

    r = bench(args.model, args.vram_budget_mib, device=resolve_device(args.device), threads=args.threads,
              n_prompt=args.prompt_tokens, n_decode=args.decode_tokens, ctx=args.ctx, n_long=args.long_prompt_tokens,
              runs=args.runs, on_run=save if args.out else None)
    print(json.dumps(r, indent=2, default=float))
    return 0
