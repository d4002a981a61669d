"""`moestudio`: the one console entry point; each subcommand lives beside the code it drives."""
from __future__ import annotations

import argparse
import sys

from engine.errors import UserError


def build_parser() -> argparse.ArgumentParser:
    from engine import validate
    from engine.baseline import chat as chat_cli
    from engine.bench import cli as bench_cli
    from engine.moe import profile_cli
    from engine.synth import cli as synth_cli

    parser = argparse.ArgumentParser(
        prog="moestudio",
        description="Run Mixture-of-Experts GGUF models bigger than your GPU. "
        "With no subcommand, starts the app on the demo model.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    synth_cli.register(sub)
    chat_cli.register(sub)
    validate.register(sub)
    profile_cli.register(sub)
    bench_cli.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        # The desktop app does not exist yet: the app so far is the terminal chat on the demo model.
        args = parser.parse_args(["chat"])
    try:
        return int(args.run(args) or 0)
    except UserError as e:
        print(f"moestudio: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
