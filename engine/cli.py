"""`moestudio`: the one console entry point; each subcommand lives beside the code it drives.

Building the parser imports only the commands' light modules (argparse, the config schema):
`--help`, `--version` and usage errors answer in a fraction of a second, and each command
imports torch, llama.cpp or Qt inside its `run` (tests/cli/test_command_line.py holds this).
"""
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
    parser.add_argument("--version", action="version", version=f"moestudio {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    synth_cli.register(sub)
    chat_cli.register(sub)
    validate.register(sub)
    serve_cli.register(sub)
    plan_cli.register(sub)
    profile_cli.register(sub)
    bench_cli.register(sub)
    desktop_entry.register(sub)
    _remember_parsers(parser)
    return parser


def version() -> str:
    from importlib.metadata import PackageNotFoundError, version as dist_version

    try:
        return dist_version("moestudio")
    except PackageNotFoundError:
        return "(not installed as a package: version unknown)"


def _remember_parsers(parser: argparse.ArgumentParser) -> None:
    """Every (sub)command's namespace carries its own parser, so that an unknown flag is reported
    with that command's usage (`serve --bogus-flag`), not the top level's. The innermost
    subcommand's default wins: argparse copies a subparser's namespace over its parent's."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                child.set_defaults(command_parser=child)
                _remember_parsers(child)


def main(argv: list[str] | None = None) -> int:
    if not (sys.argv[1:] if argv is None else argv):
        # No subcommand: the desktop app (app/main.py), which never loads the engine (torch).
        from app.main import main as app_main
        return app_main()
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        getattr(args, "command_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(args.run(args) or 0)
    except UserError as e:
        print(f"moestudio: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a file or device the command needed: the system's words, one line
        where = f": {e.filename}" if e.filename else ""
        print(f"moestudio: error: {e.strerror or e}{where}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
