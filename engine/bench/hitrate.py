"""Hit rates of every residency policy on a model's real routing, at a given cache share.

llama.cpp runs the model over real text once (teacher-forced: the prompt as one prefill,
then one decode step per token) and records which experts each layer picked; the hybrid
executor then replays that trace under each policy with its real slot, copy and policy code,
computing no experts. `moestudio bench hitrate MODEL --cache-share 0.25` prints the table.

It also times the host's bookkeeping per decode layer step (split, counters, policy, copy
bookkeeping; the copies themselves, RAM to RAM here, are not counted; the median step): the
part of a layer step's host overhead that does not depend on the accelerator.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from engine.moe.policy import POLICIES


def policy_hit_rates(model_path: str | Path, tokens: list[int], prefill: int, slots: int,
                     miss_fraction: float, policies=POLICIES) -> dict[str, dict[str, float]]:
    from engine.baseline.oracle import run_reference
    from engine.models import build_model
    from engine.moe.hybrid import HybridExperts, HybridOptions

    ref = run_reference(model_path, tokens, logits=False)
    model = build_model(model_path)
    out = {}
    for policy in policies:
        hybrid = HybridExperts(model.expert_weights, "cpu", HybridOptions(
            slots, miss_fraction, policy, threads=1, top_k=model.config.n_expert_used))  # staging as the engine sizes it
        try:
            c = hybrid.counters
            for i, layer in enumerate(ref.moe_layers):
                hybrid.replay(layer, ref.experts[:prefill, i])
            # Decode figures only: the prefill fills the cache and is its own regime.
            before = [c.gpu_hit.sum(), c.uploaded.sum(), c.cpu_computed.sum(), c.swaps.sum(), c.bytes_uploaded]
            bookkeeping_s = []
            for t in range(prefill, len(tokens)):
                for i, layer in enumerate(ref.moe_layers):
                    copy_s, start = hybrid.copier.host_copy_s, time.perf_counter()
                    hybrid.replay(layer, ref.experts[t:t + 1, i])
                    bookkeeping_s.append(time.perf_counter() - start - (hybrid.copier.host_copy_s - copy_s))
            hit, up, cpu, swaps, moved = (a - b for a, b in zip(
                [c.gpu_hit.sum(), c.uploaded.sum(), c.cpu_computed.sum(), c.swaps.sum(), c.bytes_uploaded], before))
            total = hit + up + cpu
            steps = max(1, len(tokens) - prefill)
            out[policy] = {"gpu_hit": float(hit / total), "uploaded": float(up / total), "cpu": float(cpu / total),
                           "swaps": int(swaps), "bytes_uploaded_per_token": float(moved / steps),
                           "host_us_per_layer_step": 1e6 * float(np.median(bookkeeping_s))}
        finally:
            hybrid.close()
    return out


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("hitrate", help="expert-cache hit rate of each residency policy on real routing")
    p.add_argument("model", type=Path)
    p.add_argument("--cache-share", type=float, default=0.25, help="share of each layer's experts resident")
    p.add_argument("--miss-fraction", type=float, default=0.17)
    p.add_argument("--tokens", type=int, default=512, help="tokens of stdlib text (the first 64 are the prompt)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from engine.gguf.check import open_model
    from engine.runtime.tokenizer import tokenize_text
    from engine.synth.corpus import stdlib_text

    n_expert = int(open_model(args.model).arch_key("expert_count"))
    slots = max(1, round(n_expert * args.cache_share))
    tokens = tokenize_text(args.model, stdlib_text(max_chars=args.tokens * 8))[: args.tokens]
    rates = policy_hit_rates(args.model, tokens, 64, slots, args.miss_fraction)
    if args.json:
        print(json.dumps({"slots_per_layer": slots, "n_expert": n_expert, "policies": rates}, indent=2))
        return 0
    print(f"{slots} of {n_expert} experts per layer resident, miss fraction {args.miss_fraction}, "
          f"{len(tokens) - 64} decode steps after a {64}-token prefill")
    print(f"{'policy':<16}{'gpu hit':>9}{'uploaded':>10}{'cpu':>8}{'swaps':>8}{'MiB up/token':>14}"
          f"{'host µs/layer step':>20}")
    for name, r in rates.items():
        print(f"{name:<16}{r['gpu_hit']:>9.1%}{r['uploaded']:>10.1%}{r['cpu']:>8.1%}{r['swaps']:>8}"
              f"{r['bytes_uploaded_per_token'] / 2**20:>14.2f}{r['host_us_per_layer_step']:>20.1f}")
    return 0
