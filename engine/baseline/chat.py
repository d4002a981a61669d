"""`moestudio chat`: a terminal chat through the ordinary llama.cpp engine.

Until the desktop app exists this is what `moestudio` with no arguments starts.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.config import add_arguments, from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat in the terminal (llama.cpp engine; default: the demo model)")
    p.add_argument("model", nargs="?", type=Path, help="GGUF model (default: the random-weight demo model)")
    p.add_argument("--max-tokens", type=int, default=128)
    add_arguments(p, ("ctx", "threads"))
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from engine.baseline.llama_load import open_llama
    from engine.gguf.check import open_model

    settings = from_args(args)
    model = settings.model
    if model is None:
        from engine.synth.demo import demo_model_path

        print("MoE Studio — terminal preview (the desktop app comes later).", file=sys.stderr)
        print("Preparing the demo model (random weights: its replies are gibberish)…", file=sys.stderr)
        model = demo_model_path()
    open_model(model, require_moe=False)  # the bounded checks first: llama.cpp aborts on some corrupt files
    llm = open_llama(model, n_ctx=settings.ctx, n_threads=settings.threads)
    print(f"Model: {model}\nType a message; Ctrl-D quits.", file=sys.stderr)
    history: list[dict[str, str]] = []
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input("you> ") if interactive else sys.stdin.readline()
        except EOFError:
            break
        if not interactive and not line:
            break
        line = line.strip()
        if not line:
            continue
        history.append({"role": "user", "content": line})
        reply = []
        print("assistant> ", end="", flush=True)
        for chunk in llm.create_chat_completion(history, max_tokens=args.max_tokens, stream=True):
            piece = chunk["choices"][0]["delta"].get("content") or ""
            reply.append(piece)
            print(piece, end="", flush=True)
        print()
        history.append({"role": "assistant", "content": "".join(reply)})
    return 0
