"""The slot count `moestudio plan` (and the wizard) shows is the one the engine allocates: both
size through engine/plan/sizing.place. The engine runs on CPU tensors here, with the GPU's free
memory injected where the engine measures it (engine/moe/budget.gpu_free_bytes), as
tests/reliability/test_gpu_memory.py injects allocation failures."""
from __future__ import annotations

import pytest

from engine.config import Config
from engine.moe import budget
from engine.moe.hybrid import attach_hybrid
from engine.plan.geometry import read_geometry
from engine.plan.planner import make_plan
from engine.plan.probe import GpuInfo, Hardware
from engine.plan.sizing import resolve_ctx, workspace_bytes
from engine.runtime.engine import Engine, EngineConfig

MIB = 1 << 20


def _machine(free_bytes: int) -> Hardware:
    gpu = GpuInfo(name="injected", total_bytes=free_bytes, free_bytes=free_bytes)
    return Hardware(gpus=(gpu,), ram_total_bytes=8 << 30, ram_available_bytes=8 << 30, physical_cores=1,
                    logical_cores=1)


@pytest.fixture(scope="module")
def swept(tiny):
    """(free bytes, budget MiB, ctx, fraction) -> (planned slots, allocated slots), over free
    memory that leaves room for no slot, some, and every expert; budgets that cap it; contexts
    of 0 (the training length), a short one and one beyond the training length."""
    g = read_geometry(tiny)
    per_slot = g.expert_slot_bytes * len(g.moe_layers)
    out = {}
    mp = pytest.MonkeyPatch()
    try:
        for ctx in (0, 256, 10 * g.n_ctx_train):
            n_ctx = resolve_ctx(ctx, g.n_ctx_train)
            base = g.dense_bytes + g.kv_bytes(n_ctx) + workspace_bytes(g, n_ctx, Config.prefill_chunk)
            # free * 7/8 (an eighth is headroom) - base leaves room for about k slots
            for k in (-1, 5, 12):
                free = (base + k * per_slot) * 8 // 7
                for budget_mib in (None, (base + 3 * per_slot) * 8 // 7 // MIB + 1):
                    for fraction in (0.0, 0.5):
                        mp.setattr(budget, "gpu_free_bytes", lambda device, free=free: free)
                        settings = Config(ctx=ctx, vram_budget_mib=budget_mib, moe_gpu_miss_fraction=fraction,
                                          threads=1)
                        planned = make_plan(_machine(free), g, settings).expert_cache["slots_per_layer"]
                        engine = Engine.load(tiny, EngineConfig.from_settings(settings, "cpu"),
                                             attach_experts=attach_hybrid)
                        try:
                            allocated = engine.telemetry.cache.slots_per_layer
                        finally:
                            engine.model.experts.close()
                        out[(free, budget_mib, ctx, fraction)] = (planned, allocated)
    finally:
        mp.undo()
    return out


def test_the_plan_slot_count_is_what_the_engine_allocates(swept):
    wrong = {k: v for k, v in swept.items() if v[0] != v[1]}
    assert not wrong, wrong


def test_the_sweep_spans_empty_partial_and_full_caches(swept):
    planned = {p for p, _ in swept.values()}
    assert 0 in planned and 8 in planned and planned - {0, 8}, planned
