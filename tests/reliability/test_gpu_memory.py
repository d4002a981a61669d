"""Out of GPU memory while the expert cache is allocated: the engine shrinks the cache and
says so, instead of dying. In CI the allocation failure is injected (LayerSlots raising
torch.OutOfMemoryError above a slot count, as torch does on CUDA); on the device a small
--vram-budget-mib is honoured for real."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.moe import slots as slots_module
from engine.moe.hybrid import attach_hybrid
from engine.runtime.engine import Engine, EngineConfig, Request


def shrunk_to(record) -> list[str]:
    """The slot counts the shrink warnings name, in order."""
    return [str(w.message).split("cache to ")[1].split(" ")[0] for w in record if "shrinking" in str(w.message)]


def assert_generates_with(engine: Engine, slots_per_layer: int) -> None:
    try:
        assert engine.telemetry.cache.slots_per_layer == slots_per_layer
        events = list(engine.generate(Request(prompt="def main():", max_tokens=8, ignore_eos=True)))
        assert events[-1].completion_tokens == 8
    finally:
        engine.model.experts.close()


def test_cache_shrinks_when_slot_allocation_runs_out_of_memory(make_model, monkeypatch):
    path = make_model("qwen3moe")
    real_init = slots_module.LayerSlots.__init__
    fits = 3  # slots per layer this "GPU" can hold

    def allocate(self, w, n_slots, staging, device, copier):
        if n_slots > fits:
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected: {n_slots} slots)")
        real_init(self, w, n_slots, staging, device, copier)

    monkeypatch.setattr(slots_module.LayerSlots, "__init__", allocate)
    with pytest.warns(RuntimeWarning, match=r"out of GPU memory with 8 expert slots per layer; shrinking") as record:
        engine = Engine.load(path, EngineConfig(moe_expert_cache_size="all", n_ctx=256),
                             attach_experts=attach_hybrid)
    assert shrunk_to(record) == ["6", "4", "3"]
    assert_generates_with(engine, slots_per_layer=3)


def test_auto_sized_cache_shrinks_when_too_little_memory_is_left_after_allocating(make_model, monkeypatch):
    """Free memory is measured again once the slots are allocated (injected here: auto-sizing
    saw room for every expert, but less is left than half the headroom until 4 slots)."""
    from engine.moe import budget

    path = make_model("qwen3moe")
    real_init = slots_module.LayerSlots.__init__
    allocated = []

    def allocate(self, w, n_slots, staging, device, copier):
        allocated.append(n_slots)
        real_init(self, w, n_slots, staging, device, copier)

    monkeypatch.setattr(slots_module.LayerSlots, "__init__", allocate)
    monkeypatch.setattr(budget, "gpu_free_bytes", lambda device: 16 << 30)  # room for every expert; 1 GiB headroom
    monkeypatch.setattr(budget, "free_after_allocation",
                        lambda device, budget_bytes, pending_bytes: 2**30 if allocated[-1] <= 4 else 100 * 2**20)
    with pytest.warns(RuntimeWarning, match=r"only 100 MiB of GPU memory left with 8 expert slots per layer; "
                                            r"shrinking the expert cache to 6") as record:
        engine = Engine.load(path, EngineConfig(n_ctx=256), attach_experts=attach_hybrid)
    assert shrunk_to(record) == ["6", "4"]
    assert_generates_with(engine, slots_per_layer=4)


def test_a_fixed_cache_size_is_not_second_guessed(make_model, monkeypatch):
    from engine.moe import budget

    monkeypatch.setattr(budget, "free_after_allocation", lambda *_: 0)
    engine = Engine.load(make_model("qwen3moe"), EngineConfig(moe_expert_cache_size=5, n_ctx=256),
                         attach_experts=attach_hybrid)
    try:
        assert engine.telemetry.cache.slots_per_layer == 5
    finally:
        engine.model.experts.close()


def test_no_memory_at_all_is_an_error_not_a_loop(make_model, monkeypatch):
    path = make_model("qwen3moe")

    def allocate(self, *args):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(slots_module.LayerSlots, "__init__", allocate)
    with pytest.warns(RuntimeWarning, match="shrinking"), pytest.raises(torch.OutOfMemoryError):
        Engine.load(path, EngineConfig(moe_expert_cache_size=2, n_ctx=256), attach_experts=attach_hybrid)


@pytest.mark.gpu
def test_small_vram_budget_is_honoured_on_cuda(make_model):
    """The slots of a budgeted engine stay inside --vram-budget-mib (dense weights, KV, staging)."""
    path = make_model("qwen3moe")
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    engine = Engine.load(path, EngineConfig(device="cuda", n_ctx=256, vram_budget_mib=32),
                         attach_experts=attach_hybrid)
    try:
        list(engine.generate(Request(prompt="def main():", max_tokens=8, ignore_eos=True)))
        assert torch.cuda.max_memory_allocated() - base <= 32 * 2**20
    finally:
        engine.model.experts.close()


def test_cublas_takes_no_workspace_unless_the_user_gives_one():
    """cuBLAS's workspace (32 MiB a stream on Hopper) would lie outside the plan, so the engine asks
    for none on import, before torch's first cuBLAS call reads the setting; a user's value is kept."""
    code = "import engine, os; print(os.environ['CUBLAS_WORKSPACE_CONFIG'])"
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}

    def imported(env: dict) -> list[str]:
        return subprocess.run([sys.executable, "-c", code], env=env, cwd=Path(__file__).parents[2],
                              capture_output=True, text=True, check=True).stdout.split()

    assert imported(env) == [":0:0"]
    assert imported({**env, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) == [":4096:8"]
