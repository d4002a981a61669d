"""llama.cpp's `test-backend-ops perf` beside `bench kernels`: the parser against the real
binary's output, the side-by-side rows and table, the errors.

data/test-backend-ops-perf-cpu.txt is the real output of test-backend-ops (llama-cpp-python
0.3.36's vendored llama.cpp, built CPU-only here the way scripts/kernels_run.sh's `llamaops`
stage builds it for CUDA) for the perf cases `llama_params_regex` selects for a set of our rows
(`-b CPU`, MUL_MAT then MUL_MAT_ID). Building it takes minutes and needs the 76 MB sdist, so the
output is kept as data; with MOESTUDIO_LLAMA_OPS naming a built binary the last tests run it.
"""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as QT

from engine.bench import kernels as kb
from engine.bench import llama_ops
from engine.errors import UserError

CPU_OUTPUT = Path(__file__).parent / "data" / "test-backend-ops-perf-cpu.txt"


def _records() -> list[llama_ops.OpPerf]:
    return llama_ops.parse(CPU_OUTPUT.read_text())


def _dense_row(shape: str, qtype: str, rows: int, us: float, gbps: float, mb: float) -> dict:
    """A dense row as bench_dense writes it (fields the comparison reads; figures: the Mixtral
    4096 x 14336 Q4_K / Q8_0 one-row runs of docs/BENCHMARKS.md, measured on the H200)."""
    n_out, k = kb.DENSE_SHAPES[shape]
    rate = {"us": us, "GBps": gbps, "of_copy_bw": round(gbps / 4224.0, 3)}
    return {"kind": "dense", "shape": shape, "n_out": n_out, "K": k, "type": qtype, "rows": rows, "MB": mb,
            "copies": 7, "split": [5, 12], "max_rel_diff_new_old": 1e-6, "new": rate,
            "old": {**rate, "us": us * 2}, "speedup": 2.0}


def _expert_row(shape: str, rows: int) -> dict:
    sc = kb.expert_scenarios()[shape]
    rate = {"us": 24.5, "GBps": 868.0, "of_copy_bw": 0.21}  # the Q4_K step's one-token figures (measured-h200)
    return {"kind": "experts", "shape": shape, "types": [q.name for q in sc.qtypes], "n_embd": sc.n_embd,
            "n_ff": sc.n_ff, "top_k": sc.top_k, "rows": rows, "MB": 21.2, "slots": 40, "new": rate,
            "host_us_eager": 359.0, "launches_us": {"round x": 3.0, "gate/up": 12.0, "down": 9.0}}


def test_parser_reads_every_timed_product_of_the_real_output() -> None:
    text = CPU_OUTPUT.read_text()
    records = llama_ops.parse(text)
    timed = [ln for ln in text.splitlines() if " us/run - " in ln]
    assert len(records) == len(timed) == 13
    assert {r.backend for r in records} == {"CPU"}
    first = records[0]
    assert (first.op, first.type_a, first.qtype, first.m, first.n, first.k) == ("MUL_MAT", "f16", QT.F16, 4096, 1, 14336)
    assert (first.runs, first.us, first.printed, first.n_mats, first.n_used) == (138, 13950.8, "8.42 GFLOPS", None, None)
    assert first.params["bs"] == "[1,1]" and first.params["per"] == "[0,1,2,3]" and first.params["pad"] == "0"
    # the case string is the line's own, so `-o CASE` selects it alone
    assert f"  {first.case}: " in text
    mxfp4 = [r for r in records if r.op == "MUL_MAT_ID" and r.type_a == "mxfp4"]
    assert [(r.m, r.k, r.n, r.n_mats, r.n_used) for r in mxfp4] == [(2880, 2880, 1, 32, 4)]


def test_printed_rate_agrees_with_the_time_per_run() -> None:
    """FLOP/s it printed = 2 m n k (x n_used) / µs per run: the columns were read as the right ones."""
    for r in _records():
        flops = 2 * r.m * r.n * r.k * (r.n_used or 1)
        value, unit = r.printed.split()
        printed = float(value) * {"GFLOPS": 1e9, "TFLOPS": 1e12, "MFLOPS": 1e6}[unit]
        assert printed == pytest.approx(flops / (r.us * 1e-6), rel=0.02), r.case


def test_weight_bytes_count_the_experts_drawn() -> None:
    by = {(r.op, r.type_a, r.m, r.n): r for r in _records()}
    q4k = by[("MUL_MAT", "q4_K", 4096, 1)]
    assert q4k.weight_bytes == 4096 * 14336 // 256 * 144  # 33.0 MB of Q4_K blocks
    assert q4k.gbps == pytest.approx(q4k.weight_bytes / q4k.us / 1e3)
    one, four = by[("MUL_MAT_ID", "q4_K", 768, 1)], by[("MUL_MAT_ID", "q4_K", 768, 4)]
    matrix = 768 * 2048 // 256 * 144
    assert one.weight_bytes == 8 * matrix  # one token reads its 8 experts
    assert four.weight_bytes == pytest.approx(128 * (1 - (120 / 128) ** 4) * matrix)  # ~29.1 of 128
    assert 8 < four.experts_read < 32


def test_params_regex_selects_the_cases_our_rows_stand_beside() -> None:
    rows = [_dense_row("mixtral ffn_down", "Q4_K", 1, 22.8, 1451.0, 33.03), _expert_row("qwen3-30b-a3b Q4_K", 4),
            _expert_row("qwen3-30b-a3b Q4_K_M", 1)]
    regex = re.compile(kb.llama_params_regex(rows))
    selected = [r for r in _records() if regex.search(",".join(f"{k}={v}" for k, v in r.params.items()))]
    assert [(r.op, r.type_a, r.n) for r in selected] == [("MUL_MAT", "q4_K", 1), ("MUL_MAT_ID", "q4_K", 4)]
    # llama.cpp's other MUL_MAT perf cases with broadcast batches and permutations stay out
    assert not regex.search("type_a=q4_K,type_b=f32,m=4096,n=1,k=14336,bs=[8,1],nr=[4,1],per=[0,2,1,3],k_v=0,")
    assert kb.llama_params_regex([rows[2]]) is None  # a mixed-type step alone: nothing to run


def test_side_by_side_rows_json_and_table() -> None:
    rows = [_dense_row("mixtral ffn_down", "Q4_K", 1, 22.8, 1451.0, 33.03),
            _dense_row("mixtral ffn_down", "Q8_0", 1, 32.8, 1903.0, 62.39),
            _dense_row("mixtral ffn_down", "BF16", 1, 78.6, 1495.0, 117.44),  # no bf16 case in the data
            _dense_row("mixtral ffn_up", "Q4_K", 1, 22.8, 1451.0, 33.03),  # not measured yet: ffn_down's figures
            _expert_row("qwen3-30b-a3b Q4_K", 1), _expert_row("qwen3-30b-a3b Q4_K", 2),  # llama.cpp has no n=2
            _expert_row("qwen3-30b-a3b Q4_K_M", 1)]
    # MXFP4 as the engine keeps it on the GPU (planar), and timed as llama.cpp times its cases
    mx = {**_dense_row("mixtral ffn_down", "MXFP4", 1, 57.7, 540.0, 31.19),
          "new_laid_out": {"us": 22.8, "GBps": 1369.0, "of_copy_bw": 0.32},
          "new_one_tensor": {"us": 15.6, "GBps": 2000.0, "of_copy_bw": 0.47}}
    rows.append(mx)
    # an expert step timed as llama.cpp times MUL_MAT_ID too: one routing every call
    rows[4]["new_one_tensor"] = {"us": 22.1, "GBps": 961.0, "of_copy_bw": 0.23}
    records = _records()
    assert kb.attach_llama(rows, records, copy=4224.0) == 5
    q4k, q8, bf16, up, e1, e2, mixed, mx = rows
    assert mx["ours_per_llama_per_byte"] == pytest.approx(1369.0 / mx["llama"]["GBps"], rel=1e-2)
    assert mx["ours_one_tensor_per_llama_per_byte"] == pytest.approx(2000.0 / mx["llama"]["GBps"], rel=1e-2)
    assert "ours_one_tensor_per_llama_per_byte" not in q4k
    assert "llama" not in bf16 and "llama" not in e2 and "llama" not in mixed
    rec = next(r for r in records if (r.op, r.type_a, r.m, r.n) == ("MUL_MAT", "q4_K", 4096, 1))
    assert q4k["llama"]["case"] == rec.case and q4k["llama"]["us"] == 3662.12
    assert q4k["llama"]["GBps"] == pytest.approx(33.03e6 / 3662.12 / 1e3, abs=0.1)
    assert q4k["ours_per_llama_per_byte"] == pytest.approx(1451.0 / q4k["llama"]["GBps"], rel=1e-2)
    assert (up["llama"]["case"].startswith("MUL_MAT(type_a=q4_K,type_b=f32,m=14336,n=1,k=4096,")
            and e1["llama"]["case"].startswith("MUL_MAT_ID(type_a=q4_K,type_b=f32,n_mats=128,n_used=8,b=0,m=768,n=1,"))
    e1_llama = next(r for r in records if (r.op, r.type_a, r.n) == ("MUL_MAT_ID", "q4_K", 1))
    assert e1["ours_per_llama_per_byte"] == pytest.approx(868.0 / e1_llama.gbps, rel=1e-2)
    assert e1["ours_one_tensor_per_llama_per_byte"] == pytest.approx(961.0 / e1_llama.gbps, rel=1e-2)

    result = {"device": "NVIDIA H200", "torch": "2.11", "triton": "3.6", "copy_GBps": 4224.0, "results": rows,
              "llama_ops": "/tmp/llamaops/bin/test-backend-ops perf -b CPU"}
    table = kb.markdown(result)
    side = table[table.index("llama.cpp's own kernels"):]
    lines = [ln for ln in side.splitlines() if ln.startswith("| ") and "---" not in ln]
    assert len(lines) == 1 + 5  # header, then the five rows with a llama.cpp case
    assert (f"| dense mixtral ffn_down (4096 x 14336) | MXFP4 | 1 | 22.8 | 1369 | MUL_MAT mxfp4 4096 x 14336, n=1 | "
            in side and f"| 15.6, {mx['ours_one_tensor_per_llama_per_byte']:.2f}x |" in side)
    assert "one tensor as llama.cpp times it 15.60 us" in kb.llama_line(mx)
    assert (f"| dense mixtral ffn_down (4096 x 14336) | Q4_K | 1 | 22.8 | 1451 | MUL_MAT q4_K 4096 x 14336, n=1 | "
            f"3662.12 | {q4k['llama']['GBps']:.0f} | ") in side
    assert "| expert step qwen3-30b-a3b Q4_K (gate, up, down) | Q4_K | 1 | 24.5 | 868 | " \
           "MUL_MAT_ID q4_K 768 x 2048, 8 of 128, n=1 |" in side
    e1_line = next(ln for ln in lines if ln.startswith("| expert step qwen3-30b-a3b Q4_K "))
    assert e1_line.endswith(f"| 22.1, {e1['ours_one_tensor_per_llama_per_byte']:.2f}x |")
    assert "one tensor as llama.cpp times it 22.10 us" in kb.llama_line(e1)
    assert f"| {q4k['ours_per_llama_per_byte']:.2f}x |" in side
    assert "perf -b CPU" in side
    assert "MUL_MAT q4_K 4096 x 14336, n=1" in kb.llama_line(q4k)
    # without llama.cpp figures the table is as before
    plain = kb.markdown({**result, "results": [{k: v for k, v in r.items() if "llama" not in k} for r in rows]})
    assert "llama.cpp's own kernels" not in plain


def test_missing_binary_is_one_clear_error(tmp_path) -> None:
    with pytest.raises(UserError, match="test-backend-ops not found at .*nope.*llamaops"):
        llama_ops.run_perf(tmp_path / "nope")


def test_bench_kernels_checks_the_binary_before_timing_anything(tmp_path) -> None:
    """The command stops at once (before the GPU's minutes) with one line, on any machine."""
    env = {**os.environ, llama_ops.ENV: str(tmp_path / "missing-test-backend-ops")}
    proc = subprocess.run([sys.executable, "-m", "engine.cli", "bench", "kernels", "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "test-backend-ops not found at" in lines[0] and "missing-test-backend-ops" in lines[0]
    assert not (tmp_path / "o").exists()


def test_output_without_a_timed_product_is_an_error() -> None:
    """A real program whose output holds no perf line (echo prints its arguments back)."""
    with pytest.raises(UserError, match="printed no timed MUL_MAT line for backend CPU"):
        llama_ops.run_perf(Path("/bin/echo"), "CPU", ops=("MUL_MAT",))
    assert llama_ops.parse(CPU_OUTPUT.read_text().split("  MUL_MAT(")[0]) == []  # the header alone


def test_option_wins_over_the_environment(monkeypatch) -> None:
    monkeypatch.setenv(llama_ops.ENV, "/from/env")
    assert llama_ops.resolve("/from/option") == Path("/from/option")
    assert llama_ops.resolve(None) == Path("/from/env")
    monkeypatch.delenv(llama_ops.ENV)
    assert llama_ops.resolve(None) is None


_BINARY = os.environ.get(llama_ops.ENV)
needs_binary = pytest.mark.skipif(not _BINARY, reason=f"{llama_ops.ENV} names no built test-backend-ops "
                                  "(scripts/kernels_run.sh llamaops builds one)")


@needs_binary
def test_real_binary_one_expert_case_on_the_cpu() -> None:
    rows = [_expert_row("qwen3-30b-a3b Q4_K", 1)]
    records, text = llama_ops.run_perf(Path(_BINARY), "CPU", ops=("MUL_MAT_ID",),
                                       params_regex=kb.llama_params_regex(rows))
    assert [(r.op, r.type_a, r.m, r.k, r.n, r.n_used, r.backend) for r in records] == [
        ("MUL_MAT_ID", "q4_K", 768, 2048, 1, 8, "CPU")]
    assert records[0].us > 0 and math.isfinite(records[0].gbps) and "us/run" in text
    assert kb.attach_llama(rows, records, copy=100.0) == 1


@needs_binary
def test_bench_step_runs_the_binary_and_writes_its_output(tmp_path) -> None:
    """What `bench kernels` does after timing ours (kernels.run -> add_llama), on the CPU backend."""
    rows = [_dense_row("mixtral ffn_up", "Q4_K", 1, 22.8, 1451.0, 33.03), _expert_row("qwen3-30b-a3b Q4_K_M", 1)]
    result = {"device": "cpu", "torch": "-", "triton": "-", "copy_GBps": 100.0, "results": rows}
    kb.add_llama(result, Path(_BINARY), "CPU", tmp_path)
    assert "llama_ops_error" not in result and result["llama_ops"].endswith("perf -b CPU")
    assert rows[0]["llama"]["case"].startswith("MUL_MAT(type_a=q4_K,type_b=f32,m=14336,n=1,k=4096,")
    assert "llama" not in rows[1]
    assert rows[0]["llama"]["case"] in (tmp_path / "llama_ops.txt").read_text()
    assert "| dense mixtral ffn_up (14336 x 4096) | Q4_K | 1 |" in kb.markdown(result)
    kb.add_llama(result, Path(_BINARY), "NOPE", tmp_path)  # a failure is kept, ours stay
    assert "no timed MUL_MAT/MUL_MAT_ID line for backend NOPE" in result["llama_ops_error"] and "llama" in rows[0]


@needs_binary
def test_real_binary_with_an_unknown_backend_is_an_error() -> None:
    with pytest.raises(UserError, match="no timed MUL_MAT line for backend NOPE"):
        llama_ops.run_perf(Path(_BINARY), "NOPE", ops=("MUL_MAT",))
