"""The memory plan: where each part of a model goes and how fast decoding can then be.

`make_plan(hardware, geometry, settings)` is pure arithmetic (no I/O, no torch), so the GUI
can re-price it live as the user moves a slider. Its JSON is what `moestudio plan --json`
prints and what the wizard shows. The settings are the engine's own (engine/config.Config).

Where the VRAM goes is engine/plan/sizing.place, the rule the engine sizes its expert cache
by, so the slots planned are the slots the engine makes. The decode ceiling
is the memory-bandwidth bound: per token the GPU reads the dense weights and the selected
experts that are resident; the misses are either uploaded over PCIe (the miss fraction) or
computed by the CPU from RAM, in parallel with the GPU's expert work.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from engine.config import Config
from engine.plan.geometry import KV_BYTES, Geometry
from engine.plan.probe import GpuInfo, Hardware
from engine.plan.sizing import MIB, balanced_fraction, place, resolve_ctx, workspace_bytes

SCHEMA = 2  # 2: "options" hold the planner's assumptions only; staging and headroom sized as the engine does
# Assumed bandwidths (GB/s), used when nothing better is known; each can be overridden.
DEFAULT_RAM_GBS = 40.0  # dual-channel DDR4-3200 peaks at 51 GB/s; a CPU pool reaches ~80% of it
PCIE_LANE_GBS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
DEFAULT_PCIE = (4, 16)  # generation, width when NVML cannot tell
ACHIEVED = 0.8  # share of a theoretical peak (VRAM, PCIe) that streaming kernels and copies reach
# Typical memory bandwidth by VRAM size when NVML cannot tell: (up to GiB, GB/s, example cards).
VRAM_CLASSES = ((8, 272, "RTX 4060"), (12, 360, "RTX 3060 12 GB"), (16, 448, "RTX 4060 Ti 16 GB / 5060 Ti"),
                (24, 936, "RTX 3090 / 4090"), (48, 864, "RTX A6000 / L40"), (1 << 20, 2000, "datacenter HBM"))


@dataclass(frozen=True)
class PlanOptions:
    """What the planner assumes beyond the user's settings (engine/config.Config)."""
    kv_type: str = "f32"  # the engine's KV cache is float32 (the exactness contract); llama.cpp's is f16
    vram_gbs: float | None = None
    ram_gbs: float | None = None
    pcie_gbs: float | None = None

    def __post_init__(self) -> None:
        if self.kv_type not in KV_BYTES:
            raise ValueError(f"kv_type must be one of {', '.join(KV_BYTES)}")


@dataclass
class PlanLine:
    name: str
    bytes: int | None  # None for lines that are not memory (threads, miss fraction, speed)
    where: str  # "gpu", "ram" or "-"
    explain: str
    value: float | int | None = None  # the line's figure when it is not bytes


@dataclass
class Plan:
    mode: str  # "gpu" or "cpu"
    lines: list[PlanLine]
    settings: dict[str, Any]  # what to pass to `moestudio serve` (config keys)
    expert_cache: dict[str, Any]
    decode: dict[str, Any]
    bandwidth_gbs: dict[str, Any]
    fits: bool
    warnings: list[str] = field(default_factory=list)

    def to_json(self, hardware: Hardware, geometry: Geometry, options: PlanOptions) -> dict[str, Any]:
        return {"schema": SCHEMA, "model": geometry.to_json(), "hardware": hardware.to_json(),
                "options": asdict(options), **asdict(self)}


def _vram_gbs(gpu: GpuInfo, override: float | None) -> tuple[float, str]:
    if override:
        return override, "given"
    if gpu.memory_bandwidth_gbs:
        return round(gpu.memory_bandwidth_gbs * ACHIEVED, 1), f"NVML peak {gpu.memory_bandwidth_gbs} GB/s x {ACHIEVED}"
    gib = gpu.total_bytes / (1 << 30)
    upto, gbs, cards = next(c for c in VRAM_CLASSES if gib <= c[0] + 0.5)
    return round(gbs * ACHIEVED, 1), f"assumed for a {upto} GiB-class GPU ({cards}: {gbs} GB/s) x {ACHIEVED}"


def _pcie_gbs(gpu: GpuInfo, override: float | None) -> tuple[float, str]:
    if override:
        return override, "given"
    known = gpu.pcie_generation in PCIE_LANE_GBS and gpu.pcie_width
    gen, width = (gpu.pcie_generation, gpu.pcie_width) if known else DEFAULT_PCIE
    what = "NVML" if known else "assumed"
    return round(PCIE_LANE_GBS[gen] * width * ACHIEVED, 1), f"{what} PCIe gen {gen} x{width} x {ACHIEVED}"


def _mib(n: int) -> str:
    return f"{n / MIB:,.0f} MiB" if n >= 100 * MIB else f"{n / MIB:,.1f} MiB"


def _cpu_plan(hw: Hardware, g: Geometry, s: Config, o: PlanOptions, threads: int, ram_gbs: float,
              ram_src: str) -> Plan:
    ctx = resolve_ctx(s.ctx, g.n_ctx_train)
    kv, work = g.kv_bytes(ctx, o.kv_type), workspace_bytes(g, ctx, s.prefill_chunk)
    per_token = g.dense_bytes + g.active_expert_bytes
    tps = ram_gbs * 1e9 / per_token
    need = g.file_bytes + kv + work
    lines = [
        PlanLine("dense weights", g.dense_bytes, "ram", "attention, router, shared experts, norms and output head"),
        PlanLine("experts", g.experts_bytes_total, "ram", f"{len(g.moe_layers)} layers x {g.n_expert} experts, "
                 "memory-mapped from the GGUF file"),
        PlanLine("KV cache", kv, "ram", f"{ctx} tokens x {g.kv_bytes_per_token[o.kv_type]:,} bytes ({o.kv_type})"),
        PlanLine("compute workspace", work, "ram", f"estimate for a {s.prefill_chunk}-token prefill chunk"),
        PlanLine("CPU threads", None, "-", "one per physical core: the CPU pool is bound by memory bandwidth, "
                 "and hyper-threads only contend for it", threads),
        PlanLine("decode ceiling", None, "-", f"{ram_gbs} GB/s RAM / {_mib(per_token)} read per token "
                 "(dense weights + the selected experts)", round(tps, 1)),
    ]
    warnings = ["no NVIDIA GPU found: the engine runs on the CPU"]
    if need > hw.ram_available_bytes:
        warnings.append(f"the model needs {_mib(need)} but {_mib(hw.ram_available_bytes)} of RAM is available: "
                        "pages will be read from disk on every pass, which is many times slower")
    return Plan(mode="cpu", lines=lines, fits=need <= hw.ram_total_bytes, warnings=warnings,
                settings={"device": "cpu", "ctx": ctx, "threads": threads, "moe_expert_cache_size": 0},
                expert_cache={"slots_per_layer": 0, "bytes": 0, "resident_share": 0.0},
                decode={"tokens_per_s": round(tps, 1), "hit_rate_assumed": 0.0,
                        "bytes_per_token": {"vram": 0, "pcie": 0, "ram": per_token}},
                bandwidth_gbs={"ram": ram_gbs, "sources": {"ram": ram_src}})


def make_plan(hw: Hardware, g: Geometry, s: Config = Config(), o: PlanOptions = PlanOptions()) -> Plan:
    """The plan for settings `s` (the user's: `moestudio serve` takes the same) on machine `hw`."""
    threads = s.threads or hw.physical_cores
    ram_gbs, ram_src = (o.ram_gbs, "given") if o.ram_gbs else (DEFAULT_RAM_GBS, "assumed (dual-channel DDR4-3200 x 0.8)")
    gpu = hw.gpu
    if gpu is None:
        return _cpu_plan(hw, g, s, o, threads, ram_gbs, ram_src)
    vram_gbs, vram_src = _vram_gbs(gpu, o.vram_gbs)
    pcie_gbs, pcie_src = _pcie_gbs(gpu, o.pcie_gbs)
    if s.miss_fraction is None:
        # What the engine's measurement (engine/moe/tune.py) balances, from bandwidths instead of timings.
        fraction = balanced_fraction(upload_s=1 / pcie_gbs, cpu_s=1 / ram_gbs)
        fraction_how = (f"auto: estimated from {pcie_gbs} GB/s PCIe against {ram_gbs} GB/s RAM; the engine "
                        "measures its own at load")
    else:
        fraction, fraction_how = s.miss_fraction, "given"
    p = place(g, gpu.free_bytes, ctx=s.ctx, prefill_chunk=s.prefill_chunk,
              moe_expert_cache_size=s.moe_expert_cache_size, moe_expert_cache_mib=s.moe_expert_cache_mib,
              vram_budget_mib=s.vram_budget_mib, miss_fraction=fraction, kv_type=o.kv_type)
    slots, cache = p.slots_per_layer, p.cache_bytes
    share = slots / g.n_expert
    # Uniform routing: the hit rate equals the resident share. Real routing is skewed, so a
    # cache filled from a profile hits more often; this is the floor of the ceiling.
    active = g.active_expert_bytes
    hits, misses = share * active, (1 - share) * active
    uploads, cpu = fraction * misses, (1 - fraction) * misses
    t_dense = g.dense_bytes / (vram_gbs * 1e9)
    t_experts = max((hits + uploads) / (vram_gbs * 1e9) + uploads / (pcie_gbs * 1e9), cpu / (ram_gbs * 1e9))
    tps = 1 / (t_dense + t_experts)
    layer_bytes = g.n_expert * g.expert_bytes
    room = p.free_for_experts + p.staging_bytes  # llama.cpp stages nothing
    llama_fit = max(0, min(len(g.moe_layers), room // layer_bytes)) if layer_bytes else 0
    n_cpu_moe = 0 if llama_fit == len(g.moe_layers) else g.moe_layers[len(g.moe_layers) - llama_fit - 1] + 1
    lines = [
        PlanLine("dense weights", g.dense_bytes, "gpu", "attention, router, shared experts, norms and output head; "
                 "read by every token"),
        PlanLine("KV cache", p.kv_bytes, "gpu", f"{p.ctx} tokens x {g.kv_bytes_per_token[o.kv_type]:,} bytes "
                 f"({o.kv_type})"),
        PlanLine("compute workspace", p.workspace_bytes, "gpu", f"estimate: logits, activations and attention scores "
                 f"of a {s.prefill_chunk}-token prefill chunk"),
        PlanLine("upload staging", p.staging_bytes, "gpu", f"{p.staging_per_layer} "
                 f"slot{'s' * (p.staging_per_layer != 1)} per layer for the misses uploaded in a decode step"),
        PlanLine("headroom", p.headroom_bytes, "gpu", "left free for the CUDA context, allocator and other programs "
                 "(1 GiB, or an eighth of a smaller budget)"),
        PlanLine("expert cache", cache, "gpu", f"{slots} of {g.n_expert} experts per layer x {len(g.moe_layers)} layers "
                 f"({share:.0%} resident; {_mib(g.expert_slot_bytes)} per expert in a slot)", slots),
        PlanLine("experts left in RAM", g.experts_bytes_total - slots * len(g.moe_layers) * g.expert_bytes, "ram",
                 "memory-mapped; computed by the CPU pool or uploaded when routed to"),
        PlanLine("token embeddings", g.embedding_bytes, "ram", "one row read per token: stays in RAM"),
        PlanLine("CPU threads", None, "-", "one per physical core for the CPU expert pool", threads),
        PlanLine("miss fraction", None, "-", f"share of distinct misses uploaded to the GPU; the rest run on the CPU "
                 f"({fraction_how})", fraction),
        PlanLine("decode ceiling", None, "-", f"dense {_mib(g.dense_bytes)} + hits {_mib(int(hits))} at {vram_gbs} GB/s "
                 f"VRAM; uploads {_mib(int(uploads))} at {pcie_gbs} GB/s PCIe; CPU misses {_mib(int(cpu))} at "
                 f"{ram_gbs} GB/s RAM, beside the GPU (tokens/s, at hit rate = resident share)", round(tps, 1)),
    ]
    warnings = []
    if p.free_for_experts < 0:
        warnings.append(f"dense weights, KV cache and workspace need {_mib(-p.free_for_experts)} more VRAM than the "
                        f"budget of {_mib(p.budget_bytes)}: lower -c, or run on the CPU (--device cpu)")
    elif cache > p.free_for_experts:
        warnings.append(f"the requested expert cache is {_mib(cache - p.free_for_experts)} larger than the VRAM left "
                        "for it")
    if g.experts_bytes_total - cache + g.embedding_bytes > hw.ram_available_bytes:
        warnings.append("the experts left in RAM exceed the available RAM: misses will page from disk")
    return Plan(
        mode="gpu", lines=lines, fits=p.fits, warnings=warnings,
        settings={"device": "cuda", "ctx": p.ctx, "threads": threads, "moe_expert_cache_size": slots,
                  "moe_gpu_miss_fraction": s.moe_gpu_miss_fraction, "n_cpu_moe": n_cpu_moe},
        expert_cache={"slots_per_layer": slots, "bytes": cache, "resident_share": round(share, 4),
                      "vram_budget_bytes": p.budget_bytes},
        decode={"tokens_per_s": round(tps, 1), "hit_rate_assumed": round(share, 4),
                "bytes_per_token": {"vram": int(g.dense_bytes + hits + uploads), "pcie": int(uploads), "ram": int(cpu)}},
        bandwidth_gbs={"vram": vram_gbs, "pcie": pcie_gbs, "ram": ram_gbs,
                       "sources": {"vram": vram_src, "pcie": pcie_src, "ram": ram_src}},
    )
