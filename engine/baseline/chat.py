"""`moestudio chat`: chat with a model in the terminal, through the ordinary llama.cpp engine.

For machines without a display, or a quick look at a model; the desktop app (`moestudio`)
and the HTTP server (`moestudio serve`) run MoE Studio's own engine. Lines that start with a
slash are commands handled here and never sent to the model.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Iterable, Iterator, TextIO

from engine.config import add_arguments, from_args

COMMANDS = "/clear forgets the conversation, /exit or /quit (or Ctrl-D) leaves"
Complete = Callable[[list[dict[str, str]]], Iterator[str]]  # history -> reply text pieces


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat in the terminal (llama.cpp engine; default: the demo model)")
    p.add_argument("model", nargs="?", type=Path, help="GGUF model (default: the random-weight demo model)")
    p.add_argument("--max-tokens", type=int, default=128)
    add_arguments(p, ("ctx", "threads"))
    p.set_defaults(run=run)


def chat_loop(lines: Iterable[str], complete: Complete, out: TextIO, err: TextIO) -> None:
    """Reads user lines until /exit, /quit or the end of input; streams each reply to `out`."""
    history: list[dict[str, str]] = []
    for line in lines:
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            command = line.split()[0].lower()
            if command in ("/exit", "/quit"):
                return
            if command == "/clear":
                history.clear()
                print("(conversation cleared)", file=err, flush=True)
            else:
                print(f"unknown command {command}: {COMMANDS}", file=err, flush=True)
            continue
        history.append({"role": "user", "content": line})
        reply = []
        print("assistant> ", end="", file=out, flush=True)
        for piece in complete(history):
            reply.append(piece)
            print(piece, end="", file=out, flush=True)
        print(file=out, flush=True)
        history.append({"role": "assistant", "content": "".join(reply)})


def _typed_lines() -> Iterator[str]:
    while True:
        try:
            yield input("you> ")
        except EOFError:
            print()
            return


def run(args: argparse.Namespace) -> int:
    from engine.baseline.llama_load import open_llama
    from engine.gguf.check import open_model

    settings = from_args(args)
    model = settings.model
    if model is None:
        from engine.synth.demo import demo_model_path

        print("Preparing the demo model (random weights: its replies are gibberish)…", file=sys.stderr)
        model = demo_model_path()
    open_model(model, require_moe=False)  # the bounded checks first: llama.cpp aborts on some corrupt files
    print("MoE Studio terminal chat (llama.cpp engine). The desktop app is `moestudio`; an OpenAI/Anthropic "
          "server is `moestudio serve MODEL`.", file=sys.stderr)
    llm = open_llama(model, n_ctx=settings.ctx, n_threads=settings.threads)
    print(f"Model: {model}\nType a message; {COMMANDS}.", file=sys.stderr)

    def complete(history: list[dict[str, str]]) -> Iterator[str]:
        for chunk in llm.create_chat_completion(history, max_tokens=args.max_tokens, stream=True):
            yield chunk["choices"][0]["delta"].get("content") or ""

    chat_loop(_typed_lines() if sys.stdin.isatty() else sys.stdin, complete, sys.stdout, sys.stderr)
    return 0
