"""Times llama.cpp on a token stream, in a process of its own, without torch.

`python -m engine.bench.llama_runner MODEL TOKENS.json --n-cpu-moe N -t THREADS` prints one
JSON line: after engine_runner's warm-up, prefill tok/s on the prompt (the fastest of
engine_runner.PREFILL_REPEATS runs), then teacher-forced decode tok/s on the stream, with the
spread of the tokens' times; then, when given, prefill tok/s on the "long" prompt.
A separate process because a CUDA build of llama.cpp and torch's CUDA libraries crash when
loaded together (engine/baseline/placement.py).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _timed_prefill(llm, prompt: list[int]) -> list[float]:
    """Seconds of each of PREFILL_REPEATS evaluations of `prompt` from an empty cache (llama.cpp's
    placement of the weights never changes between them)."""
    from engine.bench.engine_runner import PREFILL_REPEATS

    runs = []
    for _ in range(PREFILL_REPEATS):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        runs.append(time.perf_counter() - t0)
    return runs


def time_llama(model: Path, tokens: dict[str, list[int]], n_cpu_moe: int, threads: int, n_ctx: int) -> dict:
    from engine.baseline.placement import cpu_moe_overrides, open_llama_with
    from engine.bench.engine_runner import prefill_figures, token_times

    llm = open_llama_with(model, overrides=cpu_moe_overrides(n_cpu_moe), n_gpu_layers=-1, flash_attn=True,
                          n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
                          n_threads_batch=threads)
    warmup, prompt, stream = tokens["warmup"], tokens["prompt"], tokens["stream"]
    llm.eval(warmup)  # the same warm-up as this engine's: a prompt, then one decode token
    llm.eval(warmup[-1:])
    prefill_runs = _timed_prefill(llm, prompt)
    times = []
    for tok in stream:
        t0 = time.perf_counter()
        llm.eval([tok])
        times.append(time.perf_counter() - t0)
    out = {"n_cpu_moe": n_cpu_moe, **prefill_figures(prefill_runs, len(prompt)),
           "decode_tokens_per_s": len(stream) / sum(times), **token_times(times)}
    if tokens.get("long"):
        out.update(prefill_figures(_timed_prefill(llm, tokens["long"]), len(tokens["long"]), "long_"))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="llama_runner")
    p.add_argument("model", type=Path)
    p.add_argument("tokens", type=Path, help='JSON {"warmup": [...], "prompt": [...], "stream": [...], '
                   '"long": [...] (optional)}')
    p.add_argument("--n-cpu-moe", type=int, default=0)
    p.add_argument("-t", "--threads", type=int, default=8)
    p.add_argument("--ctx", type=int, required=True, help="context length (the engine's, for a fair comparison)")
    args = p.parse_args(argv)
    toks = json.loads(args.tokens.read_text())
    print(json.dumps(time_llama(args.model, toks, args.n_cpu_moe, args.threads, args.ctx)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
