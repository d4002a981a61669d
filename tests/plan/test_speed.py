"""The plan's decode speed against the real engines on this machine: the estimate's range holds
what both engines measure here, and once a server has generated, the plan shows the measured rate."""
from __future__ import annotations

import time

import pytest

from engine.config import Config
from engine.gguf.fingerprint import file_fingerprint
from engine.layers.sampler import SamplingParams
from engine.plan import measured, speed
from engine.plan.geometry import read_geometry
from engine.plan.planner import make_plan
from engine.plan.probe import Hardware, probe_hardware
from engine.runtime.engine import DoneEvent, Request
from engine.server.loader import load_hybrid, load_llamacpp
from engine.synth.demo import DEMO_SPEC
from tests.plan.test_plan import Q3, machine
from tests.server.conftest import start_server

GENERATIONS, TOKENS = 3, 48


def decode_rate(engine) -> float:
    """The best of a few greedy generations: the one least disturbed by other work on the machine."""
    rates = []
    for _ in range(GENERATIONS):
        request = Request(prompt="The plan says how fast this model decodes here. " * 3, max_tokens=TOKENS,
                          ignore_eos=True, sampling=SamplingParams(temperature=0.0))
        rates += [e.decode_tokens_per_s for e in engine.generate(request) if isinstance(e, DoneEvent)]
    return max(rates)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["hybrid", "llamacpp"])
def test_the_estimate_holds_what_each_engine_decodes_here(kind, make_model):
    """The demo model. One thread: on a shared 2-core machine two threads of llama.cpp wait at
    each barrier for a core another process holds (16-64 tok/s where one thread gets 250-360);
    the estimate follows the threads it is given either way."""
    path = make_model(DEMO_SPEC)
    started = time.monotonic()
    cfg = Config(model=str(path), ctx=512, device="cpu", threads=1)
    engine, _effective = (load_hybrid if kind == "hybrid" else load_llamacpp)(cfg, lambda stage, f: None)
    try:
        rate = decode_rate(engine)
    finally:
        close = getattr(getattr(engine, "model", None), "experts", None)
        if close is not None and hasattr(close, "close"):
            close.close()
    hw, g = probe_hardware(nvml=None), read_geometry(path)
    plan = make_plan(hw, g, cfg, engine=kind)
    est = plan.decode["estimate"]
    assert plan.decode["source"] == "estimate" and plan.decode["tokens_per_s"] == est["tokens_per_s"]
    # the stated range: the estimate x2 above, x/2 below, or below the AVX2 VM's estimate where the
    # CPU's AVX-512 figures made it (engine/plan/speed.CPU_RANGE)
    bandwidth = plan.bandwidth_gbs
    floor = speed.estimate_cpu(g, kind, 1, bandwidth["ram"], bandwidth["ram_1_thread"]).tokens_per_s
    assert est["high"] == pytest.approx(est["tokens_per_s"] * speed.CPU_RANGE, rel=0.01)
    assert est["low"] == pytest.approx(min(floor, est["tokens_per_s"]) / speed.CPU_RANGE, rel=0.01)
    assert est["low"] <= rate <= est["high"], (kind, rate, est)
    assert time.monotonic() - started < 240


def test_the_estimate_follows_bytes_threads_and_the_engine():
    hw = Hardware((), 64 << 30, 60 << 30, 8, 16, ram_read_gbs_1=10.0, ram_read_gbs=40.0)
    hybrid = make_plan(hw, Q3, Config(threads=8), engine="hybrid").decode
    llama = make_plan(hw, Q3, Config(threads=8), engine="llamacpp").decode
    one = make_plan(hw, Q3, Config(threads=1), engine="llamacpp").decode
    # llama.cpp reads the quantized dense weights; this engine on the CPU their float32 copies
    assert llama["estimate"]["seconds"]["weights"] == pytest.approx((Q3.dense_bytes + Q3.active_expert_bytes) / 40e9, rel=1e-4)
    assert hybrid["estimate"]["seconds"]["weights"] == pytest.approx((Q3.dense_values * 4 + Q3.active_expert_bytes) / 40e9, rel=1e-4)
    assert one["estimate"]["seconds"]["weights"] == pytest.approx(
        (Q3.dense_bytes + Q3.active_expert_bytes) / (speed.CPU_THREAD_GBS * 1e9), rel=1e-4)
    assert hybrid["tokens_per_s"] < llama["tokens_per_s"] and one["tokens_per_s"] < llama["tokens_per_s"]
    # an AVX-512 CPU: that kind's measured figures, the low end still the AVX2 VM's
    wide = Hardware((), 64 << 30, 60 << 30, 8, 16, ram_read_gbs_1=30.0, ram_read_gbs=40.0, cpu_simd="avx512")
    wide_one = make_plan(wide, Q3, Config(threads=1), engine="hybrid").decode["estimate"]
    avx2_one = make_plan(Hardware((), 64 << 30, 60 << 30, 8, 16, ram_read_gbs_1=30.0, ram_read_gbs=40.0),
                         Q3, Config(threads=1), engine="hybrid").decode["estimate"]
    assert wide_one["seconds"]["weights"] == pytest.approx(
        (Q3.dense_values * 4 + Q3.active_expert_bytes) / (speed.CPU_THREAD_GBS_AVX512 * 1e9), rel=1e-4)
    assert wide_one["seconds"]["fixed"] == pytest.approx(Q3.n_layer * speed.CPU_LAYER_S_AVX512["hybrid"], rel=1e-4)
    assert wide_one["tokens_per_s"] > avx2_one["tokens_per_s"] and wide_one["low"] == avx2_one["low"]
    # on a GPU: more VRAM, more hits, faster, and the range spans uniform routing to skewed
    speeds = [make_plan(machine(m), Q3).decode for m in (8192, 12288, 24576)]
    assert [d["tokens_per_s"] for d in speeds] == sorted(d["tokens_per_s"] for d in speeds)
    for d in speeds:
        assert d["estimate"]["low"] < d["tokens_per_s"] < d["estimate"]["high"]


def test_a_measured_rate_replaces_the_estimate_for_its_conditions(make_model):
    """A real server generates; the plan for the same engine and threads then shows its rate."""
    path = make_model("qwen3moe", seed=11)  # a file no other test serves: its record holds this run alone
    server = start_server(path, "--engine", "llamacpp", "-c", "512", "-t", "1")
    try:
        status, body = server.request("POST", "/v1/completions", {"prompt": "Measured, not promised:",
                                                                    "max_tokens": 40, "temperature": 0})
        assert status == 200 and body["usage"]["completion_tokens"] >= measured.MIN_TOKENS, body
        status, stats = server.request("GET", "/v1/stats")
        rate = stats["last_request"]["decode_tokens_per_s"]
    finally:
        assert server.stop() == 0
    record = measured.load(file_fingerprint(path))
    key = measured.condition("llamacpp", "cpu", 1, 0)
    assert list(record) == [key] and len(record[key]["rates"]) == 1 and record[key]["tokens_per_s"] > 0
    assert record[key]["tokens_per_s"] == pytest.approx(rate, rel=0.01)
    g, hw = read_geometry(path), probe_hardware(nvml=None)
    same = make_plan(hw, g, Config(threads=1), engine="llamacpp", measured=record)
    assert same.decode["source"] == "measured" and same.decode["tokens_per_s"] == record[key]["tokens_per_s"]
    line = next(line for line in same.lines if line.name == "decode speed")
    assert line.value == record[key]["tokens_per_s"] and line.explain.startswith("measured on this machine")
    assert same.decode["estimate"]["tokens_per_s"] > 0  # the estimate stays beside it
    # other threads or the other engine: not what was measured, so the estimate again
    for other in (make_plan(hw, g, Config(threads=2), engine="llamacpp", measured=record),
                  make_plan(hw, g, Config(threads=1), engine="hybrid", measured=record)):
        assert other.decode["source"] == "estimate" and other.decode["measured"] is None
