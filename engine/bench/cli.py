"""`moestudio bench`: measurements that go into docs/BENCHMARKS.md."""
from __future__ import annotations

import argparse

from engine.bench import hitrate, kernels, scenarios, speed


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks (hit rates; speed against llama.cpp; the scenario sweep; "
                       "the GPU kernels)")
    bsub = p.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    hitrate.register(bsub)
    speed.register(bsub)
    scenarios.register(bsub)
    kernels.register(bsub)
