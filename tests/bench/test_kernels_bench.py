"""`moestudio bench kernels`: its pieces here (the baseline kernel through Triton's interpreter,
the weights it draws, the table), the whole command on the GPU machine (marked gpu)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

pytest.importorskip("triton")

from engine.bench import kernels as kb  # noqa: E402
from engine.quant import triton_kernels as tk  # noqa: E402
from engine.quant.activation import round_activation  # noqa: E402
from engine.quant.dequant import dequantize  # noqa: E402
from engine.quant.layout import CHANGED_LAYOUTS  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_without_cuda_it_exits_with_one_clear_line(tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-m", "engine.cli", "bench", "kernels", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs a CUDA GPU" in lines[0], proc.stderr
    assert not list(tmp_path.iterdir()), "nothing written"


@pytest.mark.parametrize("qtype", kb.ALL_TYPES, ids=lambda t: t.name)
def test_random_weights_are_valid_rows_of_the_type(qtype: QT) -> None:
    raw = kb.random_weight(np.random.default_rng(0), qtype, 64, 512)
    assert raw.dtype == np.uint8 and raw.shape[0] == 64
    w = dequantize(torch.from_numpy(np.ascontiguousarray(raw)), qtype, (64, 512))
    assert torch.isfinite(w).all()
    assert 0.3 < w.std().item() * 512 ** 0.5 < 3.0, "about std 1/sqrt(K), as a trained weight"


@pytest.mark.skipif(not tk.INTERPRETED, reason="the interpreter runs where there is no GPU")
@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q8_0], ids=lambda t: t.name)
def test_baseline_and_new_dense_kernels_compute_the_same_product(monkeypatch, qtype: QT) -> None:
    """The speedup the benchmark reports is between two kernels of one product."""
    monkeypatch.setitem(tk.DOWN_CONFIG, "tile", tk.TileConfig(128, 4))
    monkeypatch.setitem(tk.DENSE_CONFIG, "tile", tk.TileConfig(128, 4))
    rng = np.random.default_rng(1)
    raw = torch.from_numpy(np.ascontiguousarray(kb.random_weight(rng, qtype, 160, 512))).unsqueeze(0)
    x = torch.from_numpy(rng.standard_normal((3, 512)).astype(np.float32))
    want = round_activation(x, qtype) @ dequantize(raw[0], qtype, (160, 512)).T
    old = kb.legacy_dense(x, raw, qtype, 160)
    new = tk.dense(x, raw, qtype, 160, split=tk.SplitK(2, 1))
    for got in (old, new):
        assert ((got - want).abs().max() / want.abs().max()).item() < 2e-5


def test_a_config_s_label_names_its_split_target_only_off_the_default() -> None:
    from dataclasses import replace

    assert kb.cfg_name(tk.GATE_UP_CONFIG["tile"]) == "bn32w2"
    assert [kb.cfg_name(c) for c in kb._expert_sweep("tile")[-len(kb.EXPERT_SPLIT_TARGETS):]] == [
        f"bn32w2 {n}/SM" for n in kb.EXPERT_SPLIT_TARGETS]
    assert kb.cfg_name(replace(tk.TileConfig(2, 1, passes=2), programs_per_sm=1)) == "bn2w1t2 1/SM"


def test_cold_copies_cover_four_times_the_l2() -> None:
    l2 = 50 << 20
    assert kb.cold_copies(600 << 20, l2) == 1  # an output head is larger than L2 by itself
    n = kb.cold_copies(1 << 20, l2)
    assert n * (1 << 20) >= 4 * l2 > (n - 1) * (1 << 20)


def test_table_has_a_line_per_result() -> None:
    rate = {"us": 10.0, "GBps": 900.0, "of_copy_bw": 0.22}
    dense = {"kind": "dense", "shape": "qwen3-30b-a3b attn_q", "n_out": 4096, "K": 2048, "type": "Q8_0",
             "rows": 1, "MB": 8.91, "split": [4, 2], "new": rate, "old": {**rate, "us": 20.0}, "speedup": 2.0}
    q6 = {**dense, "type": "Q6_K", "new_laid_out": {**rate, "us": 5.0}}
    experts = {"kind": "experts", "shape": "gpt-oss-120b MXFP4", "types": ["MXFP4"] * 3, "n_embd": 2880,
               "n_ff": 2880, "top_k": 4, "rows": 8, "MB": 284.0, "new": rate, "host_us_eager": 500.0,
               "launches_us": {"round x": 2.5, "gate/up": 180.0, "down": 120.0},
               "one_launch": {**rate, "us": 290.5, "down_tile": "tile"}}
    grouped = {"kind": "grouped", "shape": "qwen3-30b-a3b Q4_K_M", "types": ["Q4_K", "Q4_K", "Q6_K"],
               "n_embd": 2048, "n_ff": 768, "top_k": 8, "experts": 128, "tokens": 512, "GFLOP": 38.7,
               "max_rel_diff_grouped_torch": 1e-6, "grouped": {"us": 200.0, "TFLOPs": 193.3},
               "grouped_eager": {"us": 400.0, "TFLOPs": 96.6}, "torch": {"us": 8000.0, "TFLOPs": 4.8},
               "speedup": 20.0}
    prompt = {"kind": "prompt_dense", "shape": "qwen3-30b-a3b attn_output", "qtype": "Q8_0", "n_out": 2048,
              "K": 4096, "tokens": 512, "GFLOP": 8.6, "max_rel_diff_dense_fp32": 2e-7,
              "dense": {"us": 100.0, "TFLOPs": 86.0}, "cublas_bf16": {"us": 20.0, "TFLOPs": 430.0},
              "torch_fp32": {"us": 200.0, "TFLOPs": 43.0},
              "sweep": [{"config": "m32n64w4s3", "us": 100.0, "TFLOPs": 86.0},
                        {"config": "m64n64w4s3", "us": 80.0, "TFLOPs": 107.5}]}
    table = kb.markdown({"device": "H200", "torch": "2", "triton": "3", "copy_GBps": 4111.0,
                         "results": [dense, q6, experts, grouped, prompt]})
    rows = [ln for ln in table.splitlines() if ln.startswith("| ") and "---" not in ln]
    assert len(rows) == 10  # four headers; Q8_0, Q6_K and Q6_K padded; the expert step; the grouped step; prompt
    assert ("| qwen3-30b-a3b attn_output | Q8_0 | 2048 x 4096 | 512 | 8.6 | 100.0 | 86.0 | 430.0 | 43.0 | "
            "m64n64w4s3 107.5 | 2.0e-07 |") in table
    assert "| qwen3-30b-a3b attn_q | 4096 x 2048 | Q8_0 | 1 |" in table and "| 2.0x | 4 x 2 |" in table
    assert "| Q6_K padded to 224 B blocks | 1 | 8.91 | 5.0 |" in table and "| 4.00x |" in table
    assert "| gpt-oss-120b MXFP4 | MXFP4/MXFP4/MXFP4 | 2880 x 2880, 4 | 8 |" in table
    assert "| 500.0 | round x 2.5, gate/up 180.0, down 120.0 us | 290.5 | 900 |" in table
    assert "one launch (down tile) 290.50 us 900 GB/s" in kb.expert_line(experts)
    other = {**experts, "one_launch_other_down": {**rate, "us": 280.25, "down_tile": "row"}}
    assert "one launch (down tile) 290.50 us 900 GB/s (down row) 280.25 us" in kb.expert_line(other)
    assert ("| qwen3-30b-a3b Q4_K_M | Q4_K/Q4_K/Q6_K | 128, 8, 2048 x 768 | 512 | 38.7 | 200.0 | 193.3 | 400.0 | "
            "8000.0 | 4.8 | 20.0x | 1.0e-06 |") in table
    assert "TFLOP/s" in kb.grouped_line(grouped)


@pytest.mark.gpu
def test_gpu_bench_kernels_runs_and_reports(tmp_path) -> None:
    """A small run of the command on the GPU: both kernels timed, rates in range, files written."""
    if tk.INTERPRETED:
        pytest.skip("kernels were imported in interpreter mode")
    args = argparse.Namespace(out=tmp_path, only=list(kb.KINDS), types=["Q4_K", "Q6_K"],
                              shapes=["qwen3-30b-a3b attn_k/v"], rows=[1, 8], steps=4, replays=2, sweep=True,
                              tokens=[512], llama_ops=None, llama_backend="CUDA0")
    assert kb.run(args) == 0
    result = json.loads((tmp_path / "kernels.json").read_text())
    assert "partial" not in result, "the finished run's file replaces the one saved as rows came"
    assert result["copy_GBps"] > 100
    dense = [r for r in result["results"] if r["kind"] == "dense"]
    experts = [r for r in result["results"] if r["kind"] == "experts"]
    assert [(r["type"], r["rows"]) for r in dense] == [("Q4_K", 1), ("Q4_K", 8), ("Q6_K", 1), ("Q6_K", 8)]
    assert {(r["shape"], r["rows"]) for r in experts} == {(f"qwen3-30b-a3b {t}", n) for t in ("Q4_K", "Q6_K", "Q4_K_M")
                                                          for n in (1, 8)}
    for r in experts:  # the one launch gave the three launches' result bit for bit (bench_experts checks)
        qg, qu, qd = (tk.LAID_OUT_TYPES.get(QT[t], int(QT[t])) for t in r["types"])
        n = r["rows"]
        gate_up, down = tk.expert_tile(qg, qu, n), tk.expert_down_tile(qd, n)
        assert ("down row" in r["launches_us"]) == (n == 1)  # every type here is one the row tile reads
        assert 0 < r["one_launch"]["GBps"] and 0 < r["new_one_tensor"]["GBps"]
        # the engine's (the three launches' bits: down in its default tile), then the other
        assert [r["one_launch"]["down_tile"], r["one_launch_other_down"]["down_tile"]] == (
            [down, "tile" if down == "row" else "row"])
        assert r["new_again"]["GBps"] > 0  # the default's second timing, after the sweep
        assert len(r["one_launch_sweep"]) == 2 * len(kb.ONE_LAUNCH_MAXNREG)  # register caps, both down tiles
        assert all(c["GBps"] > 0 for c in r["one_launch_sweep"])
        # the step in every other pair of tiles that read its types, and over 8 tokens both row tiles in runs
        others = [f"gate/up {g}, down {d}" for g in (gate_up, *({"row", "tile"} - {gate_up}))
                  for d in (down, *({"row", "tile"} - {down})) if (g, d) != (gate_up, down)]
        runs = [f"gate/up row{rows}, down row, runs of {g}" for g in (2, 4, 8) for rows in ("", f" bn{kb.RUN_ROWS}")]
        assert list(r["step_tiles"]) == others + (runs if n > 1 else [])
        assert all(v["GBps"] > 0 for v in r["step_tiles"].values())
        # down's other configs in its default tile (the row tile's default is not among the swept ones)
        assert [d["config"].split()[0] for d in r["down_sweep"]] == [down] * (
            len(kb.DOWN_ROW_SWEEP) if down == "row" else len(kb._sweep_tiles()) - 1)
        assert all(d["GBps"] > 0 for d in r["down_sweep"])
    for r in dense:
        assert r["max_rel_diff_new_old"] < 1e-4
        assert 0 < r["new"]["GBps"] and 0 < r["old"]["GBps"] and r["sweep"]
        assert 0 < r["new_one_tensor"]["GBps"]
        assert ("new_laid_out" in r) == (QT[r["type"]] in CHANGED_LAYOUTS)
    assert (tmp_path / "kernels.md").read_text().count("| qwen3-30b-a3b attn_k/v |") == 6
    if os.environ.get("MOESTUDIO_LLAMA_OPS"):  # kernels_run.sh's llamaops stage built it: its figures beside ours
        beside = {(r["shape"], r["rows"]) for r in experts if "llama" in r}
        assert beside == {(f"qwen3-30b-a3b {t}", n) for t in ("Q4_K", "Q6_K") for n in (1, 8)}
        assert (tmp_path / "llama_ops.txt").is_file()
        assert "llama.cpp's own kernels" in (tmp_path / "kernels.md").read_text()
    grouped = [r for r in result["results"] if r["kind"] == "grouped"]
    assert {r["shape"] for r in grouped} == {f"qwen3-30b-a3b {t}" for t in ("Q4_K", "Q6_K", "Q4_K_M")}
    for r in grouped:
        # The whole step against the torch path, each rounding h to Q8_K on its own: a value of h at
        # a rounding boundary (float32 summation order) can land on the next quant, which moves the
        # output by ~1e-3 of its largest value (H200: 0.9e-3 to 1.8e-3 for every type). The kernels'
        # own tests compare them with the same rounded inputs, to 2e-5.
        assert r["tokens"] == 512 and r["max_rel_diff_grouped_torch"] < 5e-3
        assert r["grouped"]["TFLOPs"] > r["torch"]["TFLOPs"] > 0 and r["sweep"]
    prompt = [r for r in result["results"] if r["kind"] == "prompt_dense"]
    assert {(r["shape"], r["qtype"]) for r in prompt} == {(shape, t) for shape in kb.PROMPT_DENSE_SHAPES
                                                         for t in ("Q4_K", "Q6_K")}
    for r in prompt:
        assert r["max_rel_diff_dense_fp32"] < 1e-4 and r["dense"]["TFLOPs"] > 0 and r["sweep"]
