"""`moestudio bench`: measurements that go into docs/BENCHMARKS.md."""
from __future__ import annotations

import argparse

from engine.bench import hitrate, speed


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks (hit rates; speed against llama.cpp)")
    bsub = p.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    hitrate.register(bsub)
    speed.register(bsub)
