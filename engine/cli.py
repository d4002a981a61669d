"""`moestudio`: the one console entry point; each subcommand lives beside the code it drives."""
from __future__ import annotations

import argparse
import sys

from engine.errors import UserError


def build_parser() -> argparse.ArgumentParser:
    from app import desktop_entry
    from engine import validate
    from engine.baseline import chat as chat_cli
    from engine.bench import cli as bench_cli
    from engine.moe import profile_cli
    from engine.plan import cli as plan_cli
    from engine.server import cli as serve_cli
    from engine.synth import cli as synth_cli

    parser = argparse.ArgumentParser(
        prog="moestudio",
        description="Run Mixture-of-Experts GGUF models bigger than your GPU. "
        "With no subcommand, opens the desktop app.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    synth_cli.register(sub)
    chat_cli.register(sub)
    validate.register(sub)
    serve_cli.register(sub)
    plan_cli.register(sub)
    profile_cli.register(sub)
    bench_cli.register(sub)
    desktop_entry.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    if not (sys.argv[1:] if argv is None else argv):
        # No subcommand: the desktop app (app/main.py). Dispatched before the parser is built,
        # because building it imports the engine (torch), which the GUI process never loads.
        from app.main import main as app_main
        return app_main()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(args.run(args) or 0)
    except UserError as e:
        print(f"moestudio: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
