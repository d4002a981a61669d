"""MOESTUDIO_TEST_PART splits one selection of tests into contiguous parts (the GPU suite runs in
several device calls, each under the device's limit on one command)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SELECTION = ["tests/quant/test_kernel_layout.py", "-k", "not planar"]  # -k first: a part splits what it kept


def collected(part: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MOESTUDIO_TEST_PART"}
    if part is not None:
        env["MOESTUDIO_TEST_PART"] = part
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           *SELECTION], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_the_parts_of_a_selection_are_its_tests_in_order_once_each() -> None:
    def ids(part: str | None) -> list[str]:
        run = collected(part)
        assert run.returncode == 0, run.stdout + run.stderr
        return [line for line in run.stdout.splitlines() if "::" in line]

    whole = ids(None)
    assert len(whole) >= 6
    parts = [ids(f"{i}/3") for i in (1, 2, 3)]
    assert sum(parts, []) == whole
    assert {len(p) for p in parts} <= {len(whole) // 3, len(whole) // 3 + 1}  # split after -k, evenly


def test_a_part_outside_its_count_is_refused_with_the_form_to_give() -> None:
    for spec in ("0/3", "4/3", "two"):
        run = collected(spec)
        assert run.returncode == 4 and "give I/N with 1 <= I <= N" in run.stdout + run.stderr, run.stderr
