"""`moestudio plan`: geometry from real GGUF headers, the probe seam, and the plan arithmetic."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from engine.plan import cli as plan_cli
from engine.plan.geometry import Geometry, read_geometry
from engine.config import Config
from engine.plan import speed
from engine.plan.planner import PlanOptions, make_plan
from engine.plan.sizing import HEADROOM_BYTES
from engine.plan.probe import Hardware, cpu_simd, probe_hardware

GIB, MIB = 1 << 30, 1 << 20


class FakeNVML:
    """The parts of pynvml the probe calls, answering for one 8 GiB RTX 4060-like card."""

    NVML_CLOCK_MEM = 2

    class NVMLError(Exception):
        pass

    def __init__(self, total_mib: int = 8192, free_mib: int = 7700):
        self.total, self.free = total_mib * MIB, free_mib * MIB

    def nvmlInit(self): pass
    def nvmlShutdown(self): pass
    def nvmlDeviceGetCount(self): return 1
    def nvmlDeviceGetHandleByIndex(self, i): return f"gpu{i}"
    def nvmlDeviceGetName(self, h): return b"NVIDIA GeForce RTX 4060 (fake)"
    def nvmlDeviceGetMemoryInfo(self, h): return SimpleNamespace(total=self.total, free=self.free, used=0)
    def nvmlDeviceGetMaxPcieLinkGeneration(self, h): return 4
    def nvmlDeviceGetMaxPcieLinkWidth(self, h): return 8
    def nvmlDeviceGetMemoryBusWidth(self, h): return 128
    def nvmlDeviceGetMaxClockInfo(self, h, clock): return 8501

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        raise self.NVMLError("the probe asks for the maximum link, not the idle one")


# Qwen3-30B-A3B as the synth preset writes it (48 layers, 128 experts, 8 active, Q4_K experts).
Q3 = Geometry(name="qwen3-30b-a3b", arch="qwen3moe", file_bytes=17_330_232_768, n_layer=48, moe_layers=tuple(range(48)),
              n_expert=128, n_expert_used=8, n_embd=2048, n_ff_exp=768, n_head=32, n_vocab=2048, n_ctx_train=40960,
              expert_bytes=2_654_208, expert_slot_bytes=2_654_208, experts_bytes_total=2_654_208 * 128 * 48, dense_bytes=1_018_429_440,
              embedding_bytes=4_456_448, kv_values_per_token=48 * 4 * 256, head_dim_k=128,
              dense_values=1_018_429_440 * 32 // 34)  # Q8_0: 34 bytes per 32 values


def machine(gpu_mib: int | None) -> Hardware:
    hw = probe_hardware(FakeNVML(gpu_mib, gpu_mib) if gpu_mib else None)
    return Hardware(hw.gpus, 64 * GIB, 60 * GIB, 8, 16)


def test_geometry_of_tiny_models(make_model):
    g = read_geometry(make_model("qwen3moe"))
    assert g.moe_layers == (0, 1) and g.n_expert == 8 and g.n_expert_used == 2
    assert g.expert_bytes == 3 * 256 * 256 // 256 * 144  # gate, up, down: Q4_K 144 bytes per 256 values
    assert g.kv_values_per_token == 2 * 2 * (64 + 64) and g.kv_bytes_per_token == {"f16": 1024, "f32": 2048}
    assert g.head_dim_k == 64
    assert g.dense_bytes + g.embedding_bytes + g.experts_bytes_total < g.file_bytes
    mla = read_geometry(make_model("deepseek2"))
    assert mla.moe_layers == (1, 2)  # the leading dense layer has no experts
    assert mla.kv_values_per_token == 3 * (256 + 32)  # compressed latent + rotary key per layer
    assert mla.head_dim_k == 256 + 32  # attention reads the latent and the rotary key


def test_probe_seam_reads_a_fake_8gib_gpu():
    hw = probe_hardware(FakeNVML())
    gpu = hw.gpu
    assert gpu.name == "NVIDIA GeForce RTX 4060 (fake)" and gpu.total_bytes == 8 * GIB
    assert (gpu.pcie_generation, gpu.pcie_width, gpu.memory_bandwidth_gbs) == (4, 8, 272.0)
    assert hw.physical_cores >= 1 and hw.ram_total_bytes >= hw.ram_available_bytes > 0
    assert probe_hardware(None).gpus == ()


def test_the_cpu_vector_extension_is_read_from_cpuinfo(tmp_path):
    def simd(flags: str | None):
        path = tmp_path / "cpuinfo"
        path.write_text("processor\t: 0\nmodel name\t: x\n" + (f"flags\t\t: {flags}\n" if flags is not None else ""))
        return cpu_simd(path)

    assert simd("fpu sse2 avx2 fma avx512f avx512dq avx512bw avx512_vnni") == "avx512"
    assert simd("fpu sse2 avx2 fma avx512f") == "avx2"  # AVX-512 here: F and BW, as every server CPU since Skylake
    assert simd("fpu sse2 avx") is None and simd(None) is None and cpu_simd(tmp_path / "missing") is None


def test_cpu_plan_json_on_this_machine(make_model):
    r = subprocess.run([sys.executable, "-m", "engine.cli", "plan", str(make_model("qwen3moe")), "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["schema"] == 3 and plan["mode"] in ("cpu", "gpu")
    for line in plan["lines"]:
        assert set(line) == {"name", "bytes", "where", "explain", "value"} and line["explain"]
    names = [line["name"] for line in plan["lines"]]
    assert {"dense weights", "KV cache", "compute workspace", "CPU threads", "decode speed"} <= set(names)
    if plan["mode"] == "cpu":  # CI machines have no GPU
        assert plan["settings"]["threads"] == plan["hardware"]["physical_cores"] and plan["decode"]["tokens_per_s"] > 0
        assert plan["hardware"]["ram_read_gbs"] > 0 and plan["bandwidth_gbs"]["sources"]["ram"].startswith("measured")


def test_plan_cli_with_the_fake_gpu(make_model, capsys):
    parser = argparse.ArgumentParser()
    plan_cli.register(parser.add_subparsers())
    args = parser.parse_args(["plan", str(make_model("qwen3moe")), "--json", "-c", "1024"])
    assert plan_cli.run(args, nvml=FakeNVML()) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["mode"] == "gpu" and plan["hardware"]["gpus"][0]["total_bytes"] == 8 * GIB
    assert plan["expert_cache"]["slots_per_layer"] == 8 and plan["fits"]  # a tiny model fits whole
    assert plan["bandwidth_gbs"]["vram"] == round(272 * 0.8, 1)


# staging shared; 32-row grouped tiles; fused prompt attention (no scores: one slot more than before)
@pytest.mark.parametrize("gib, slots", [(8, 41), (12, 75), (24, 128)])
def test_qwen3_30b_at_8_12_24_gib(gib, slots):
    plan = make_plan(machine(gib * 1024), Q3, Config(ctx=4096))
    assert plan.mode == "gpu" and plan.fits and not plan.warnings
    assert plan.expert_cache["slots_per_layer"] == slots
    gpu_bytes = sum(line.bytes for line in plan.lines if line.where == "gpu")
    assert gpu_bytes <= gib * GIB and any(line.name == "headroom" and line.bytes == HEADROOM_BYTES for line in plan.lines)
    assert plan.settings["moe_expert_cache_size"] == slots and plan.settings["threads"] == 8


def test_more_vram_means_faster_and_budget_caps():
    speeds = [make_plan(machine(m), Q3).decode["tokens_per_s"] for m in (8192, 12288, 24576)]
    assert speeds == sorted(speeds) and len(set(speeds)) == 3
    capped = make_plan(machine(24576), Q3, Config(vram_budget_mib=8192))
    assert capped.expert_cache == {**make_plan(machine(8192), Q3).expert_cache, "vram_budget_bytes": 8 * GIB}


def test_overrides_and_warnings():
    too_big = make_plan(machine(8192), Q3, Config(moe_expert_cache_size="all"))
    assert not too_big.fits and "larger than the VRAM left" in too_big.warnings[0]
    no_room = make_plan(machine(1024), Q3)
    assert not no_room.fits and no_room.expert_cache["slots_per_layer"] == 0 and "lower -c" in no_room.warnings[0]
    given = make_plan(machine(8192), Q3, Config(moe_gpu_miss_fraction=0), PlanOptions(ram_gbs=80))
    assert given.bandwidth_gbs["sources"]["ram"] == "given" and given.decode["bytes_per_token"]["pcie"] == 0
    cpu = make_plan(machine(None), Q3)
    assert cpu.mode == "cpu" and cpu.bandwidth_gbs["sources"]["ram"].startswith("assumed")  # not measured
    t = (Q3.dense_values * 4 + Q3.active_expert_bytes) / 40e9 + Q3.n_layer * speed.CPU_LAYER_S["hybrid"]
    assert cpu.decode["tokens_per_s"] == round(1 / t, 1) and cpu.decode["source"] == "estimate"


def test_the_gui_can_reprice_from_the_json_without_torch():
    plan = make_plan(machine(8192), Q3)
    doc = plan.to_json(machine(8192), Q3, PlanOptions())
    again = make_plan(Hardware.from_json(doc["hardware"]), Geometry.from_json(doc["model"]), Config(ctx=8192))
    assert again.expert_cache["slots_per_layer"] < plan.expert_cache["slots_per_layer"]  # a longer context costs slots
    code = "import sys, engine.plan.planner, engine.config; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_miss_fraction_auto_is_estimated_and_a_given_one_kept():
    auto = make_plan(machine(8192), Q3)
    line = next(line for line in auto.lines if line.name == "miss fraction")
    pcie, ram = auto.bandwidth_gbs["pcie"], auto.bandwidth_gbs["ram"]
    assert abs(line.value - pcie / (pcie + ram)) <= 1 / 256 and "auto" in line.explain
    assert auto.settings["moe_gpu_miss_fraction"] == "auto"
    given = make_plan(machine(8192), Q3, Config(moe_gpu_miss_fraction=0.17))
    assert next(line.value for line in given.lines if line.name == "miss fraction") == 0.17
    assert given.settings["moe_gpu_miss_fraction"] == 0.17


def test_ctx_0_plans_the_training_length():
    plan = make_plan(machine(24576), Q3, Config(ctx=0))
    kv = next(line for line in plan.lines if line.name == "KV cache")
    assert plan.settings["ctx"] == Q3.n_ctx_train and kv.bytes == Q3.kv_bytes(Q3.n_ctx_train)


def test_plan_takes_serves_flags_and_presets(make_model, capsys, tmp_path):
    preset = tmp_path / "p.toml"
    preset.write_text('moe_expert_cache_size = 3\nmoe_gpu_miss_fraction = "auto"\n')
    parser = argparse.ArgumentParser()
    plan_cli.register(parser.add_subparsers())
    args = parser.parse_args(["plan", str(make_model("qwen3moe")), "--json", "--config", str(preset),
                              "--moe-gpu-miss-fraction", "auto", "-c", "0"])
    assert plan_cli.run(args, nvml=FakeNVML()) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["expert_cache"]["slots_per_layer"] == 3 and plan["settings"]["moe_gpu_miss_fraction"] == "auto"
    assert plan["settings"]["ctx"] == plan["model"]["n_ctx_train"]
