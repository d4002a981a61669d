"""`moestudio synth`: make synthetic MoE GGUF models and measure how they route."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from engine.errors import UserError
from engine.synth.routing import ROUTINGS, routing
from engine.synth.spec import ARCHITECTURES, DENSE_QUANTS, EXPERT_QUANTS, PRESETS, ModelSpec, preset
from engine.synth.tokenizer import CHAT_FAMILIES


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("synth", help="make synthetic MoE GGUF models (tests, demo, benchmarks)",
                       description="Synthetic MoE models with random weights, a real tokenizer and realistic routing.")
    ssub = p.add_subparsers(dest="synth_command", metavar="ACTION", required=True)

    c = ssub.add_parser("create", help="write a model")
    c.add_argument("-o", "--output", required=True, type=Path, help="GGUF file to write")
    c.add_argument("--preset", default="tiny", choices=PRESETS, help="size and shapes (default: tiny)")
    c.add_argument("--arch", choices=ARCHITECTURES, help="architecture (required for tiny)")
    c.add_argument("--layers", type=int, help="keep only the first N layers of the preset")
    c.add_argument("--expert-quant", choices=sorted(EXPERT_QUANTS), help="expert tensor type")
    c.add_argument("--dense-quant", choices=sorted(DENSE_QUANTS), help="attention/embedding tensor type")
    c.add_argument("--routing", default="qwen3-30b", choices=sorted(ROUTINGS),
                   help="routing realism setting (default: qwen3-30b)")
    c.add_argument("--chat", choices=CHAT_FAMILIES, metavar="FAMILY",
                   help="chat template and special tokens, a tool-call format the server parses: "
                        f"{', '.join(CHAT_FAMILIES)} (default: {ModelSpec.chat})")
    c.add_argument("--seed", type=int, default=0)
    c.set_defaults(run=_create)

    s = ssub.add_parser("stats", help="run a model over text through llama.cpp and print routing statistics")
    s.add_argument("model", type=Path)
    s.add_argument("--text", type=Path, help="text file (default: docstrings of the Python standard library)")
    s.add_argument("--tokens", type=int, default=1024, help="tokens of text to run (default: 1024)")
    s.add_argument("-t", "--threads", type=int, default=None)
    s.set_defaults(run=_stats)


def _create(args: argparse.Namespace) -> int:
    from engine.synth.writer import write_model

    try:
        spec = preset(args.preset, args.arch)
    except ValueError as e:
        raise UserError(str(e)) from None
    changes = {}
    if args.layers:
        if not 1 <= args.layers <= spec.n_layer:
            raise UserError(f"--layers must be between 1 and {spec.n_layer} for {args.preset}")
        changes["n_layer"] = args.layers
    if args.expert_quant:
        changes["expert_qtype"] = EXPERT_QUANTS[args.expert_quant]
    if args.dense_quant:
        changes["dense_qtype"] = DENSE_QUANTS[args.dense_quant]
    if args.chat:
        changes["chat"] = args.chat
    spec = spec.with_(**changes)

    started = time.monotonic()
    last = [0.0]

    def progress(done: int, total: int, name: str) -> None:
        now = time.monotonic()
        if now - last[0] > 0.5 or done == total:
            last[0] = now
            print(f"\r{done / 2**20:9.1f} / {total / 2**20:.1f} MiB  {name:<40}", end="", file=sys.stderr, flush=True)

    try:
        path = write_model(args.output, spec, routing(args.routing), seed=args.seed, progress=progress)
    except (ValueError, OSError) as e:
        raise UserError(str(e)) from None
    print(file=sys.stderr)
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB) in {time.monotonic() - started:.1f} s")
    return 0


def _stats(args: argparse.Namespace) -> int:
    from engine.baseline.oracle import run_reference
    from engine.runtime.tokenizer import tokenize_text
    from engine.synth.corpus import stdlib_text
    from engine.synth.stats import routing_stats

    if not args.model.exists():
        raise UserError(f"no such model file: {args.model}")
    text = args.text.read_text(encoding="utf-8", errors="replace") if args.text else stdlib_text(max_chars=args.tokens * 8)
    tokens = tokenize_text(args.model, text)[: args.tokens]
    if len(tokens) < 16:
        raise UserError("the text is too short: give at least 16 tokens of text")
    ref = run_reference(args.model, tokens, logits=False, n_threads=args.threads)
    print(json.dumps(routing_stats(ref.experts, ref.n_expert), indent=2))
    return 0
