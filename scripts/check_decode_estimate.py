"""The plan's decode estimate against what the engines measure here (docs/BENCHMARKS.md, "Decode
speed estimates"): for each model, engine and thread count, the best of a few greedy
generations next to the estimate and its range, and the fixed time per layer the measurement
implies (what engine/plan/speed.CPU_LAYER_S assumes).

    python scripts/check_decode_estimate.py MODEL.gguf [MODEL.gguf ...] [--threads 1,2] [--engines hybrid,llamacpp]
"""
from __future__ import annotations

import argparse

from engine.config import Config
from engine.layers.sampler import SamplingParams
from engine.plan.geometry import read_geometry
from engine.plan.planner import make_plan
from engine.plan.probe import probe_hardware
from engine.runtime.engine import DoneEvent, Request
from engine.server.loader import load_hybrid, load_llamacpp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--engines", default="hybrid,llamacpp")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--runs", type=int, default=4)
    args = ap.parse_args()
    hw = probe_hardware(nvml=None)
    print(f"RAM read: {hw.ram_read_gbs_1} GB/s on one thread, {hw.ram_read_gbs} on {hw.physical_cores}")
    print("| model | engine | threads | measured tok/s (runs) | estimate (range) | weights ms | implied fixed ms/layer |")
    print("|---|---|---|---|---|---|---|")
    for path in args.models:
        g = read_geometry(path)
        for kind in args.engines.split(","):
            for threads in (int(t) for t in args.threads.split(",")):
                cfg = Config(model=path, ctx=1024, device="cpu", threads=threads)
                engine, _ = (load_hybrid if kind == "hybrid" else load_llamacpp)(cfg, lambda stage, f: None)
                rates = []
                for _ in range(args.runs):
                    request = Request(prompt="The quick brown fox jumps over the lazy dog. " * 4,
                                      max_tokens=args.tokens, ignore_eos=True, sampling=SamplingParams(temperature=0.0))
                    rates += [e.decode_tokens_per_s for e in engine.generate(request) if isinstance(e, DoneEvent)]
                experts = getattr(getattr(engine, "model", None), "experts", None)
                if hasattr(experts, "close"):
                    experts.close()
                est = make_plan(hw, g, cfg, engine=kind).decode["estimate"]
                weights = est["seconds"]["weights"]
                fixed = (1 / max(rates) - weights) / g.n_layer
                print(f"| {g.name[:32]} | {kind} | {threads} | {max(rates):,.0f} ({', '.join(f'{r:.0f}' for r in rates)}) "
                      f"| {est['tokens_per_s']:,.0f} ({est['low']:,.0f}-{est['high']:,.0f}) | {weights * 1e3:.2f} "
                      f"| {fixed * 1e3:.2f} |", flush=True)


if __name__ == "__main__":
    main()
