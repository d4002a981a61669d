"""The `moestudio` command line as a user meets it: a fast start (no torch for help, version and
usage errors) and every command's errors in one line with the command's own usage."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The target is 0.5 s; CI machines are slower and shared, so the test bounds it loosely.
FAST_S = 2.0


def _moestudio(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "QT_QPA_PLATFORM": "offscreen"})


def _one_line_error(res: subprocess.CompletedProcess) -> str:
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    return lines[0]


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["serve", "--help"], ["plan", "--help"],
                                  ["bench", "speed", "--help"], ["serve", "--bogus-flag"]])
def test_help_version_and_usage_errors_do_not_import_torch(argv):
    code = ("import json, sys, time\nt = time.perf_counter()\nfrom engine.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print(json.dumps({'torch': 'torch' in sys.modules, 'qt': 'PySide6.QtCore' in sys.modules, "
            "'s': time.perf_counter() - t}), file=sys.stderr)")
    res = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True, text=True, timeout=60)
    loaded = json.loads(res.stderr.strip().splitlines()[-1])
    assert loaded["torch"] is False and loaded["qt"] is False, (argv, loaded)
    assert loaded["s"] < FAST_S, (argv, loaded)


def test_version_names_the_package():
    res = _moestudio("--version")
    assert res.returncode == 0 and res.stdout.startswith("moestudio "), res


def test_unknown_flag_shows_the_commands_own_usage():
    res = _moestudio("serve", "--bogus-flag")
    assert res.returncode == 2
    assert res.stderr.startswith("usage: moestudio serve "), res.stderr
    assert "unrecognized arguments: --bogus-flag" in res.stderr
    res = _moestudio("bench", "hitrate", "x.gguf", "--nope")
    assert res.stderr.startswith("usage: moestudio bench hitrate "), res.stderr
    res = _moestudio("bench", "speed", "x.gguf", "--vram-budget-mib", "1", "--runs", "hybrid,llama-cpu")
    assert res.returncode == 2 and "unknown run(s) ['llama-cpu']; choose from hybrid, " in res.stderr, res.stderr


@pytest.mark.parametrize("argv", [["bench", "hitrate"], ["bench", "speed", "--vram-budget-mib", "1024"],
                                  ["plan"], ["validate"], ["serve"], ["chat"], ["profile", "show"]])
def test_a_missing_model_file_is_one_line(argv, tmp_path):
    missing = tmp_path / "nonexistent.gguf"
    if argv == ["profile", "show"]:
        argv = [*argv, str(tmp_path / "nonexistent.strp")]
    else:
        argv = [*argv, str(missing)]
    line = _one_line_error(_moestudio(*argv))
    assert line.startswith("moestudio: error: ") and "nonexistent." in line, line


def test_not_a_gguf_file_names_the_path_once(tmp_path):
    bogus = tmp_path / "notes.gguf"
    bogus.write_text("these are not the weights you are looking for\n" * 4)
    for argv in (["plan", str(bogus)], ["bench", "hitrate", str(bogus)]):
        line = _one_line_error(_moestudio(*argv))
        assert line.count(str(bogus)) == 1 and "not a GGUF file" in line, line
