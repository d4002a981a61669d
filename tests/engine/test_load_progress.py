"""Load progress in bytes (engine/runtime/progress.py): the engine's load reports the bytes of the
tensors it reads, the experts it copies into RAM and the slots it fills, so the app's progress bar
moves with the work instead of jumping 0 -> 50 -> 90 -> 100."""
from __future__ import annotations

import re

from engine.runtime.progress import ByteProgress

STEP = re.compile(r"^(?P<stage>.+): (?P<done>[\d.]+) (?P<du>MiB|GiB) of (?P<total>[\d.]+) (?P<tu>MiB|GiB)$")


def test_byte_progress_maps_bytes_into_its_share_of_the_load():
    seen: list[tuple[str, float]] = []
    p = ByteProgress(lambda stage, f: seen.append((stage, f)), "copying", 3 << 20, 0.5, 0.7)
    for _ in range(3):
        p.add(1 << 20)
    p.add(1 << 20)  # more than the total (a tensor handed out twice): held at the total
    assert seen[0] == ("copying: 0.0 MiB of 3.0 MiB", 0.5)
    assert seen[1:4] == [("copying: 1.0 MiB of 3.0 MiB", 0.5 + 0.2 / 3), ("copying: 2.0 MiB of 3.0 MiB", 0.5 + 0.4 / 3),
                         ("copying: 3.0 MiB of 3.0 MiB", 0.7)]
    assert seen[-1][1] == 0.7 and p.done == 3 << 20
    many: list[tuple[str, float]] = []
    q = ByteProgress(lambda stage, f: many.append((stage, f)), "reading", 10_000, 0.0, 1.0)
    for _ in range(10_000):
        q.add(1)
    assert ByteProgress.STEPS <= len(many) <= ByteProgress.STEPS + 2  # throttled, and the end is always told
    assert many[-1] == ("reading: 0.0 MiB of 0.0 MiB", 1.0)


def test_engine_load_reports_bytes_read_copied_and_filled(tiny):
    from engine.gguf.reader import ModelFile
    from engine.moe.hybrid import attach_hybrid
    from engine.runtime.engine import Engine, EngineConfig

    seen: list[tuple[str, float]] = []
    engine = Engine.load(tiny, EngineConfig(n_ctx=256, load_mode="none", moe_expert_cache_size="all"),
                         lambda stage, f: seen.append((stage, f)), attach_experts=attach_hybrid)
    fractions = [f for _, f in seen]
    assert fractions == sorted(fractions) and fractions[0] == 0.0 and fractions[-1] == 1.0
    steps = {}
    for stage, f in seen:
        m = STEP.match(stage)
        if m:
            steps.setdefault(m["stage"], []).append((m["done"] + " " + m["du"], m["total"] + " " + m["tu"], f))
    assert list(steps) == ["reading the model's tensors", "copying the experts into RAM",
                           "filling the expert cache on the GPU"]
    for stage, (lo, hi) in zip(steps, ((0.0, 0.5), (0.5, 0.7), (0.7, 0.9))):
        first, last = steps[stage][0], steps[stage][-1]
        assert first[2] == lo and last[2] == hi and last[0] == last[1], (stage, steps[stage])
        assert len(steps[stage]) > 10, stage  # many steps between, not a jump
    total = sum(t.n_bytes for t in ModelFile.open(tiny).tensors.values())
    assert steps["reading the model's tensors"][-1][1] == f"{total / (1 << 20):.1f} MiB"
    assert engine.telemetry.cache.slots_per_layer == 8  # "all": the fill was the whole cache
