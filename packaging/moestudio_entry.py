"""The bundle's entry point: PyInstaller freezes this file as the `moestudio` executable.

Without arguments it opens the desktop app, with a subcommand it is the `moestudio` CLI,
exactly like the console script. It also accepts `-c CODE [ARGS]` and `-m MODULE [ARGS]` the way
python does, because the app starts its engine worker as `sys.executable -c ...`
(app/engine_manager.py) and its planner as `sys.executable -m engine.plan.service`
(app/plan_service.py), and `bench speed` starts `sys.executable -m engine.bench.llama_runner`;
frozen, `sys.executable` is this program and there is no python beside it, so the same commands
must work here.
"""
from __future__ import annotations

import runpy
import sys


def main() -> int:
    argv = sys.argv[1:]
    if len(argv) >= 2 and argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]  # what python sets for `-c`
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        return 0
    if len(argv) >= 2 and argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return 0
    from engine.cli import main as cli_main
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
