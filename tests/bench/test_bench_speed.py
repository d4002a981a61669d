"""`moestudio bench speed` end to end on the CPU: each engine configuration in a process of its own."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.bench.engine_runner import PREFILL_REPEATS

ROOT = Path(__file__).resolve().parents[2]


def test_bench_speed_times_each_configuration_in_its_own_process(tiny, tmp_path):
    out = tmp_path / "speed.json"
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "bench", "speed", str(tiny), "--vram-budget-mib", "64",
                             "--device", "cpu", "-t", "2", "--prompt-tokens", "24", "--decode-tokens", "6", "--ctx",
                             "64", "--long-prompt-tokens", "80", "--out", str(out)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen = []  # the runs --out held, as the sweep went (each run takes seconds: a process of its own)
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            runs = list(json.loads(out.read_text())["runs"])
        except (FileNotFoundError, ValueError):  # not yet written, or caught mid-write
            runs = None
        if runs and runs not in seen:
            seen.append(runs)
        time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()  # past the deadline: fail below, leave no process behind
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-2000:]
    assert seen[0] == ["hybrid"], seen  # written after each run: a sweep cut short keeps what finished
    r = json.loads(out.read_text())
    assert r["tokens"] == {"prompt": 24, "decode": 6, "long": 80, "ctx": 96}  # the context grew for the long prompt
    runs = r["runs"]
    assert set(runs) == {"hybrid", "hybrid-mmap", "resident"}  # llama.cpp's runs need a GPU build
    for name, run in runs.items():
        assert "error" not in run, (name, run)
        assert run["prefill_tokens_per_s"] > 0 and run["decode_tokens_per_s"] > 0
        assert abs(run["gpu_hit"] + run["uploaded"] + run["cpu"] - 1.0) < 1e-9
        assert 0 < run["median_ms"] <= run["p90_ms"] and run["first8_ms"] > 0
        assert run["long_prefill_tokens_per_s"] > 0 and run["long_ttft_s"] > 0
        assert run["prefill_pcie_gb_per_s"] >= 0 and run["long_prefill_pcie_gb_per_s"] >= 0
        # one chunk each, every MoE layer reading its routing back: the CPU has no grouped GEMM
        steps = run["prefill_steps"]
        assert steps["streamed"] == steps["resident"] == 0 < steps["read back"], steps
        assert run["long_prefill_steps"] == steps
        assert run["timed_jit_compiles"]["count"] == 0  # on the CPU no kernel is compiled
    assert runs["resident"]["gpu_hit"] == 1.0
    assert runs["hybrid-mmap"]["load_mode"] == "mmap"
    # every expert resident: the prompts' figures are the fastest of repeated runs; one run where the
    # expert cache learns from the prompt (a repeat would meet a cache adapted to that very text)
    for name, run in runs.items():
        n = PREFILL_REPEATS if name == "resident" else 1
        for prefix in ("", "long_"):
            got = run[f"{prefix}prefill_runs_s"]
            assert len(got) == n and run[f"{prefix}ttft_s"] == pytest.approx(min(got), abs=1e-4)


def test_a_configuration_whose_process_fails_raises_with_its_error(tmp_path):
    from engine.bench.speed import run_engine

    missing = tmp_path / "gone.gguf"
    with pytest.raises(RuntimeError, match=r"(?s)engine\.bench\.engine_runner .*failed: .*gone\.gguf"):
        run_engine(missing, {"warmup": [1, 2], "prompt": [1, 2, 3], "stream": [4]}, device="cpu", budget_mib=64,
                   cache="auto", threads=1, n_ctx=64)


def test_llama_runner_times_the_real_llama_cpp_after_the_same_warm_up(tiny):
    """The baseline's runner on llama.cpp's CPU build (the bench's llama runs need a GPU build
    only to be a fair baseline, not to run)."""
    from engine.bench.speed import run_llama

    r = run_llama(tiny, {"warmup": list(range(5, 21)), "prompt": list(range(30, 54)), "stream": [7, 8, 9, 10],
                         "long": list(range(60, 100))}, n_cpu_moe=0, threads=2, n_ctx=64)
    assert r["n_cpu_moe"] == 0 and r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0
    assert 0 < r["median_ms"] <= r["p90_ms"] and r["first8_ms"] > 0
    assert r["long_prefill_tokens_per_s"] > 0
    assert len(r["prefill_runs_s"]) == len(r["long_prefill_runs_s"]) == PREFILL_REPEATS


def test_the_scenario_table_puts_each_prefill_beside_its_baseline():
    """`bench scenarios`' report: the short and long prompts' prefill ratios, hybrid against
    the split at the budget and resident against llama.cpp on the GPU (measured once per
    scenario, at its first budget), and how the hybrid's prompt layer steps were routed."""
    from engine.bench.scenarios import report

    def run(decode, prefill, long=None, **extra):
        r = {"decode_tokens_per_s": decode, "prefill_tokens_per_s": prefill, **extra}
        return r if long is None else {**r, "long_prefill_tokens_per_s": long}

    scenario = {"label": "q", "geometry": "g", "routing": "r", "layers": 0}
    results = {
        "q@8GiB": {"budget_mib": 8192, "scenario": {**scenario, "budget_gib": 8}, "runs": {
            "hybrid": run(90, 400, 300, gpu_hit=0.9, uploaded=0.0, cpu=0.1,
                          prefill_steps={"streamed": 48, "resident": 0, "read back": 0},
                          long_prefill_steps={"streamed": 96, "resident": 0, "read back": 288}),
            "llama-split": run(60, 200, 100, n_cpu_moe=31),
            "resident": run(220, 1800, 1500), "llama-gpu": run(240, 3600, 3000)}},
        "q@16GiB": {"budget_mib": 16384, "scenario": {**scenario, "budget_gib": 16}, "runs": {
            "hybrid": run(160, 800), "llama-split": run(150, 1000)}}}
    rows = report(results).splitlines()
    assert "prefill resident / all-GPU (long prompt)" in rows[0]
    assert "| 2.00x (3.00x) | 0.50x (0.50x) | 48 / 0 (96 / 288) |" in rows[2]
    assert "| 0.80x (-) | 0.50x (0.50x) | - (-) |" in rows[3]  # no long prompt at 16 GiB; resident from 8 GiB
    assert len(rows) == 4  # no run compiled kernels in its timed part


def test_the_scenario_report_names_runs_whose_timed_part_compiled_kernels():
    from engine.bench.scenarios import report

    compiled = {"count": 4, "seconds": 3.21, "kernels": ["_down_kernel", "_gate_up_kernel"]}
    results = {"q@8GiB": {"budget_mib": 8192, "scenario": {"label": "q", "budget_gib": 8}, "runs": {
        "hybrid": {"decode_tokens_per_s": 90.0, "timed_jit_compiles": compiled},
        "resident": {"decode_tokens_per_s": 200.0, "timed_jit_compiles": {**compiled, "count": 0}}}}}
    notes = report(results).splitlines()[4:]
    assert notes == ["- q@8GiB hybrid: 4 kernel compiles inside the timed runs (3.21 s: _down_kernel, "
                     "_gate_up_kernel); its figures hold them"]
